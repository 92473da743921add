"""The demo potentials as torch custom ops and Triton ops (``jaxbridge_demo::`` namespace).

Importing this module registers four ops (and only importing it does):

- ``jaxbridge_demo::lj_energy_forces(positions, owned_mask, epsilon, sigma, cutoff)``
- ``jaxbridge_demo::dsf_energy_forces(positions, charges, owned_mask, alpha, cutoff,
  born_a, born_rho, coulomb_constant)``
- ``..._triton`` variants of both, with the same schema, launching Triton kernels.

Block convention, formulas and units are those of ``jax_potentials``; every op
returns ``(energy (), forces (R, 3))`` in the dtype of positions (float32 or float64).

Autograd: d energy / d positions = -forces (saved from the forward; no recompute).
A non-zero cotangent for ``forces`` (a Hessian-vector product) and any gradient
for ``charges`` are computed by recomputing the potential in plain torch math
and differentiating it with torch autograd. ``owned_mask`` gets no gradient
(it is a row selector, not a physical input). The backward is not itself
differentiable (no third derivatives).

Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported.
"""

import math

import torch
from torch import Tensor

from ._checks import check_block, check_scalars
from .params import DSFParams, LJParams
from .units import COULOMB_EV_A

NAMESPACE = "jaxbridge_demo"
_LJ = LJParams()
_DSF = DSFParams()
_BLOCK = 32


# --- plain torch math (forward of the torch ops, and the recompute path of every backward) ---


def _dense_pairs(positions: Tensor, owned_mask: Tensor, cutoff: float):
    """(d = r_i - r_j, safe r2, weight w_ij, 0 outside the cutoff and on the diagonal)."""
    d = positions[:, None, :] - positions[None, :, :]
    r2 = (d * d).sum(-1)
    eye = torch.eye(positions.shape[0], dtype=torch.bool, device=positions.device)
    inside = (r2 <= cutoff * cutoff) & ~eye
    own = owned_mask.to(positions.dtype)
    w = torch.where(inside, 0.5 * (own[:, None] + own[None, :]), torch.zeros_like(r2))
    return d, torch.where(inside, r2, torch.ones_like(r2)), w


def lj_torch(positions, owned_mask, epsilon, sigma, cutoff) -> tuple[Tensor, Tensor]:
    """Lennard-Jones block energy and forces in plain torch (see ``jax_potentials.lj_energy_forces``)."""
    d, r2, w = _dense_pairs(positions, owned_mask, cutoff)
    return lj_pair_terms(d, r2, w, epsilon, sigma, cutoff)


def lj_pair_terms(d: Tensor, r2: Tensor, w: Tensor, epsilon: float, sigma: float, cutoff: float
                  ) -> tuple[Tensor, Tensor]:
    """(energy, forces) of LJ pairs `(..., K)`: separations `d (..., K, 3)`, safe `r2`, weights `w` (0 = no pair).

    The shifted pair energy and force of every LJ op in plain torch (dense pair
    matrices here, neighbour tables in ``torch_cells``); forces are summed over the last pair axis.
    """
    sr6_cut = (sigma / cutoff) ** 6
    sr6 = (sigma * sigma / r2) ** 3
    u = 4.0 * epsilon * (sr6 * sr6 - sr6 - (sr6_cut * sr6_cut - sr6_cut))
    fscal = 24.0 * epsilon * (2.0 * sr6 * sr6 - sr6) / r2
    return 0.5 * (w * u).sum(), ((w * fscal)[..., None] * d).sum(1)


def _dsf_constants(alpha, cutoff, born_rho, coulomb_constant) -> dict[str, float]:
    """Cutoff-dependent constants of the DSF potential."""
    two_a_pi = 2.0 * alpha / math.sqrt(math.pi)
    erfc_rc = math.erfc(alpha * cutoff)
    return {
        "two_a_pi": two_a_pi,
        "erfc_rc": erfc_rc,
        "shift_f": erfc_rc / cutoff**2 + two_a_pi * math.exp(-((alpha * cutoff) ** 2)) / cutoff,
        "exp_rc": math.exp(-cutoff / born_rho),
        "self_coef": coulomb_constant * (erfc_rc / (2 * cutoff) + alpha / math.sqrt(math.pi)),
    }


def dsf_torch(
    positions, charges, owned_mask, alpha, cutoff, born_a, born_rho, coulomb_constant
) -> tuple[Tensor, Tensor]:
    """DSF Coulomb + Born-Mayer block energy and forces in plain torch (see ``jax_potentials``)."""
    c = _dsf_constants(alpha, cutoff, born_rho, coulomb_constant)
    d, r2, w = _dense_pairs(positions, owned_mask, cutoff)
    r = torch.sqrt(r2)
    qq = coulomb_constant * charges[:, None] * charges[None, :]
    erfc_r = torch.special.erfc(alpha * r)
    u_c = erfc_r / r - c["erfc_rc"] / cutoff + c["shift_f"] * (r - cutoff)
    f_c = erfc_r / r2 + c["two_a_pi"] * torch.exp(-((alpha * r) ** 2)) / r - c["shift_f"]
    exp_r = torch.exp(-r / born_rho)
    u = qq * u_c + born_a * (exp_r - c["exp_rc"])
    fscal = (qq * f_c + born_a / born_rho * exp_r) / r
    own = owned_mask.to(positions.dtype)
    energy = 0.5 * (w * u).sum() - c["self_coef"] * (own * charges * charges).sum()
    return energy, ((w * fscal)[..., None] * d).sum(1)


# --- argument checks ---


def _check_inputs(where: str, positions: Tensor, owned_mask: Tensor, charges: Tensor | None = None):
    """Shapes, dtypes and devices of a block call."""
    check_block(where, positions, owned_mask, charges)
    if positions.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"{NAMESPACE}::{where}: positions must be float32 or float64, got {positions.dtype}."
        )
    for name, t in (("owned_mask", owned_mask), ("charges", charges)):
        if t is not None and t.device != positions.device:
            raise ValueError(
                f"{NAMESPACE}::{where}: {name} is on {t.device} but positions on {positions.device}; "
                "move both to the same device."
            )
    if charges is not None and charges.dtype != positions.dtype:
        raise TypeError(
            f"{NAMESPACE}::{where}: charges ({charges.dtype}) must have the dtype of positions "
            f"({positions.dtype}); cast one of them explicitly."
        )


def _fake(positions: Tensor, *args) -> tuple[Tensor, Tensor]:
    """Output metadata: a scalar energy and (R, 3) forces in the positions' dtype."""
    return positions.new_empty(()), positions.new_empty(positions.shape)


# --- autograd (shared by the torch and Triton variants) ---


def _nonzero(t: Tensor | None) -> bool:
    """Whether a cotangent is present and non-zero (a host sync; fine for a demo)."""
    return t is not None and bool(torch.any(t != 0))


def _setup_lj(ctx, inputs, output):
    positions, owned_mask, *scalars = inputs
    ctx.save_for_backward(positions, owned_mask, output[1])
    ctx.scalars = scalars


def _backward_lj(ctx, g_energy, g_forces):
    positions, owned_mask, forces = ctx.saved_tensors
    grad = -forces * g_energy
    if _nonzero(g_forces):
        with torch.enable_grad():
            p = positions.detach().requires_grad_(True)
            _, f = lj_torch(p, owned_mask, *ctx.scalars)
            (hvp,) = torch.autograd.grad(f, p, g_forces)
        grad = grad + hvp
    return grad, None, None, None, None


def _setup_dsf(ctx, inputs, output):
    positions, charges, owned_mask, *scalars = inputs
    ctx.save_for_backward(positions, charges, owned_mask, output[1])
    ctx.scalars = scalars


def _backward_dsf(ctx, g_energy, g_forces):
    positions, charges, owned_mask, forces = ctx.saved_tensors
    need_q = ctx.needs_input_grad[1]
    if not _nonzero(g_forces) and not need_q:
        return -forces * g_energy, None, None, None, None, None, None, None
    with torch.enable_grad():
        p = positions.detach().requires_grad_(True)
        q = charges.detach().requires_grad_(need_q)
        e, f = dsf_torch(p, q, owned_mask, *ctx.scalars)
        outs, cots = [e], [g_energy]
        if g_forces is not None:
            outs.append(f)
            cots.append(g_forces)
        grads = torch.autograd.grad(outs, [p, q] if need_q else [p], cots, allow_unused=True)
    g_q = (grads[1] if grads[1] is not None else torch.zeros_like(charges)) if need_q else None
    return grads[0], g_q, None, None, None, None, None, None


# --- the torch custom ops ---


@torch.library.custom_op(f"{NAMESPACE}::lj_energy_forces", mutates_args=())
def lj_energy_forces(
    positions: Tensor,
    owned_mask: Tensor,
    epsilon: float = _LJ.epsilon,
    sigma: float = _LJ.sigma,
    cutoff: float = _LJ.cutoff,
) -> tuple[Tensor, Tensor]:
    """Lennard-Jones on a block of halo rows: (energy partial, forces (R, 3))."""
    _check_inputs("lj_energy_forces", positions, owned_mask)
    check_scalars("lj_energy_forces", epsilon=epsilon, sigma=sigma, cutoff=cutoff)
    return lj_torch(positions, owned_mask, epsilon, sigma, cutoff)


@torch.library.custom_op(f"{NAMESPACE}::dsf_energy_forces", mutates_args=())
def dsf_energy_forces(
    positions: Tensor,
    charges: Tensor,
    owned_mask: Tensor,
    alpha: float = _DSF.alpha,
    cutoff: float = _DSF.cutoff,
    born_a: float = _DSF.born_a,
    born_rho: float = _DSF.born_rho,
    coulomb_constant: float = COULOMB_EV_A,
) -> tuple[Tensor, Tensor]:
    """DSF Coulomb + Born-Mayer on a block of halo rows: (energy partial, forces (R, 3))."""
    _check_inputs("dsf_energy_forces", positions, owned_mask, charges)
    check_scalars(
        "dsf_energy_forces", alpha=alpha, cutoff=cutoff, born_a=born_a, born_rho=born_rho,
        coulomb_constant=coulomb_constant,
    )
    return dsf_torch(positions, charges, owned_mask, alpha, cutoff, born_a, born_rho, coulomb_constant)


# --- the Triton ops ---

from torch.library import triton_op, wrap_triton  # noqa: E402

import triton  # noqa: E402

from . import _triton_kernels as _tk  # noqa: E402


def _check_triton_device(where: str, positions: Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under the interpreter."""
    interpreted = type(_tk.lj_kernel).__name__ == "InterpretedFunction"
    if positions.device.type == "cpu" and not interpreted:
        raise RuntimeError(
            f"{NAMESPACE}::{where}: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before Triton is first imported to run on CPU tensors; or use the torch op "
            f"{NAMESPACE}::{where.removesuffix('_triton')}."
        )


@triton_op(f"{NAMESPACE}::lj_energy_forces_triton", mutates_args=())
def lj_energy_forces_triton(
    positions: Tensor,
    owned_mask: Tensor,
    epsilon: float = _LJ.epsilon,
    sigma: float = _LJ.sigma,
    cutoff: float = _LJ.cutoff,
) -> tuple[Tensor, Tensor]:
    """Lennard-Jones on a block, Triton kernel: (energy partial, forces (R, 3))."""
    _check_inputs("lj_energy_forces_triton", positions, owned_mask)
    check_scalars("lj_energy_forces_triton", epsilon=epsilon, sigma=sigma, cutoff=cutoff)
    _check_triton_device("lj_energy_forces_triton", positions)
    pos = positions.contiguous()
    rows = pos.shape[0]
    mask = owned_mask.to(pos.dtype).contiguous()
    par = torch.tensor([epsilon, sigma, cutoff], dtype=pos.dtype, device=pos.device)
    e_rows = torch.zeros(rows, dtype=pos.dtype, device=pos.device)
    forces = torch.zeros_like(pos)
    grid = (triton.cdiv(max(rows, 1), _BLOCK),)
    wrap_triton(_tk.lj_kernel)[grid](pos, mask, par, e_rows, forces, rows, BLOCK_I=_BLOCK, BLOCK_J=_BLOCK)
    return e_rows.sum(), forces


@triton_op(f"{NAMESPACE}::dsf_energy_forces_triton", mutates_args=())
def dsf_energy_forces_triton(
    positions: Tensor,
    charges: Tensor,
    owned_mask: Tensor,
    alpha: float = _DSF.alpha,
    cutoff: float = _DSF.cutoff,
    born_a: float = _DSF.born_a,
    born_rho: float = _DSF.born_rho,
    coulomb_constant: float = COULOMB_EV_A,
) -> tuple[Tensor, Tensor]:
    """DSF Coulomb + Born-Mayer on a block, Triton kernel: (energy partial, forces (R, 3))."""
    _check_inputs("dsf_energy_forces_triton", positions, owned_mask, charges)
    check_scalars(
        "dsf_energy_forces_triton", alpha=alpha, cutoff=cutoff, born_a=born_a, born_rho=born_rho,
        coulomb_constant=coulomb_constant,
    )
    _check_triton_device("dsf_energy_forces_triton", positions)
    pos = positions.contiguous()
    rows = pos.shape[0]
    mask = owned_mask.to(pos.dtype).contiguous()
    c = _dsf_constants(alpha, cutoff, born_rho, coulomb_constant)
    par = torch.tensor(
        [alpha, cutoff, born_a, born_rho, coulomb_constant, c["erfc_rc"], c["shift_f"],
         c["exp_rc"], c["two_a_pi"], c["self_coef"]],
        dtype=pos.dtype, device=pos.device,
    )
    e_rows = torch.zeros(rows, dtype=pos.dtype, device=pos.device)
    forces = torch.zeros_like(pos)
    grid = (triton.cdiv(max(rows, 1), _BLOCK),)
    wrap_triton(_tk.dsf_kernel)[grid](
        pos, charges.contiguous(), mask, par, e_rows, forces, rows, BLOCK_I=_BLOCK, BLOCK_J=_BLOCK
    )
    return e_rows.sum(), forces


# Fake (meta) implementations: explicit for all four (under the Triton interpreter the
# default fake of a triton_op would try to run the kernel on fake tensors).
for _op in (lj_energy_forces, dsf_energy_forces, lj_energy_forces_triton, dsf_energy_forces_triton):
    _op.register_fake(_fake)
for _op in (lj_energy_forces, lj_energy_forces_triton):
    _op.register_autograd(_backward_lj, setup_context=_setup_lj)
for _op in (dsf_energy_forces, dsf_energy_forces_triton):
    _op.register_autograd(_backward_dsf, setup_context=_setup_dsf)
del _op

from . import torch_cells  # noqa: E402, F401  registers jaxbridge_demo::lj_energy_forces_cells
