"""Independent numpy references: all pairs over all periodic images within the cutoff.

O(N^2 * images). These share no code with the JAX, torch and Triton
implementations and exist to test them. Global arrays, float64.
"""

import itertools
import math

import numpy as np
from scipy.special import erfc

from .units import COULOMB_EV_A


def image_shifts(cell: np.ndarray, periodic, cutoff: float) -> np.ndarray:
    """Integer image vectors n with every image within `cutoff` of a wrapped atom, shape (S, 3)."""
    cell = np.asarray(cell, dtype=np.float64)
    ranges = []
    for k in range(3):
        if periodic[k]:
            # distance between the lattice planes spanned by the other two vectors
            normal = np.cross(cell[(k + 1) % 3], cell[(k + 2) % 3])
            width = abs(cell[k] @ normal) / np.linalg.norm(normal)
            ranges.append(range(-math.ceil(cutoff / width), math.ceil(cutoff / width) + 1))
        else:
            ranges.append(range(0, 1))
    return np.array(list(itertools.product(*ranges)), dtype=np.int64)


def _wrap(positions, cell, periodic) -> np.ndarray:
    """Positions moved into the cell along periodic directions."""
    pos = np.asarray(positions, dtype=np.float64)
    if not any(periodic):
        return pos
    frac = pos @ np.linalg.inv(cell)
    for k in range(3):
        if periodic[k]:
            frac[:, k] -= np.floor(frac[:, k])
    return frac @ cell


def _pair_sum(positions, cell, periodic, cutoff, radial):
    """Sum a radial pair term over all (i, j, image) with 0 < r <= cutoff.

    `radial(r, i, j)` returns (u, du/dr) arrays for an (N, N) distance matrix.
    Returns (energy, forces); each unordered pair is counted once.
    """
    cell = np.asarray(cell, dtype=np.float64)
    pos = _wrap(positions, cell, periodic)
    n = pos.shape[0]
    energy = 0.0
    forces = np.zeros((n, 3))
    for shift in image_shifts(cell, periodic, cutoff):
        t = shift @ cell
        # vector from atom i to the image of atom j
        d = pos[None, :, :] + t[None, None, :] - pos[:, None, :]
        r = np.sqrt(np.einsum("ijk,ijk->ij", d, d))
        inside = r <= cutoff
        if not shift.any():
            np.fill_diagonal(inside, False)
        if not inside.any():
            continue
        rs = np.where(inside, r, 1.0)
        u, du = radial(rs)
        u = np.where(inside, u, 0.0)
        du = np.where(inside, du, 0.0)
        energy += 0.5 * u.sum()
        # dU/dr_i = -du/dr * d/r for each (i, j); the (j, i) term of the mirrored image adds the same
        forces += np.einsum("ij,ijk->ik", du / rs, d)
    return energy, forces


def lj_reference(positions, cell, periodic, *, epsilon, sigma, cutoff):
    """Lennard-Jones energy (eV) and forces (eV/Å), each pair shifted to zero at the cutoff.

    u(r) = 4 eps ((s/r)^12 - (s/r)^6) - u_raw(cutoff) for r <= cutoff, else 0
    (the ``smooth=False`` convention of ``ase.calculators.lj.LennardJones``).
    """
    e_cut = 4.0 * epsilon * ((sigma / cutoff) ** 12 - (sigma / cutoff) ** 6)

    def radial(r):
        sr6 = (sigma / r) ** 6
        return 4.0 * epsilon * (sr6 * sr6 - sr6) - e_cut, -24.0 * epsilon * (2 * sr6 * sr6 - sr6) / r

    return _pair_sum(positions, cell, periodic, cutoff, radial)


def dsf_reference(
    positions,
    charges,
    cell,
    periodic,
    *,
    alpha,
    cutoff,
    born_a,
    born_rho,
    coulomb_constant=COULOMB_EV_A,
):
    """DSF Coulomb (Fennell & Gezelter 2006) plus shifted Born-Mayer repulsion.

    Per pair (r <= Rc):
        k q_i q_j [erfc(a r)/r - erfc(a Rc)/Rc + (erfc(a Rc)/Rc^2 + 2a/sqrt(pi) exp(-a^2 Rc^2)/Rc)(r - Rc)]
        + A (exp(-r/rho) - exp(-Rc/rho))
    Per atom: -k (erfc(a Rc)/(2 Rc) + a/sqrt(pi)) q_i^2.
    """
    q = np.asarray(charges, dtype=np.float64)
    rc = cutoff
    shift_f = erfc(alpha * rc) / rc**2 + 2 * alpha / math.sqrt(math.pi) * math.exp(-(alpha * rc) ** 2) / rc
    qq = coulomb_constant * q[:, None] * q[None, :]

    def radial(r):
        u_c = erfc(alpha * r) / r - erfc(alpha * rc) / rc + shift_f * (r - rc)
        du_c = (
            -erfc(alpha * r) / r**2
            - 2 * alpha / math.sqrt(math.pi) * np.exp(-((alpha * r) ** 2)) / r
            + shift_f
        )
        u_b = born_a * (np.exp(-r / born_rho) - math.exp(-rc / born_rho))
        du_b = -born_a / born_rho * np.exp(-r / born_rho)
        return qq * u_c + u_b, qq * du_c + du_b

    e, f = _pair_sum(positions, cell, periodic, cutoff, radial)
    self_coef = erfc(alpha * rc) / (2 * rc) + alpha / math.sqrt(math.pi)
    return e - coulomb_constant * self_coef * np.sum(q * q), f
