"""Triton kernels of the demo pair potentials (dense block, one program per BLOCK_I rows).

Each program loops over all rows j in tiles of BLOCK_J and accumulates, for
its rows i, the per-row energy 1/2 sum_j w_ij u_ij and force sum_j w_ij fscal_ij d_ij
(d_ij = r_i - r_j, fscal = -u'(r)/r, w_ij = (owned_i + owned_j)/2). Both orders
(i, j) and (j, i) are visited, so no atomics are needed. Scalar parameters come
in a tensor of the positions' dtype, so float64 runs keep float64 constants
(Triton would pass Python floats as float32).
"""

import triton
import triton.language as tl


@triton.jit
def _pair_tile(pos_ptr, mask_ptr, i, in_i, xi, yi, zi, oi, j0, n_rows, rc2, BLOCK_J: tl.constexpr):
    """Geometry of one (BLOCK_I, BLOCK_J) tile: d components, safe r2, weights (0 outside)."""
    j = j0 + tl.arange(0, BLOCK_J)
    in_j = j < n_rows
    xj = tl.load(pos_ptr + 3 * j, mask=in_j, other=0.0)
    yj = tl.load(pos_ptr + 3 * j + 1, mask=in_j, other=0.0)
    zj = tl.load(pos_ptr + 3 * j + 2, mask=in_j, other=0.0)
    oj = tl.load(mask_ptr + j, mask=in_j, other=0.0)
    dx = xi[:, None] - xj[None, :]
    dy = yi[:, None] - yj[None, :]
    dz = zi[:, None] - zj[None, :]
    r2 = dx * dx + dy * dy + dz * dz
    pair = in_i[:, None] & in_j[None, :] & (i[:, None] != j[None, :]) & (r2 <= rc2)
    w = tl.where(pair, 0.5 * (oi[:, None] + oj[None, :]), 0.0)
    return j, in_j, dx, dy, dz, tl.where(pair, r2, 1.0), w


@triton.jit
def lj_kernel(pos_ptr, mask_ptr, par_ptr, e_ptr, f_ptr, n_rows,
              BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """par = [epsilon, sigma, cutoff]; writes per-row energies e (R,) and forces f (R, 3)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_i = i < n_rows
    xi = tl.load(pos_ptr + 3 * i, mask=in_i, other=0.0)
    yi = tl.load(pos_ptr + 3 * i + 1, mask=in_i, other=0.0)
    zi = tl.load(pos_ptr + 3 * i + 2, mask=in_i, other=0.0)
    oi = tl.load(mask_ptr + i, mask=in_i, other=0.0)
    eps = tl.load(par_ptr)
    sig = tl.load(par_ptr + 1)
    rc = tl.load(par_ptr + 2)
    rc2 = rc * rc
    s2c = sig * sig / rc2
    s6c = s2c * s2c * s2c
    e_cut = s6c * s6c - s6c
    acc_e = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_x = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_y = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_z = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    for j0 in range(0, n_rows, BLOCK_J):
        j, in_j, dx, dy, dz, r2, w = _pair_tile(
            pos_ptr, mask_ptr, i, in_i, xi, yi, zi, oi, j0, n_rows, rc2, BLOCK_J)
        s2 = sig * sig / r2
        s6 = s2 * s2 * s2
        u = 4.0 * eps * (s6 * s6 - s6 - e_cut)
        fs = w * 24.0 * eps * (2.0 * s6 * s6 - s6) / r2
        acc_e += tl.sum(w * u, axis=1)
        acc_x += tl.sum(fs * dx, axis=1)
        acc_y += tl.sum(fs * dy, axis=1)
        acc_z += tl.sum(fs * dz, axis=1)
    tl.store(e_ptr + i, 0.5 * acc_e, mask=in_i)
    tl.store(f_ptr + 3 * i, acc_x, mask=in_i)
    tl.store(f_ptr + 3 * i + 1, acc_y, mask=in_i)
    tl.store(f_ptr + 3 * i + 2, acc_z, mask=in_i)


@triton.jit
def dsf_kernel(pos_ptr, q_ptr, mask_ptr, par_ptr, e_ptr, f_ptr, n_rows,
               BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """par = [alpha, cutoff, born_a, born_rho, k, erfc(a Rc), shift_f, exp(-Rc/rho), 2a/sqrt(pi), self_coef]."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_i = i < n_rows
    xi = tl.load(pos_ptr + 3 * i, mask=in_i, other=0.0)
    yi = tl.load(pos_ptr + 3 * i + 1, mask=in_i, other=0.0)
    zi = tl.load(pos_ptr + 3 * i + 2, mask=in_i, other=0.0)
    oi = tl.load(mask_ptr + i, mask=in_i, other=0.0)
    qi = tl.load(q_ptr + i, mask=in_i, other=0.0)
    alpha = tl.load(par_ptr)
    rc = tl.load(par_ptr + 1)
    born_a = tl.load(par_ptr + 2)
    rho = tl.load(par_ptr + 3)
    k = tl.load(par_ptr + 4)
    erfc_rc = tl.load(par_ptr + 5)
    shift_f = tl.load(par_ptr + 6)
    exp_rc = tl.load(par_ptr + 7)
    two_a_pi = tl.load(par_ptr + 8)
    self_coef = tl.load(par_ptr + 9)
    acc_e = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_x = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_y = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    acc_z = tl.zeros([BLOCK_I], dtype=pos_ptr.dtype.element_ty)
    for j0 in range(0, n_rows, BLOCK_J):
        j, in_j, dx, dy, dz, r2, w = _pair_tile(
            pos_ptr, mask_ptr, i, in_i, xi, yi, zi, oi, j0, n_rows, rc * rc, BLOCK_J)
        qj = tl.load(q_ptr + j, mask=in_j, other=0.0)
        qq = k * qi[:, None] * qj[None, :]
        r = tl.sqrt(r2)
        ar = alpha * r
        erfc_r = 1.0 - tl.erf(ar)
        exp_b = tl.exp(-r / rho)
        u = qq * (erfc_r / r - erfc_rc / rc + shift_f * (r - rc)) + born_a * (exp_b - exp_rc)
        f_r = qq * (erfc_r / r2 + two_a_pi * tl.exp(-ar * ar) / r - shift_f) + born_a / rho * exp_b
        fs = w * f_r / r
        acc_e += tl.sum(w * u, axis=1)
        acc_x += tl.sum(fs * dx, axis=1)
        acc_y += tl.sum(fs * dy, axis=1)
        acc_z += tl.sum(fs * dz, axis=1)
    tl.store(e_ptr + i, 0.5 * acc_e - self_coef * oi * qi * qi, mask=in_i)
    tl.store(f_ptr + 3 * i, acc_x, mask=in_i)
    tl.store(f_ptr + 3 * i + 1, acc_y, mask=in_i)
    tl.store(f_ptr + 3 * i + 2, acc_z, mask=in_i)
