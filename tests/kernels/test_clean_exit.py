"""A process that differentiates torch ops on the FFI path exits cleanly (issue 14): after catching
NotDifferentiableError on one device, and with torch graphs still kept for backwards that never ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, torch
    from nvalchemi_jaxbridge.kernels import NotDifferentiableError, TorchOpKernel

    @torch.library.custom_op("ktexit::no_grad", mutates_args=())
    def no_grad(x: torch.Tensor, a: float) -> torch.Tensor:
        return a * x * x

    no_grad.register_fake(lambda x, a: torch.empty_like(x))

    @torch.library.custom_op("ktexit::sq", mutates_args=())
    def sq(x: torch.Tensor) -> torch.Tensor:
        return x * x

    sq.register_fake(lambda x: torch.empty_like(x))
    sq.register_autograd(lambda ctx, g: 2 * ctx.x * g, setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))

    x = jnp.arange(3.0)
    k = TorchOpKernel(no_grad, call_path="ffi")
    print("forward", jax.jit(lambda x: k(x, 2.0))(x).tolist())
    for how, grad in (("eager", jax.grad), ("jit", lambda f: jax.jit(jax.grad(f)))):
        try:
            grad(lambda x: k(x, 2.0).sum())(x)
        except NotDifferentiableError as e:
            print("caught", how, str(e).split(",")[0])
    ks = TorchOpKernel(sq, call_path="ffi")
    pullbacks = [jax.vjp(lambda x: ks(x), x + i)[1] for i in range(3)]  # graphs kept at exit (a Python autograd node)
    print("kept", ks.kept_graphs())
    """
)


def test_not_differentiable_on_one_device_then_exit_is_clean():
    env = {k: v for k, v in os.environ.items() if k != "JAXBRIDGE_KERNEL_PATH"}
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, f"exit {res.returncode}:\n{res.stderr[-3000:]}"
    lines = res.stdout.splitlines()
    assert "forward [0.0, 2.0, 8.0]" in lines
    for how in ("eager", "jit"):
        assert f"caught {how} jax.grad reached op ktexit::no_grad" in lines
    assert "kept 3" in lines

