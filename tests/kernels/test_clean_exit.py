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



_CHILD_NO_BACKWARD = textwrap.dedent(
    """
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, torch
    from jax.sharding import NamedSharding, PartitionSpec as P
    from nvalchemi_jaxbridge.kernels import TorchOpKernel
    from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

    @torch.library.custom_op("ktabort::no_bwd", mutates_args=())
    def no_bwd(x: torch.Tensor, a: float) -> torch.Tensor:
        return a * x * x

    no_bwd.register_fake(lambda x, a: torch.empty_like(x))

    lib = torch.library.Library("ktabort", "FRAGMENT")
    lib.define("cpu_only(Tensor x, float a) -> Tensor")

    def cpu_only(x, a):
        with torch.no_grad():  # what a C++ or Triton kernel does: torch records nothing
            return a * x * x

    lib.impl("cpu_only", cpu_only, "CPU")
    lib.impl("cpu_only", lambda x, a: torch.empty_like(x), "Meta")

    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))

    # a stage (torch code, no trace-time check) calling an op without a backward: the FFI backward fails
    stage = torch_function(lambda x: no_bwd(x, 2.0), 1, 1, label="stage", call_path="ffi")
    f = lambda x: jax.shard_map(lambda b: jax.lax.psum(stage(b).sum(), "d"), mesh=mesh, in_specs=P("d"),
                                out_specs=P())(x)
    print("forward", float(jax.jit(f)(x)))
    try:
        jax.jit(jax.grad(f))(x).block_until_ready()
    except Exception as e:
        print("stage", type(e).__name__, " ".join(str(e).split()))

    # an op with no autograd kernel at all: refused when traced, before any call reaches C++ (uncaught: exit 1)
    k = TorchOpKernel(torch.ops.ktabort.cpu_only.default, call_path="ffi")
    print("forward", k(jnp.arange(3.0), 2.0).tolist())
    print(jax.grad(lambda x: k(x, 2.0).sum())(jnp.arange(3.0)))
    """
)


def test_missing_backward_on_the_ffi_path_is_a_python_error_not_an_abort():
    """A torch op without a backward under jax.grad on the FFI path (issue 29): the process gets a Python
    exception naming the op and the fix, and exits 1 (not SIGABRT, 134): refused at trace time where the
    op has no autograd kernel; an XLA error status where torch raises inside the FFI backward."""
    env = {k: v for k, v in os.environ.items() if k != "JAXBRIDGE_KERNEL_PATH"}
    res = subprocess.run([sys.executable, "-c", _CHILD_NO_BACKWARD], capture_output=True, text=True, env=env,
                         timeout=280)
    assert res.returncode == 1, f"exit {res.returncode}:\n{res.stderr[-3000:]}"
    assert "terminate called" not in res.stderr
    lines = res.stdout.splitlines()
    assert "forward 280.0" in lines  # 2 * sum(x^2), x = 0..7
    stage = [ln for ln in lines if ln.startswith("stage ")]
    assert len(stage) == 1, res.stdout
    assert stage[0].startswith("stage JaxRuntimeError")
    for part in ("failed inside its FFI backward call", "ktabort.no_bwd", "register_autograd",
                 "use the op's forces output"):
        assert part in stage[0], stage[0]
    assert "forward [0.0, 2.0, 8.0]" in lines
    raised = [ln for ln in res.stderr.splitlines() if ln.startswith("nvalchemi_jaxbridge.kernels.vjp.")]
    assert len(raised) == 1, res.stderr[-3000:]
    assert raised[0].startswith("nvalchemi_jaxbridge.kernels.vjp.NotDifferentiableError: jax.grad reached op "
                                "ktabort::cpu_only, but the op has no autograd kernel"), raised[0]
    assert "register_autograd('ktabort::cpu_only'" in raised[0] and "use the op's forces output" in raised[0]
