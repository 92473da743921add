"""A wrapper that records the device of every stage input and output (for the tests and the GPU script).

`recording(wrapper)` is a copy of `wrapper` whose class derives from the wrapper's own, so the driver sees the
same wrapper (its modules, species, spec) and each stage runs the original after noting the devices of what it
got (`g.positions`, `g.node_attrs`, `g.edge_index`, `g.shifts`, `g.edge_features`, the node features) and what it
returned. `stage_devices(w)` is the record: `"stage:input" -> sorted device names`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nvalchemi_jaxbridge.mlip.protocol import BlockGraph, as_tuple

_CLASSES: dict[type, type] = {}


class _Recorder:
    """Mixin placed before a wrapper's class: note the devices, then run the wrapper's own stage."""

    seen: dict[str, set[str]]

    def _note(self, stage: str, **tensors: Any) -> None:
        for name, value in tensors.items():
            if value is None:
                continue
            for t in as_tuple(value):
                if isinstance(t, torch.Tensor):
                    self.seen.setdefault(f"{stage}:{name}", set()).add(str(t.device))

    def _note_graph(self, stage: str, g: BlockGraph) -> None:
        self._note(stage, positions=g.positions, node_attrs=g.node_attrs, edge_index=g.edge_index,
                   shifts=g.shifts, edge_features=g.edge_features)

    def edge_features(self, g: BlockGraph) -> Any:
        self._note_graph("edge_features", g)
        out = super().edge_features(g)  # type: ignore[misc]
        self._note("edge_features", out=out)
        return out

    def embed(self, g: BlockGraph) -> Any:
        self._note_graph("embed", g)
        h = super().embed(g)  # type: ignore[misc]
        self._note("embed", out=h)
        return h

    def interaction(self, i: int, g: BlockGraph, h: Any) -> Any:
        self._note_graph("interaction", g)
        self._note("interaction", features=h)
        h, e = super().interaction(i, g, h)  # type: ignore[misc]
        self._note("interaction", out=h, energy=e)
        return h, e

    def node_energies(self, g: BlockGraph, layer_energy: torch.Tensor) -> torch.Tensor:
        self._note_graph("node_energies", g)
        self._note("node_energies", layer_energy=layer_energy)
        out = super().node_energies(g, layer_energy)  # type: ignore[misc]
        self._note("node_energies", out=out)
        return out


def recording(wrapper: Any) -> Any:
    """A copy of `wrapper` (its torch model shared, not copied) that records its stages' devices."""
    base = type(wrapper)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Recording{base.__name__}", (_Recorder, base), {})
    w = cls.__new__(cls)  # no __init__: the wrapper's state as it is (a shallow copy)
    w.__dict__.update(copy.copy(vars(wrapper)))
    w.seen = {}
    return w


def stage_devices(wrapper: Any) -> dict[str, list[str]]:
    """What a `recording` wrapper saw: `"stage:input" -> sorted device names` (JSON-ready)."""
    return {k: sorted(v) for k, v in sorted(wrapper.seen.items())}
