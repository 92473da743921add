"""Which stage of a model made a non-finite result, and on which atoms (the error path of `check_results`).

Every front door reduces its results once with `isfinite` (`lower.finite.check_results`);
only when one is NaN or inf does it ask `explain` where that came from. For a wrapper
the answer comes from one run of its stages on the whole structure as one block (the
model's own input: every atom, its periodic images as edge shifts), each stage on its
own copies of its inputs, so that both the forward and the backward can be followed
stage by stage:

    edge_features -> embed -> interaction(0) -> ... -> interaction(L-1) -> node_energies

The first stage whose output holds NaN or inf is named with the atoms of those rows
(an edge's receiver for a per-edge output); if the forward is finite, the backward is
followed from `node_energies` back, and the first stage whose gradient with respect to
an input (positions, node features, edge features) is non-finite is named instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..layout.finite import rows_text


@dataclasses.dataclass
class _Stage:
    """One stage's run: its label, its own input leaves (with where each came from) and its outputs."""

    label: str
    inputs: list[tuple[Any, tuple]]  # (leaf tensor, source): ("pos",), ("ef", j), ("h", stage, j), ("total",)
    outputs: tuple[Any, ...]


def _rows(t: Any, edges: np.ndarray | None) -> np.ndarray:
    """Atoms of the non-finite rows of `t`: rows are atoms, or edges (then their receivers) when `edges` is given."""
    import torch

    if t is None or not torch.is_floating_point(t) or t.ndim == 0:
        return np.zeros(0 if t is None or t.ndim or bool(torch.isfinite(t)) else 1, dtype=np.int64)
    bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
    rows = np.flatnonzero(bad.cpu().numpy())
    return np.unique(edges[rows, 1]) if edges is not None and rows.size else rows


def explain_wrapper(wrapper: Any, positions: Any, numbers: Any, cell: Any, periodic: Any) -> str:
    """The first stage of `wrapper` (forward, then backward) that gives NaN or inf on this structure, in words."""
    import torch

    from ..layout import HaloPlan
    from .edges import EdgePlan
    from .protocol import BlockGraph, as_tuple

    pos = np.asarray(positions, dtype=np.float64)
    periodic = tuple(bool(p) for p in np.broadcast_to(np.asarray(periodic, dtype=bool), (3,)))
    plan = HaloPlan.build(pos, np.asarray(cell, dtype=np.float64), periodic=periodic, cutoff=wrapper.cutoff,
                          skin=0.0, n_devices=1, self_images=False)
    ep = EdgePlan.build(plan, pos, cutoff=wrapper.cutoff, receivers="all")
    n = plan.n_atoms  # one block: the owned rows are every atom, in id order
    block = plan.to_halo(pos, positions=True)[:n]
    e = ep.edges[0, : int(ep.n_edges[0])].astype(np.int64)
    shift = ep.shift[0, : len(e)]
    vec = block[e[:, 1]] - block[e[:, 0]] + shift
    keep = np.einsum("ek,ek->e", vec, vec) < wrapper.cutoff**2
    e, shift = e[keep], shift[keep]
    params = [p for m in _modules(wrapper) for p in m.parameters()]
    device = params[0].device if params else torch.device("cpu")
    f = {"dtype": wrapper.dtype, "device": device}
    x0 = torch.tensor(block, **f)
    attrs = torch.tensor(wrapper.node_attrs(np.asarray(numbers).reshape(-1)), **f)
    ei = torch.as_tensor(e.T.copy(), device=device)
    sh = torch.tensor(shift, **f)
    stages: list[_Stage] = []

    def leaf(t: Any) -> Any:
        return t.detach().requires_grad_(torch.is_floating_point(t))

    def run(label: str, fn: Any, ef: tuple | None, extra: list[tuple[Any, tuple]]) -> tuple[Any, ...] | str:
        x = leaf(x0)
        ef_leaves = None if ef is None else tuple(leaf(t) for t in ef)
        g = BlockGraph(x, attrs, ei, sh, None, ef_leaves)
        out = as_tuple(fn(g, *[t for t, _ in extra]))
        inputs = [(x, ("pos",))] + [(t, ("ef", j)) for j, t in enumerate(ef_leaves or ())] + extra
        stages.append(_Stage(label, inputs, out))
        for j, o in enumerate(out):
            if (rows := _rows(o, e if label == "edge_features" else None)).size:
                return (f"The forward of {wrapper.name}'s {label} (output {j}) gave NaN or inf first, on atoms "
                        f"{rows_text(rows)} (the model's stages run on the whole structure as one block).")
        return out

    with torch.enable_grad():
        ef = None
        probe = BlockGraph(x0, attrs, ei, sh, None, None)
        if wrapper.edge_features(probe) is not None:
            ef = run("edge_features", lambda g: wrapper.edge_features(g), None, [])
            if isinstance(ef, str):
                return ef
        h = run("embed", lambda g: wrapper.embed(g), ef, [])
        if isinstance(h, str):
            return h
        producers, terms = [len(stages) - 1], []
        for i in range(wrapper.n_layers):
            ins = [(leaf(t), ("h", producers[-1], j)) for j, t in enumerate(h)]
            out = run(f"interaction({i})", lambda g, *hs, i=i: _flat(wrapper.interaction(i, g, hs if len(hs) > 1
                                                                                      else hs[0])), ef, ins)
            if isinstance(out, str):
                return out
            h, _ = out[:-1], terms.append(len(stages) - 1)
            producers.append(len(stages) - 1)
        total = leaf(sum(stages[k].outputs[-1] for k in terms))
        final = run("node_energies", lambda g, t: wrapper.node_energies(g, t), ef, [(total, ("total",))])
        if isinstance(final, str):
            return final
        return _backward(wrapper.name, stages, terms, e)


def _flat(result: tuple[Any, Any]) -> tuple[Any, ...]:
    """`interaction`'s `(h, e)` as one tuple `(*h, e)`."""
    from .protocol import as_tuple

    h, e = result
    return (*as_tuple(h), e)


def _backward(name: str, stages: list[_Stage], terms: list[int], edges: np.ndarray) -> str:
    """Follow the gradient of the summed node energies back through the stages; name the first that gives NaN."""
    import torch

    grads: dict[tuple[int, int], Any] = {(len(stages) - 1, 0): torch.ones_like(stages[-1].outputs[0])}
    for k in range(len(stages) - 1, -1, -1):
        s = stages[k]
        outs = [(j, o) for j, o in enumerate(s.outputs) if o.requires_grad and (k, j) in grads]
        wrt = [(t, src) for t, src in s.inputs if t.requires_grad]
        if not outs or not wrt:
            continue
        got = torch.autograd.grad([o for _, o in outs], [t for t, _ in wrt], [grads[(k, j)] for j, _ in outs],
                                  allow_unused=True)
        for (t, src), g in zip(wrt, got):
            if g is None:
                continue
            if (rows := _rows(g, edges if src[0] == "ef" else None)).size:
                what = {"pos": "positions", "ef": "edge features", "h": "node features", "total": "layer energies"}
                return (f"The forward of every stage is finite, but the backward of {name}'s {s.label} gave NaN or "
                        f"inf first (its gradient with respect to its {what[src[0]]}), on atoms {rows_text(rows)}: "
                        "the forces come from that gradient (e.g. a norm or a sqrt of zero, differentiated).")
            target = {"ef": lambda: [(0, src[1])], "h": lambda: [(src[1], src[2])],
                      "total": lambda: [(i, len(stages[i].outputs) - 1) for i in terms]}.get(src[0], list)()
            for key in target:
                grads[key] = grads[key] + g if key in grads else g
    return "No stage gives NaN or inf when the model runs on the whole structure as one block."


def _modules(wrapper: Any) -> list[Any]:
    from .torch_model import wrapper_modules

    return wrapper_modules(wrapper)


def explain(potential: Any, positions: Any, numbers: Any, cell: Any, periodic: Any) -> str:
    """Where a model's non-finite result came from: the wrapper's first non-finite stage, or the ML-IAP model."""
    wrapper = getattr(potential, "wrapper", None)
    if getattr(potential, "stages", None) is not None or type(potential).__name__ == "TorchDistributedMLIP":
        try:
            return explain_wrapper(wrapper, positions, numbers, cell, periodic)
        except Exception as err:  # noqa: BLE001 - the diagnosis must not hide the error it explains
            return f"(Running {wrapper.name}'s stages one by one to find the first non-finite one failed: {err!r}.)"
    if hasattr(potential, "model") and hasattr(getattr(potential, "model"), "obj"):
        return (f"It came from the ML-IAP model {potential.model.name}'s compute_forces (the per-atom energies, "
                "pair forces or energy it wrote).")
    return ""
