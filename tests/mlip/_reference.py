"""Test structures and single-device references for the model level.

The references run the torch model on the whole periodic system with ASE's
neighbour list (shifts from the cell), sharing no code with the bridge: no halo,
no stages, no exchanges. Stress is the strain derivative with the strain applied
to positions and cell together; a central finite difference checks it.
"""

from __future__ import annotations

import numpy as np
import torch


def alloy(reps=(4, 4, 4), a=3.75, *, rattle=0.1, seed=0, species=(29, 79), triclinic=False, slab=False,
          half_empty=False):
    """Rattled fcc Cu/Au (random species); optionally a sheared cell, a slab open in z (vacuum 8 Å), or
    with the atoms of the far half of the box (scaled x >= 0.45) removed, so that some domains are empty."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=a, cubic=True).repeat(reps)
    rng = np.random.default_rng(seed)
    atoms.numbers = rng.choice(np.asarray(species), len(atoms))
    if triclinic:
        cell = atoms.cell.array.copy()
        cell[1] += 0.21 * cell[0]
        cell[2] += 0.13 * cell[0] - 0.17 * cell[1]
        atoms.set_cell(cell, scale_atoms=True)
    atoms.positions += rng.normal(scale=rattle, size=atoms.positions.shape)
    if half_empty:
        atoms = atoms[atoms.get_scaled_positions()[:, 0] < 0.45]
    if slab:
        atoms.pbc = (True, True, False)
        cell = atoms.cell.array.copy()
        cell[2, 2] += 8.0
        atoms.set_cell(cell, scale_atoms=False)
    return atoms


def graph(atoms, cutoff):
    """Edges (2, E) sender -> receiver and unit shifts (E, 3) of ASE's neighbour list."""
    from ase.neighborlist import neighbor_list

    i, j, s = neighbor_list("ijS", atoms, cutoff)
    return np.stack([i, j]), s.astype(np.float64)


def reference(node_energy_fn, atoms, cutoff, node_attrs, dtype=torch.float64):
    """Energy, forces, stress (ASE sign) and atomic energies on one device, by torch autograd.

    `node_energy_fn(positions, node_attrs, edge_index, shifts) -> (N,)`.
    """
    ei, unit = graph(atoms, cutoff)
    pos = torch.tensor(atoms.positions, dtype=dtype, requires_grad=True)
    eps = torch.zeros((3, 3), dtype=dtype, requires_grad=True)
    sym = (eps + eps.T) / 2
    cell = torch.tensor(atoms.cell.array, dtype=dtype)
    strained = pos + pos @ sym
    shifts = torch.tensor(unit, dtype=dtype) @ (cell + cell @ sym)
    attrs = torch.tensor(node_attrs, dtype=dtype)
    node_e = node_energy_fn(strained, attrs, torch.tensor(ei, dtype=torch.int64), shifts)
    energy = node_e.sum()
    g_pos, g_eps = torch.autograd.grad(energy, (pos, eps))
    volume = abs(np.linalg.det(atoms.cell.array))
    return {
        "energy": float(energy.detach()), "forces": -g_pos.numpy(), "stress": g_eps.numpy() / volume,
        "atomic_energies": node_e.detach().numpy(),
    }


def finite_difference_stress(energy_of_atoms, atoms, h=1e-4):
    """Central difference of E under symmetric strain, divided by the volume (ASE's sign)."""
    out = np.zeros((3, 3))
    base_cell = atoms.cell.array.copy()
    volume = abs(np.linalg.det(base_cell))
    for a in range(3):
        for b in range(3):
            vals = []
            for sign in (1, -1):
                eps = np.zeros((3, 3))
                eps[a, b] += sign * h / 2
                eps[b, a] += sign * h / 2
                strained = atoms.copy()
                strained.set_cell(base_cell @ (np.eye(3) + eps), scale_atoms=True)
                vals.append(energy_of_atoms(strained))
            out[a, b] = (vals[0] - vals[1]) / (2 * h) / volume
    return out


def mace_reference(model, atoms):
    """MACE's own forward on the whole system (its own neighbour list): energy, forces, stress, node energies."""
    from nvalchemi_jaxbridge.mlip.mace import mace_input  # MACE's data pipeline only; no bridge code

    batch = mace_input(model, atoms)
    out = model(batch, training=False, compute_force=True, compute_stress=True)
    # MACE divides by the volume of its own cell, whose open axes it replaces by a long vector;
    # rescale to the structure's cell (ASE's convention), which the bridge uses.
    mace_volume = abs(float(torch.linalg.det(batch["cell"].view(3, 3))))
    volume = abs(float(np.linalg.det(atoms.cell.array)))
    return {
        "energy": float(out["energy"][0].detach()), "forces": out["forces"].detach().numpy(),
        "stress": out["stress"][0].detach().numpy() * mace_volume / volume,
        "atomic_energies": out["node_energy"].detach().numpy(),
    }


def reference_nve(node_energy_fn, atoms, cutoff, node_attrs, velocities, masses, *, steps, dt):
    """Velocity Verlet on one device with a fresh ASE neighbour list every step; positions per step."""
    from nvalchemi_jaxbridge.demo.units import MVV2E

    atoms = atoms.copy()
    m = np.asarray(masses)[:, None] * MVV2E
    forces = reference(node_energy_fn, atoms, cutoff, node_attrs)["forces"]
    v = np.asarray(velocities, dtype=np.float64).copy()
    out = [atoms.positions.copy()]
    for _ in range(steps):
        v += 0.5 * dt * forces / m
        atoms.positions = atoms.positions + dt * v
        forces = reference(node_energy_fn, atoms, cutoff, node_attrs)["forces"]
        v += 0.5 * dt * forces / m
        out.append(atoms.positions.copy())
    return np.stack(out)
