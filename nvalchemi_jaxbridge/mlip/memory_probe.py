"""What a model's evaluation costs in memory per row and per edge, measured on small synthetic blocks.

The edge-level tensors of a message-passing model (radial bases, spherical harmonics, messages, and
what autograd keeps of them) dominate its memory, so the peak of one forward and backward on a block is
close to `fixed + bytes_per_row * rows + bytes_per_edge * edges`. `probe_cost` runs the model as the
deep halo's `whole` op does (forward, then the gradients of the summed node energies with respect to
positions and shifts) on three random blocks of a few hundred rows, reads the peak of torch's allocator
(the CUDA allocator's peak on a GPU; on the CPU the allocations torch's profiler records), and fits the
three numbers by least squares. A tile's peak is then predicted from its rows and edges alone, which
chooses the tile count for a memory budget (`mlip.memory`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .protocol import MessagePassingWrapper, node_energies_of
from .stages import block_graph

PROBES = ((192, 12), (192, 36), (384, 12))
"""(rows, edges per row) of the probe blocks: two edge densities at one size, and a second size."""


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Peak bytes of one evaluation (forward and backward) of a block: `fixed + per_row * rows + per_edge * edges`."""

    bytes_per_row: float
    bytes_per_edge: float
    fixed: float

    def predict(self, rows: Any, edges: Any) -> Any:
        """Predicted peak bytes of a block (or of arrays of blocks) of `rows` rows and `edges` edges."""
        return self.fixed + self.bytes_per_row * np.asarray(rows) + self.bytes_per_edge * np.asarray(edges)


def synthetic_block(wrapper: MessagePassingWrapper, numbers: np.ndarray, rows: int, edges: int, *,
                    device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random block of `rows` rows (atomic numbers drawn from `numbers`) and `edges` edges, each edge
    `0.3`-`0.95` cutoffs long: `(positions, node_attrs, edges (E, 2) int32, shifts)` as the stage ops take them."""
    rng = np.random.default_rng(seed)
    z = rng.choice(np.asarray(numbers).reshape(-1), rows)
    attrs = torch.as_tensor(np.asarray(wrapper.node_attrs(z)), dtype=wrapper.dtype, device=device)
    pos = rng.uniform(0.0, 10.0 * wrapper.cutoff, (rows, 3))
    pairs = rng.integers(0, rows, (edges, 2))
    pairs[:, 0] = np.where(pairs[:, 0] == pairs[:, 1], (pairs[:, 1] + 1) % rows, pairs[:, 0])
    direction = rng.normal(size=(edges, 3))
    vec = direction / np.linalg.norm(direction, axis=1, keepdims=True) * rng.uniform(0.3, 0.95, (edges, 1))
    shifts = vec * wrapper.cutoff - (pos[pairs[:, 1]] - pos[pairs[:, 0]])  # receiver - sender + shift = vec
    as_t = dict(dtype=wrapper.dtype, device=device)
    return (torch.as_tensor(pos, **as_t), attrs, torch.as_tensor(pairs, dtype=torch.int32, device=device),
            torch.as_tensor(shifts, **as_t))


def evaluation_peak(wrapper: MessagePassingWrapper, block: tuple[torch.Tensor, ...]) -> float:
    """Peak bytes torch allocates for the model's energy and its gradients on `block` (above what was held)."""
    pos, attrs, edges, shifts = block
    device = pos.device

    def run() -> None:
        p, s = pos.detach().requires_grad_(True), shifts.detach().requires_grad_(True)
        node = node_energies_of(wrapper, block_graph(p, attrs, edges, s), "memory probe")
        torch.autograd.grad(node.sum(), (p, s))

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    held = np.cumsum([b for _, b in steps]) if steps else np.zeros(1)
    return float(max(held.max(), 0.0))


def probe_cost(wrapper: MessagePassingWrapper, numbers: np.ndarray, device: str | torch.device = "cpu") -> ModelCost:
    """The model's `ModelCost`, fitted to its peaks on the `PROBES` blocks (each run once before, to warm up)."""
    device = torch.device(device)
    sizes, peaks = [], []
    for k, (rows, per_row) in enumerate(PROBES):
        block = synthetic_block(wrapper, numbers, rows, rows * per_row, device=device, seed=k)
        evaluation_peak(wrapper, block)  # first call: lazy initialisation, TorchScript's profiling runs
        peaks.append(evaluation_peak(wrapper, block))
        sizes.append((1.0, rows, rows * per_row))
    fixed, per_row, per_edge = np.linalg.lstsq(np.asarray(sizes), np.asarray(peaks), rcond=None)[0]
    return ModelCost(max(float(per_row), 0.0), max(float(per_edge), 0.0), max(float(fixed), 0.0))
