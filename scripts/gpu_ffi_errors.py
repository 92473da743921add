"""Errors on the FFI path on a GPU come back as Python exceptions, never as an abort (issue 29).

    python scripts/gpu_ffi_errors.py [--cpu]

Each case runs in a child process (an abort must not take this one down) with JAX on the GPU:

1. a stage (torch code) calling an op without a backward, under `jax.grad` on the FFI path: the backward
   fails inside the FFI call, and the child gets an XLA error naming the op and the fix (`register_autograd`);
2. an op that has no autograd kernel at all: refused when `jax.grad` traces it (`NotDifferentiableError`),
   the child exits 1 with the message;
3. NaN positions into `DistributedMLIP.evaluate` on the GPU: `NonFiniteError` naming the atom.

A child that ends with SIGABRT (rc 134) or "terminate called" fails the check. Prints PASS/FAIL per case and
PASS / FAIL at the end. `--cpu` is a dry run of the same checks on the CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

_PRELUDE = """
import os
os.environ["JAX_PLATFORMS"] = {platform!r}
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, torch
from jax.sharding import NamedSharding, PartitionSpec as P
from nvalchemi_jaxbridge.kernels import TorchOpKernel
from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

@torch.library.custom_op("gpuerr::no_bwd", mutates_args=())
def no_bwd(x: torch.Tensor, a: float) -> torch.Tensor:
    return a * x * x

no_bwd.register_fake(lambda x, a: torch.empty_like(x))
lib = torch.library.Library("gpuerr", "FRAGMENT")
lib.define("no_autograd(Tensor x, float a) -> Tensor")

def plain(x, a):
    with torch.no_grad():  # what a C++ or Triton kernel does: torch records nothing
        return a * x * x

for key in ("CPU", "CUDA"):
    lib.impl("no_autograd", plain, key)
lib.impl("no_autograd", lambda x, a: torch.empty_like(x), "Meta")
mesh = jax.make_mesh((1,), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
print("platform", x.devices().pop().platform)
"""

_CASES = {
    "a stage's op without a backward fails inside the FFI backward as an XLA error": (
        """
stage = torch_function(lambda x: no_bwd(x, 2.0), 1, 1, label="stage", call_path="ffi")
f = lambda x: jax.shard_map(lambda b: jax.lax.psum(stage(b).sum(), "d"), mesh=mesh, in_specs=P("d"),
                            out_specs=P())(x)
print("forward", float(jax.jit(f)(x)))
try:
    jax.jit(jax.grad(f))(x).block_until_ready()
except Exception as e:
    print("caught", type(e).__name__, " ".join(str(e).split()))
""", 0, ("forward 280.0", "caught JaxRuntimeError", "gpuerr.no_bwd", "register_autograd")),
    "an op with no autograd kernel is refused when jax.grad traces it": (
        """
k = TorchOpKernel(torch.ops.gpuerr.no_autograd.default, call_path="ffi")
print("forward", k(x, 2.0).tolist())
jax.grad(lambda x: k(x, 2.0).sum())(x)
""", 1, ("forward [0.0, 2.0, 8.0", "NotDifferentiableError", "gpuerr::no_autograd", "register_autograd")),
    "NaN positions into DistributedMLIP.evaluate name the atom": (
        """
from ase.build import bulk
from nvalchemi_jaxbridge.mlip import MPNN, MPNNWrapper, DistributedMLIP
atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
model = DistributedMLIP(MPNNWrapper(MPNN([29], seed=0).to("cuda" if {platform!r} == "cuda" else "cpu")), n_devices=1)
print("energy", model.evaluate(atoms.positions, atoms.numbers, atoms.cell.array)["energy"])
pos = atoms.positions.copy(); pos[5, 0] = np.nan
model.evaluate(pos, atoms.numbers, atoms.cell.array)
""", 1, ("energy -", "NonFiniteError", "atoms [5]")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU")
    args = parser.parse_args()
    platform = "cpu" if args.cpu else "cuda"
    ok = True
    for name, (body, rc, wanted) in _CASES.items():
        code = textwrap.dedent(_PRELUDE.format(platform=platform)) + textwrap.dedent(body).replace("{platform!r}", repr(platform))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             env=os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        text = res.stdout + res.stderr
        missing = [w for w in wanted if w not in text]
        good = (res.returncode == rc and not missing and "terminate called" not in text
                and f"platform {'cpu' if args.cpu else 'gpu'}" in text)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} {name}: exit {res.returncode} (want {rc})"
              + (f", missing {missing}" if missing else ""))
        if not good:
            print(textwrap.indent(text[-3000:], "    "))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
