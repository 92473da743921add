"""Test ops: a Gaussian pair energy as a plain-torch custom op and as a Triton `triton_op`,
plus a numpy reference that shares no code with either.

Per-row energy of a block of atoms: E_i = 1/2 sum_{j != i} w(|r_i - r_j|^2), with
w(s) = exp(-s / sigma^2) (1 - s / rc^2)^2 for s < rc^2 and 0 beyond (smooth at rc).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

NS = "kt"


# ------------------------------------------------------------------ numpy reference


def gauss_numpy(pos: np.ndarray, cutoff: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-atom energies and forces (-dE/dr) of the whole system, by explicit loops over pairs."""
    n = len(pos)
    e = np.zeros(n)
    f = np.zeros((n, 3))
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            d = pos[i] - pos[j]
            s = float(d @ d)
            if s >= cutoff**2:
                continue
            om = 1.0 - s / cutoff**2
            w = np.exp(-s / sigma**2) * om * om
            dw = np.exp(-s / sigma**2) * (-om * om / sigma**2 - 2.0 * om / cutoff**2)
            e[i] += 0.5 * w
            f[i] -= 2.0 * dw * d  # both halves of the pair energy depend on r_i
    return e, f


# ------------------------------------------------------------------ plain torch op


def _weights(pos: torch.Tensor, cutoff: float, sigma: float):
    d = pos[:, None, :] - pos[None, :, :]
    s = (d * d).sum(-1)
    x = s / cutoff**2
    keep = (x < 1.0) & ~torch.eye(pos.shape[0], dtype=torch.bool, device=pos.device)
    om = torch.where(keep, 1.0 - x, torch.zeros_like(x))
    ex = torch.exp(-s / sigma**2)
    w = ex * om * om
    dw = torch.where(keep, ex * (-om * om / sigma**2 - 2.0 * om / cutoff**2), torch.zeros_like(x))
    return d, w, dw


@torch.library.custom_op(f"{NS}::gauss_pair", mutates_args=())
def gauss_pair(positions: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    """Per-row Gaussian pair energies of a block."""
    _, w, _ = _weights(positions, cutoff, sigma)
    return 0.5 * w.sum(1)


@gauss_pair.register_fake
def _(positions, cutoff, sigma):
    return positions.new_empty(positions.shape[0])


@torch.library.custom_op(f"{NS}::gauss_pair_bwd", mutates_args=())
def gauss_pair_bwd(positions: torch.Tensor, grad_energy: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    """d(sum_i g_i E_i)/d r_k = sum_j (g_k + g_j) w'(s_kj) 2 d_kj / 2."""
    d, _, dw = _weights(positions, cutoff, sigma)
    g = grad_energy[:, None] + grad_energy[None, :]
    return ((g * dw)[..., None] * d).sum(1)


@gauss_pair_bwd.register_fake
def _(positions, grad_energy, cutoff, sigma):
    return torch.empty_like(positions)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.cutoff, ctx.sigma = inputs[1], inputs[2]


def _backward(ctx, grad):
    (pos,) = ctx.saved_tensors
    return torch.ops.kt.gauss_pair_bwd(pos, grad, ctx.cutoff, ctx.sigma), None, None


gauss_pair.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------ Triton op

BLOCK = 32


@triton.jit
def _gauss_fwd_kernel(pos_ptr, out_ptr, n, inv_rc2, inv_s2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mi = i < n
    xi = tl.load(pos_ptr + 3 * i, mask=mi, other=0.0)
    yi = tl.load(pos_ptr + 3 * i + 1, mask=mi, other=0.0)
    zi = tl.load(pos_ptr + 3 * i + 2, mask=mi, other=0.0)
    acc = xi * 0.0
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mj = j < n
        dx = xi[:, None] - tl.load(pos_ptr + 3 * j, mask=mj, other=0.0)[None, :]
        dy = yi[:, None] - tl.load(pos_ptr + 3 * j + 1, mask=mj, other=0.0)[None, :]
        dz = zi[:, None] - tl.load(pos_ptr + 3 * j + 2, mask=mj, other=0.0)[None, :]
        s = dx * dx + dy * dy + dz * dz
        om = 1.0 - s * inv_rc2
        ok = mi[:, None] & mj[None, :] & (i[:, None] != j[None, :]) & (om > 0.0)
        w = tl.exp(-s * inv_s2) * om * om
        acc += tl.sum(tl.where(ok, w, 0.0), axis=1)
    tl.store(out_ptr + i, 0.5 * acc, mask=mi)


@triton.jit
def _gauss_bwd_kernel(pos_ptr, g_ptr, out_ptr, n, inv_rc2, inv_s2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mi = i < n
    xi = tl.load(pos_ptr + 3 * i, mask=mi, other=0.0)
    yi = tl.load(pos_ptr + 3 * i + 1, mask=mi, other=0.0)
    zi = tl.load(pos_ptr + 3 * i + 2, mask=mi, other=0.0)
    gi = tl.load(g_ptr + i, mask=mi, other=0.0)
    ax = xi * 0.0
    ay = xi * 0.0
    az = xi * 0.0
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mj = j < n
        dx = xi[:, None] - tl.load(pos_ptr + 3 * j, mask=mj, other=0.0)[None, :]
        dy = yi[:, None] - tl.load(pos_ptr + 3 * j + 1, mask=mj, other=0.0)[None, :]
        dz = zi[:, None] - tl.load(pos_ptr + 3 * j + 2, mask=mj, other=0.0)[None, :]
        gj = tl.load(g_ptr + j, mask=mj, other=0.0)
        s = dx * dx + dy * dy + dz * dz
        om = 1.0 - s * inv_rc2
        ok = mi[:, None] & mj[None, :] & (i[:, None] != j[None, :]) & (om > 0.0)
        dw = tl.exp(-s * inv_s2) * (-om * om * inv_s2 - 2.0 * om * inv_rc2)
        c = tl.where(ok, (gi[:, None] + gj[None, :]) * dw, 0.0)
        ax += tl.sum(c * dx, axis=1)
        ay += tl.sum(c * dy, axis=1)
        az += tl.sum(c * dz, axis=1)
    tl.store(out_ptr + 3 * i, ax, mask=mi)
    tl.store(out_ptr + 3 * i + 1, ay, mask=mi)
    tl.store(out_ptr + 3 * i + 2, az, mask=mi)


@triton_op(f"{NS}::gauss_pair_tri", mutates_args=())
def gauss_pair_tri(positions: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    """Per-row Gaussian pair energies, as a Triton kernel."""
    n = positions.shape[0]
    out = positions.new_empty(n)
    grid = (triton.cdiv(n, BLOCK),)
    wrap_triton(_gauss_fwd_kernel)[grid](positions, out, n, 1.0 / cutoff**2, 1.0 / sigma**2, BLOCK=BLOCK)
    return out


@triton_op(f"{NS}::gauss_pair_tri_bwd", mutates_args=())
def gauss_pair_tri_bwd(positions: torch.Tensor, grad_energy: torch.Tensor, cutoff: float, sigma: float) -> torch.Tensor:
    """Gradient of sum_i g_i E_i with respect to the positions, as a Triton kernel."""
    n = positions.shape[0]
    out = torch.empty_like(positions)
    grid = (triton.cdiv(n, BLOCK),)
    wrap_triton(_gauss_bwd_kernel)[grid](
        positions, grad_energy.contiguous(), out, n, 1.0 / cutoff**2, 1.0 / sigma**2, BLOCK=BLOCK
    )
    return out


def _backward_tri(ctx, grad):
    (pos,) = ctx.saved_tensors
    return torch.ops.kt.gauss_pair_tri_bwd(pos, grad, ctx.cutoff, ctx.sigma), None, None


gauss_pair_tri.register_autograd(_backward_tri, setup_context=_setup)


# ------------------------------------------------------------------ ops for the op-path tests


@torch.library.custom_op(f"{NS}::scale_add", mutates_args=("acc",))
def scale_add(x: torch.Tensor, acc: torch.Tensor, scale: float, *, bias: float = 0.0) -> torch.Tensor:
    """acc += scale * x (in place); returns x.sum() + bias as a 0-d tensor."""
    acc.add_(scale * x)
    return x.sum() + bias


@scale_add.register_fake
def _(x, acc, scale, *, bias=0.0):
    return x.new_empty(())


@torch.library.custom_op(f"{NS}::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    """An op without a fake registration."""
    return 2 * x


@torch.library.custom_op(f"{NS}::no_grad_rule", mutates_args=())
def no_grad_rule(x: torch.Tensor) -> torch.Tensor:
    """An op without an autograd formula."""
    return x * x


@no_grad_rule.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::two_out", mutates_args=())
def two_out(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * k, rowwise sum of x as int32 counts of positive entries)."""
    return x * k, (x > 0).sum(-1).to(torch.int32)


@two_out.register_fake
def _(x, k):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.int32)


def _two_out_setup(ctx, inputs, output):
    ctx.k = inputs[1]


two_out.register_autograd(lambda ctx, g, _g2: (g * ctx.k, None), setup_context=_two_out_setup)

# an autograd-capable composite: defined with torch.library, decomposed by autograd
_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("cube_sum(Tensor x) -> Tensor")
_lib.impl("cube_sum", lambda x: (x * x * x).sum(-1), "CompositeImplicitAutograd")
