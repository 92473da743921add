"""Where the time of a torch -> JAX DLPack import goes on one GPU (issue 7, front door).

    PYTHONPATH=. python3 scripts/gpu_import_profile.py [--rows 4096] [--iters 300]

One process, one GPU, a (rows, 3) float32 torch block. Each line is the median wall time of
one step followed by a full sync (torch.cuda.synchronize + block_until_ready), steps timed
in interleaved rounds:

  floor           jitted x + 1 on a pre-built JAX array
  fresh XLA       jitted x + 1 on a new jax.device_put array each call (XLA-owned memory)
  dlpack export   tensor.__dlpack__(stream=JAX's external-ready stream)
  dlpack import   that capsule -> a JAX buffer (jaxlib's dlpack_managed_tensor_to_buffer)
  from_dlpack     the public jax.dlpack.from_dlpack (the two above + a jnp.asarray wrap)
  bridge import   nvalchemi_jaxbridge's torch_to_jax
  fresh import    jitted x + 1 on a freshly imported array each call (import included)
  import, synced  the same, the tensor made ready by torch.cuda.synchronize and imported with no stream

"fresh import" - "from_dlpack" - "floor" is what a program pays for its input being foreign memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from nvalchemi_jaxbridge.kernels.dlpack import torch_to_jax  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--iters", type=int, default=300)
    a = p.parse_args()
    dev = jax.devices()[0]
    t = torch.randn(a.rows, 3, device="cuda:0")
    x0 = jax.device_put(jnp.ones((a.rows, 3), jnp.float32), dev)
    f = jax.jit(lambda x: x + 1.0)
    from jax._src.lib import _jax

    dl_dev = dev  # JAX's device for the tensor (same GPU)

    def export():
        return t.__dlpack__(stream=dl_dev.get_stream_for_external_ready_events())

    def to_buffer(cap, s):
        try:  # jaxlib's private signature: (capsule, device, stream, copy, DLDeviceType) in 0.12
            return _jax.dlpack_managed_tensor_to_buffer(cap, dl_dev, s, False, 2)
        except TypeError:  # older: (capsule, device, stream[, copy])
            try:
                return _jax.dlpack_managed_tensor_to_buffer(cap, dl_dev, s, False)
            except TypeError:
                return _jax.dlpack_managed_tensor_to_buffer(cap, dl_dev, s)

    def raw_import():
        s = dl_dev.get_stream_for_external_ready_events()
        return to_buffer(t.__dlpack__(stream=s), s)

    def synced_import():
        torch.cuda.synchronize()
        return to_buffer(t.__dlpack__(stream=None), None)

    steps = {
        "floor": lambda: f(x0),
        "fresh XLA": lambda: f(jax.device_put(jnp.zeros((a.rows, 3), jnp.float32), dev)),
        "dlpack export": export,
        "dlpack import": raw_import,
        "from_dlpack": lambda: jax.dlpack.from_dlpack(t),
        "bridge import": lambda: torch_to_jax(t),
        "fresh import": lambda: f(torch_to_jax(t)),
        "import, synced": lambda: f(synced_import()),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    rounds = 10
    for r in range(rounds + 1):
        for name, fn in steps.items():
            n = a.iters // rounds
            for i in range(n + (5 if r == 0 else 0)):
                t0 = time.perf_counter()
                out = fn()
                if hasattr(out, "block_until_ready"):
                    out.block_until_ready()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if r > 0:
                    times[name].append(dt)
    print(f"jax {jax.__version__}, torch {torch.__version__}, {dev.device_kind}, rows {a.rows}")
    print("| step | median (us) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
