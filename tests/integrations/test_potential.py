"""KernelPotential's declaration checks, the engine's layout cache, and what importing the package loads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nvalchemi_jaxbridge import AllReduceSum, DistributionSpec, GatherInputs, HaloStoragePolicy, OpAdapter, PlainShard
from nvalchemi_jaxbridge.demo import jax_potentials
from nvalchemi_jaxbridge.integrations import KernelPotential
from tests.integrations._common import EPSILON, RC, SIGMA, lj_potential, lj_spec

LJ_ARGS = ("positions", "owned_mask", EPSILON, SIGMA, RC)


def _adapter(**kw):
    kw.setdefault("gather_inputs", [0])
    kw.setdefault("all_reduce_outputs", [0])
    return OpAdapter(jax_potentials.lj_energy_forces, **kw)


def _spec(*adapters):
    return DistributionSpec(policy=HaloStoragePolicy(), adapters=adapters)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(spec=DistributionSpec(PlainShard(), adapters=(_adapter(),))), ValueError, r"a halo policy"),
    (dict(spec=_spec(_adapter(), OpAdapter(jax_potentials.dsf_energy_forces, gather_inputs=[0]))), ValueError,
     r"has 2 adapters .* say which one gives the energy with adapter="),
    (dict(adapter="nope"), ValueError, r"adapter='nope' matches 0 of the spec's adapters"),
    (dict(args="positions"), TypeError, r"args must be a tuple"),
    (dict(args=("owned_mask", EPSILON)), ValueError, r"name 'positions' exactly once"),
    (dict(args=("positions", "owned_mask", np.ones(3))), TypeError, r"args\[2\] is ndarray"),
    (dict(args=("positions", "owned mask")), ValueError, r"args\[1\] = 'owned mask' is neither"),
    (dict(spec=_spec(_adapter(gather_inputs=[1]))), ValueError,
     r"args\[0\] is 'positions', but the adapter has no transform on argument 0; .*gather_inputs=\[0\]"),
    (dict(spec=_spec(_adapter(gather_inputs=[0, 1]))), ValueError, r"'owned_mask' .* declares GatherInputs\(\)"),
    (dict(spec=_spec(_adapter(gather_inputs=[0, 7]))), ValueError, r"argument 7, but args has only 5 items"),
    (dict(energy_output=1), ValueError, r"output 1 has no AllReduceSum\(\).*all_reduce_outputs=\[1\]"),
    (dict(energy_output=-1), ValueError, r"energy_output must be an output index >= 0"),
    (dict(cutoff=0.0), ValueError, r"cutoff must be a finite number > 0"),
    (dict(headroom=0.5), ValueError, r"headroom must be a finite number >= 1"),
    (dict(dtype="float16"), ValueError, r"dtype must be one of"),
    (dict(n_devices=2, mesh="m"), ValueError, r"give n_devices or mesh, not both"),
])
def test_declaration_errors(kwargs, error, match):
    base = dict(spec=_spec(_adapter()), args=LJ_ARGS, cutoff=RC)
    with pytest.raises(error, match=match):
        KernelPotential(**{**base, **kwargs})


def test_declaration_normalises():
    a = _adapter(scatter_outputs=[1])
    pot = KernelPotential(_spec(a), args=list(LJ_ARGS), cutoff=6)
    assert pot.adapter is a and pot.args == LJ_ARGS and pot.cutoff == 6.0 and pot.per_atom_names == ()
    assert KernelPotential(_spec(a), args=LJ_ARGS, cutoff=6.0, adapter=a.op).adapter is a
    assert isinstance(pot.adapter.arg_transforms[0], GatherInputs)
    assert isinstance(pot.adapter.output_transforms[0], AllReduceSum)


def test_per_atom_errors():
    dsf = OpAdapter(jax_potentials.dsf_energy_forces, gather_inputs=[0, 1], all_reduce_outputs=[0])
    pot = KernelPotential(_spec(dsf), args=("positions", "charges", "owned_mask"), cutoff=6.0, n_devices=2)
    assert pot.per_atom_names == ("charges",)
    pos, cell = np.zeros((2, 3)), np.eye(3) * 20.0
    with pytest.raises(ValueError, match=r"per_atom has no 'charges'; pass per_atom=\{'charges': array of 2"):
        pot.prepare(pos, [11, 17], cell)
    with pytest.raises(ValueError, match=r"per_atom\['charges'\] has shape \(3,\), expected 2 rows"):
        pot.prepare(pos, [11, 17], cell, per_atom={"charges": np.ones(3)})
    with pytest.raises(ValueError, match=r"per_atom has \['spins'\], which the recipe"):
        pot.prepare(pos, [11, 17], cell, per_atom={"charges": np.ones(2), "spins": np.ones(2)})
    with pytest.raises(ValueError, match=r"periodic along lattice vector 2 but cell\[2\] is zero"):
        pot.prepare(pos, [11, 17], np.diag([20.0, 20.0, 0.0]), (True, True, True))


def test_engine_rejects_what_is_not_a_potential():
    from nvalchemi_jaxbridge.integrations import Engine

    with pytest.raises(TypeError, match=r"Engine: int has no prepare\(\)"):
        Engine(3)


def test_torch_op_without_autograd_names_register_autograd():
    """Forces are dE/dR by jax.grad: an op torch cannot differentiate fails with the fix, not silently."""
    torch = pytest.importorskip("torch")
    from ase.cluster import Icosahedron

    from nvalchemi_jaxbridge.integrations.engine import Engine

    if not hasattr(torch.ops.jaxbridge_itest, "pair_energy_no_grad"):
        @torch.library.custom_op("jaxbridge_itest::pair_energy_no_grad", mutates_args=(),
                                 schema="(Tensor positions, Tensor owned_mask) -> Tensor")
        def pair_energy_no_grad(positions, owned_mask):
            return (positions.square().sum(-1) * owned_mask.to(positions.dtype)).sum()

        @pair_energy_no_grad.register_fake
        def _(positions, owned_mask):
            return positions.new_empty(())

    op = OpAdapter(torch.ops.jaxbridge_itest.pair_energy_no_grad, gather_inputs=[0], all_reduce_outputs=[0])
    pot = KernelPotential(_spec(op), args=("positions", "owned_mask"), cutoff=5.0, n_devices=2)
    atoms = Icosahedron("Ar", noshells=2, latticeconstant=5.26)
    with pytest.raises(Exception, match=r"must be differentiable.*register_autograd") as info:
        Engine(pot).compute(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    assert type(info.value).__name__ == "NotDifferentiableError"


def test_engine_reuses_and_rebuilds_the_layout():
    """Unchanged atoms: no re-plan; a move past skin/2: re-plan (flagged by the program); new numbers: a new
    layout; new cell: re-plan with the old capacities."""
    from ase.cluster import Icosahedron

    from nvalchemi_jaxbridge.integrations import Engine

    atoms = Icosahedron("Ar", noshells=2, latticeconstant=5.26)
    eng = Engine(lj_potential(n_devices=2))
    args = (atoms.numbers, atoms.cell.array, atoms.pbc)
    first = eng.update(atoms.positions, *args)
    eng.compute(atoms.positions + 0.01, *args)
    assert eng.state is first and eng.rebuilds == 0
    moved = atoms.positions.copy()
    moved[0, 0] += 0.2  # > skin / 2 = 0.15
    assert eng.update(moved, *args) is first  # update leaves moved atoms to compute's in-program flag
    eng.compute(moved, *args)
    assert eng.state is not first and eng.rebuilds == 1
    assert eng.prepares == 1
    numbers = atoms.numbers.copy()
    numbers[0] = 36
    with pytest.raises(ValueError, match=r"atomic numbers \[36\] are not among"):
        eng.update(moved, numbers, *args[1:])
    assert eng.prepares == 1
    bigger = Icosahedron("Ar", noshells=3, latticeconstant=5.26)  # another atom count: a new layout
    assert eng.update(bigger.positions, bigger.numbers, bigger.cell.array, bigger.pbc).plan.n_atoms == 55
    assert eng.prepares == 2


def _lj_energy_only(positions, owned_mask):
    """The demo LJ block's energy alone: a kernel with one bare scalar output."""
    return jax_potentials.lj_energy_forces(positions, owned_mask, EPSILON, SIGMA, RC)[0]


def test_kernel_with_a_bare_scalar_output():
    """A kernel returning just the energy; forces by autodiff vs ASE's LennardJones (open cluster, 2 devices)."""
    from ase.cluster import Icosahedron

    from nvalchemi_jaxbridge.integrations import JaxBridgeCalculator
    from tests.integrations._common import ase_lj

    op = OpAdapter(_lj_energy_only, gather_inputs=[0], all_reduce_outputs=[0])
    atoms = Icosahedron("Ar", noshells=2, latticeconstant=5.26)
    atoms.positions += np.random.default_rng(5).normal(scale=0.1, size=atoms.positions.shape)
    ref = atoms.copy()
    ref.calc = ase_lj()
    atoms.calc = JaxBridgeCalculator(KernelPotential(_spec(op), args=("positions", "owned_mask"), cutoff=RC,
                                                     n_devices=2))
    assert abs(atoms.get_potential_energy() - ref.get_potential_energy()) <= 1e-12
    np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-12)


def test_importing_the_package_loads_neither_ase_nor_jax():
    code = (
        "import sys, nvalchemi_jaxbridge.integrations as i; 'JaxBridgeCalculator' in dir(i); "
        "bad = [m for m in ('ase', 'jax', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_unknown_name_names_the_package():
    import nvalchemi_jaxbridge.integrations as integrations

    with pytest.raises(AttributeError, match=r"nvalchemi_jaxbridge.integrations.*'nope'"):
        integrations.nope  # noqa: B018


def test_lj_potential_is_a_kernel_potential():
    assert isinstance(lj_potential(), KernelPotential) and lj_potential().spec == lj_spec()
