"""Registration, fake tensors, autograd (finite differences) and errors of the demo torch/Triton ops."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvalchemi_jaxbridge.demo.torch_ops  # noqa: F401

OPS = torch.ops.jaxbridge_demo
SPECS = pathlib.Path(__file__).parents[2] / "nvalchemi_jaxbridge" / "app" / "specs"  # package data


def _cluster(n=5, seed=0, dtype=torch.float64):
    """A small non-periodic cluster with all pairs between 2.8 and ~6 Å (inside an 8.5 Å cutoff)."""
    rng = np.random.default_rng(seed)
    pts = []
    while len(pts) < n:
        p = rng.uniform(0, 5.0, 3)
        if all(np.linalg.norm(p - q) > 2.8 for q in pts):
            pts.append(p)
    return torch.tensor(np.array(pts), dtype=dtype)


@pytest.mark.slow
def test_import_isolation_and_lazy_registration():
    code = (
        "import sys, nvalchemi_jaxbridge, nvalchemi_jaxbridge.demo\n"
        "import nvalchemi_jaxbridge.demo.systems, nvalchemi_jaxbridge.demo.reference\n"
        "print('jax' in sys.modules, 'torch' in sys.modules)\n"
        "import torch\n"
        "print(hasattr(torch.ops.jaxbridge_demo, 'lj_energy_forces'))\n"
        "import nvalchemi_jaxbridge.demo.torch_ops\n"
        "print(all(hasattr(torch.ops.jaxbridge_demo, n) for n in ['lj_energy_forces', "
        "'lj_energy_forces_triton', 'dsf_energy_forces', 'dsf_energy_forces_triton']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "True"]


@pytest.mark.parametrize("name", ["lj_energy_forces", "lj_energy_forces_triton"])
def test_lj_autograd_matches_finite_differences(name):
    pos = _cluster().requires_grad_(True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    op = getattr(OPS, name)
    # both outputs: energy (first derivative) and forces (Hessian path through plain torch)
    assert torch.autograd.gradcheck(lambda p: op(p, mask, 0.0104, 3.4, 8.5), (pos,), eps=1e-6, atol=1e-7)
    e, f = op(pos, mask, 0.0104, 3.4, 8.5)
    (g,) = torch.autograd.grad(e, pos)
    torch.testing.assert_close(g, -f.detach(), rtol=0, atol=0)  # fast path returns -forces exactly


@pytest.mark.parametrize("name", ["dsf_energy_forces", "dsf_energy_forces_triton"])
def test_dsf_autograd_matches_finite_differences(name):
    pos = _cluster(seed=1).requires_grad_(True)
    q = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.2], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False])
    op = getattr(OPS, name)
    assert torch.autograd.gradcheck(
        lambda p, c: op(p, c, mask, 0.25, 8.5, 1120.0, 0.317), (pos, q), eps=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("name", ["lj_energy_forces", "lj_energy_forces_triton"])
def test_fake_tensor_shapes(name):
    with FakeTensorMode():
        for dt in (torch.float32, torch.float64):
            e, f = getattr(OPS, name)(torch.empty(7, 3, dtype=dt), torch.empty(7, dtype=torch.bool))
            assert e.shape == () and f.shape == (7, 3) and e.dtype == f.dtype == dt
        e, f = OPS.dsf_energy_forces_triton(torch.empty(5, 3), torch.empty(5), torch.empty(5))
        assert e.shape == () and f.shape == (5, 3)


def test_opcheck_torch_ops():
    pos = _cluster(seed=2)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    torch.library.opcheck(OPS.lj_energy_forces.default, (pos, mask, 0.0104, 3.4, 8.5))
    q = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    torch.library.opcheck(OPS.dsf_energy_forces.default, (pos, q, mask, 0.25, 8.5, 1120.0, 0.317, 14.4))


def test_errors_name_op_argument_and_fix():
    pos = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lj_energy_forces: owned_mask must have shape \(4,\)"):
        OPS.lj_energy_forces(pos, torch.ones(3))
    with pytest.raises(TypeError, match=r"jaxbridge_demo::dsf_energy_forces_triton: charges .*cast"):
        OPS.dsf_energy_forces_triton(pos, torch.ones(4, dtype=torch.float32), torch.ones(4))
    with pytest.raises(TypeError, match="positions must be float32 or float64"):
        OPS.lj_energy_forces(torch.zeros(4, 3, dtype=torch.int64), torch.ones(4))
    with pytest.raises(ValueError, match="sigma must be positive"):
        OPS.lj_energy_forces_triton(pos, torch.ones(4), 0.01, 0.0, 8.5)


def test_example_specs_use_the_nvalchemi_format_and_registered_ops():
    want = {"lj_argon.json": ("lj_energy_forces", ["0"]),
            "lj_argon_triton.json": ("lj_energy_forces_triton", ["0"]),
            "lj_argon_cells.json": ("lj_energy_forces_cells", ["0"]),
            "dsf_rocksalt.json": ("dsf_energy_forces", ["0", "1"]),
            "dsf_rocksalt_triton.json": ("dsf_energy_forces_triton", ["0", "1"])}
    for fname, (op_name, gathered) in want.items():
        d = json.loads((SPECS / fname).read_text())
        assert list(d) == ["policy", "custom_ops", "third_party_helpers"]
        assert d["policy"] == {"kind": "halo", "scatter_mode": "halo_correction", "gather_mode": "halo_read"}
        assert d["third_party_helpers"] == [] and len(d["custom_ops"]) == 1
        (op,) = d["custom_ops"]
        assert list(op) == ["op", "arg_transforms", "output_transforms"]
        assert op["op"] == f"jaxbridge_demo::{op_name}"
        assert op["arg_transforms"] == {k: {"type": "gather_inputs"} for k in gathered}
        assert op["output_transforms"] == {
            "0": {"type": "all_reduce_sum", "replicated_consumer": False},
            "1": {"type": "scatter_outputs"},
        }
        # gathered positions are per-row Tensor arguments of the registered schema
        schema = getattr(OPS, op_name).default._schema
        for k in gathered:
            arg = schema.arguments[int(k)]
            assert str(arg.type) == "Tensor" and arg.name in ("positions", "charges")
        assert [str(r.type) for r in schema.returns] == ["Tensor", "Tensor"]
