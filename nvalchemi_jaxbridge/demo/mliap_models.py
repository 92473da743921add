"""Two small LAMMPS ML-IAP "unified" models written here, used by the tests and the guide.

- `MLIAPLennardJones`: a pair potential through `update_pair_energy` and `update_pair_forces`
  (numpy, as on LAMMPS' plain build), shifted to zero at the cutoff as ASE's `LennardJones`.
- `MLIAPMessagePassing`: a small message-passing model in torch that calls `forward_exchange`
  between its layers and `reverse_exchange` in the backward (an autograd Function), and writes
  `eatoms`, `energy` and its pair forces `dE/drij` (`update_pair_forces_gpu`).
  `MLIAPMessagePassing.reference(...)` is the same model on a whole periodic structure, with no
  ML-IAP data or exchange at all (the single-device numbers to compare with).

Both follow the interface only (`element_types`, `rcutfac`, `compute_forces(data)`), and
pickle with `torch.save`, as LAMMPS loads model files.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class MLIAPLennardJones:
    """Lennard-Jones between every pair of atoms closer than `cutoff`, energy shifted to 0 there."""

    def __init__(self, element_types: tuple[str, ...] = ("Cu", "Au"), *, epsilon: float = 0.4, sigma: float = 2.3,
                 cutoff: float = 5.0) -> None:
        self.element_types = list(element_types)
        self.rcutfac = 0.5 * cutoff
        self.ndescriptors, self.nparams = 1, 1
        self.epsilon, self.sigma, self.cutoff = float(epsilon), float(sigma), float(cutoff)

    def _phi(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s6 = (self.sigma / r) ** 6
        s6c = (self.sigma / self.cutoff) ** 6
        phi = 4 * self.epsilon * (s6 * s6 - s6) - 4 * self.epsilon * (s6c * s6c - s6c)
        dphi = 4 * self.epsilon * (-12 * s6 * s6 + 6 * s6) / r
        return phi, dphi

    def compute_forces(self, data: Any) -> None:
        rij = np.asarray(data.rij)
        if data.npairs == 0:
            return
        r = np.sqrt(np.einsum("pk,pk->p", rij, rij))
        phi, dphi = self._phi(r)
        data.update_pair_energy(phi)  # each direction carries half (the list is full)
        data.update_pair_forces(0.5 * dphi[:, None] * rij / r[:, None])  # d(phi / 2) / drij

    def compute_descriptors(self, data: Any) -> None:
        pass

    def compute_gradients(self, data: Any) -> None:
        pass


class _Exchange(torch.autograd.Function):
    """Ghost rows from their owners (`forward_exchange`); the backward sums ghosts into owners."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, data: Any) -> torch.Tensor:
        ctx.data = data
        out = torch.empty_like(h)
        data.forward_exchange(h, out, h.shape[1])
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(g)
        ctx.data.reverse_exchange(g.contiguous(), out, g.shape[1])
        return out, None


class MLIAPMessagePassing:
    """A seeded message-passing model: `layers` layers of radial messages, a per-atom readout.

    h0 = embedding[type]; per layer, on the local atoms, `h_i <- tanh(h_i + sum_j w(r_ij) (h_j W))`
    with `w` a smooth radial basis (zero at the cutoff); energy `e_i = h_i . readout + shift[type]`.
    """

    def __init__(self, element_types: tuple[str, ...] = ("Cu", "Au"), *, cutoff: float = 4.0, width: int = 6,
                 layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        self.element_types = list(element_types)
        self.rcutfac = 0.5 * cutoff
        self.ndescriptors, self.nparams = 1, 1
        self.cutoff, self.layers, self.dtype = float(cutoff), int(layers), dtype
        g = torch.Generator().manual_seed(seed)
        n = len(element_types)
        self.embedding = torch.randn((n, width), generator=g, dtype=dtype)
        self.weights = [torch.randn((width, width), generator=g, dtype=dtype) / width for _ in range(layers)]
        self.radial = [torch.randn(4, generator=g, dtype=dtype) for _ in range(layers)]
        self.readout = torch.randn(width, generator=g, dtype=dtype)
        self.shift = torch.randn(n, generator=g, dtype=dtype)

    def _w(self, k: int, r: torch.Tensor) -> torch.Tensor:
        x = r / self.cutoff
        envelope = (1 - x * x) ** 2
        basis = torch.stack([torch.cos(torch.pi * (m + 1) * x / 2) for m in range(4)], dim=1)
        return envelope * (basis @ self.radial[k])

    def _energies(self, types: torch.Tensor, vec: torch.Tensor, recv: torch.Tensor, send: torch.Tensor,
                  n_real: int, exchange: Any) -> torch.Tensor:
        """Per-atom energies of the first `n_real` rows; `vec[p]` points from `recv[p]` to `send[p]`."""
        r = torch.linalg.vector_norm(vec, dim=1)
        h = self.embedding[types]
        for k in range(self.layers):
            if k > 0:
                h = exchange(torch.cat([h, h.new_zeros((types.shape[0] - n_real, h.shape[1]))]))
            msg = self._w(k, r)[:, None] * (h[send] @ self.weights[k])
            h = torch.tanh(h[:n_real] + torch.zeros_like(h[:n_real]).index_add(0, recv, msg))
        return h @ self.readout + self.shift[types[:n_real]]

    def compute_forces(self, data: Any) -> None:
        if data.nlocal == 0 or data.npairs <= 1:
            return  # as many shipped models do: no writes and no exchanges
        dev = torch.as_tensor(data.rij).device
        self._to(dev)  # as shipped models do: the weights follow the data (a GPU block's arrays are on the GPU)
        rij = torch.as_tensor(data.rij).to(self.dtype).clone().requires_grad_(True)
        types = torch.as_tensor(data.elems, device=dev).to(torch.int64)
        i = torch.as_tensor(data.pair_i, device=dev).to(torch.int64)
        j = torch.as_tensor(data.pair_j, device=dev).to(torch.int64)
        e = self._energies(types, rij, i, j, data.nlocal, lambda x: _Exchange.apply(x, data))
        total = e.sum()
        (fij,) = torch.autograd.grad(total, rij)
        torch.as_tensor(data.eatoms).copy_(e.detach())
        data.energy = float(total.detach())
        data.update_pair_forces_gpu(fij.double())

    def _to(self, device: torch.device) -> None:
        """Move the weights to `device` (no-op where they are)."""
        if self.embedding.device != device:
            self.embedding, self.readout = self.embedding.to(device), self.readout.to(device)
            self.shift = self.shift.to(device)
            self.weights = [w.to(device) for w in self.weights]
            self.radial = [r.to(device) for r in self.radial]

    def reference(self, positions: Any, numbers: Any, cell: Any, pbc: Any = True) -> dict[str, np.ndarray]:
        """Energy, forces, stress (ASE's sign) and per-atom energies of the whole structure, one device.

        Every pair within the cutoff over periodic images, no ML-IAP data and no exchange.
        """
        from ..app.model_reference import periodic_graph

        self._to(torch.device("cpu"))

        pos = torch.tensor(np.asarray(positions, dtype=np.float64), dtype=self.dtype, requires_grad=True)
        cell_t = torch.tensor(np.asarray(cell, dtype=np.float64), dtype=self.dtype)
        strain = torch.zeros((3, 3), dtype=self.dtype, requires_grad=True)
        edges, unit = periodic_graph(np.asarray(positions, dtype=np.float64), np.asarray(cell, dtype=np.float64),
                                     pbc, self.cutoff)
        index = {s: k for k, s in enumerate(self.element_types)}
        from ..mlip.mliap import SYMBOLS

        types = torch.tensor([index[SYMBOLS[int(z)]] for z in np.asarray(numbers)], dtype=torch.int64)
        sym = (strain + strain.T) / 2
        p = pos + pos @ sym
        c = cell_t + cell_t @ sym
        send, recv = torch.as_tensor(edges[0]), torch.as_tensor(edges[1])
        vec = p[send] - p[recv] - torch.as_tensor(unit, dtype=self.dtype) @ c  # from receiver to sender image
        e = self._energies(types, vec, recv, send, len(types), lambda x: x)
        g_pos, g_strain = torch.autograd.grad(e.sum(), (pos, strain))
        volume = abs(float(np.linalg.det(np.asarray(cell, dtype=np.float64))))
        out = {"energy": float(e.sum().detach()), "forces": -g_pos.numpy(), "atomic_energies": e.detach().numpy()}
        if volume > 0:
            out["stress"] = g_strain.numpy() / volume
        return out

    def compute_descriptors(self, data: Any) -> None:
        pass

    def compute_gradients(self, data: Any) -> None:
        pass
