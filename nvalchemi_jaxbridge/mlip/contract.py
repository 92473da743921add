"""The wrapper protocol, checked: a wrapper that breaks it is refused, naming the method and what it returned.

A stage output of the wrong shape does not fail on its own: a layer energy of shape
`(rows, 1)` broadcasts against the `(rows,)` running sum into a `(rows, rows)` matrix (an
energy 260 times too large, with no error), a scalar one is added to every row of the block
(a result that depends on the device count). So every result is checked against the protocol
(`protocol.py`) where it is produced:

| method | must return |
|---|---|
| `embed(g)` | node features: one tensor or a tuple of tensors, each `(rows, ...)` of the wrapper's dtype |
| `interaction(i, g, h)` | a pair `(features as embed's, (rows,) energy term of the wrapper's dtype)` |
| `node_energies(g, e)` | `(rows,)` of the wrapper's dtype |
| `edge_features(g)` | None, or one or more `(E, ...)` tensors |

The checks compare shapes and dtypes (no values), a few microseconds per stage. Before any
of that, `check_attributes` refuses what the wrapper declares wrongly: `n_layers < 1`, a
cutoff that is not a finite positive number, a dtype other than float32/float64 (half
precision gives non-finite stresses), parameters of another dtype than the wrapper's, and,
where the wrapper names its model's own cutoff and depth (`MessagePassingWrapper.model_reach`),
a cutoff below the model's (edges the model uses would be left out) or another layer count.
`atomic_numbers` refuses non-integral atomic numbers (29.7 is not Cu).
"""

from __future__ import annotations

import numbers as _numbers
from typing import Any

import numpy as np
import torch

from ..kernels.op_binding import KernelError

SUPPORTED_DTYPES = (torch.float32, torch.float64)


class WrapperContractError(KernelError, TypeError):
    """A wrapper breaks the protocol: the message names the wrapper, the method, what it returned and the fix.

    A `ValueError` (as every `KernelError`, so it passes through the stage ops' shape probe unchanged) and a
    `TypeError` (a result of the wrong kind).
    """


def label(wrapper: Any) -> str:
    """`ClassName('name')`, how errors name a wrapper."""
    return f"{type(wrapper).__name__}({getattr(wrapper, 'name', '?')!r})"


def check_attributes(wrapper: Any, where: str) -> None:
    """Refuse a wrapper whose `n_layers`, `cutoff` or `dtype` break the protocol (see the module docstring)."""
    who = f"{where}: {label(wrapper)}"
    n = getattr(wrapper, "n_layers", None)
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise WrapperContractError(
            f"{who}.n_layers is {n!r}; the protocol needs an int >= 1 (the model's interaction layers: "
            "embed, then interaction(i, ...) for i in range(n_layers)). Set n_layers to the model's layer count."
        )
    cutoff = getattr(wrapper, "cutoff", None)
    if (isinstance(cutoff, (bool, np.bool_)) or not isinstance(cutoff, _numbers.Real)
            or not np.isfinite(float(cutoff)) or not float(cutoff) > 0):
        raise WrapperContractError(
            f"{who}.cutoff is {cutoff!r}; the protocol needs a finite number > 0 (Å, one layer's reach). Set it to "
            "the model's cutoff."
        )
    dtype = getattr(wrapper, "dtype", None)
    if dtype not in SUPPORTED_DTYPES:
        half = dtype in (torch.float16, torch.bfloat16)
        why = ("half precision resolves energies to ~1e-3 relative and overflows the strain derivative (non-finite "
               "stress); " if half else "")
        raise WrapperContractError(
            f"{who}.dtype is {dtype!r}; supported are torch.float32 and torch.float64. {why}Convert the model "
            "(model.to(torch.float32) or model.to(torch.float64)) and set the wrapper's dtype to match."
        )
    if wrong := sorted({str(p.dtype) for p in _parameters(wrapper) if p.is_floating_point() and p.dtype != dtype}):
        raise WrapperContractError(
            f"{who}: the model's floating-point parameters are {', '.join(wrong)} but the wrapper's dtype is "
            f"{dtype}; the stages get inputs of the wrapper's dtype. Convert the model (model.to({dtype})) or set "
            "the wrapper's dtype to the model's."
        )
    own = wrapper.model_reach() if hasattr(wrapper, "model_reach") else None
    if own is None:
        return
    own_cutoff, own_layers = float(own[0]), int(own[1])
    if float(cutoff) < own_cutoff:
        raise WrapperContractError(
            f"{who}.cutoff is {float(cutoff):g} Å but its model's own cutoff is {own_cutoff:g} Å: the edges "
            f"between {float(cutoff):g} and {own_cutoff:g} Å, which the model uses, would be left out (wrong "
            f"forces, no error). Set the wrapper's cutoff to {own_cutoff:g} (or build the model with the smaller "
            "cutoff)."
        )
    if int(n) != own_layers:
        raise WrapperContractError(
            f"{who}.n_layers is {int(n)} but its model has {own_layers} interaction layers; the halo depth and the "
            f"exchanges follow n_layers. Set n_layers = {own_layers}."
        )


def _parameters(wrapper: Any) -> list[torch.Tensor]:
    """The parameters of the wrapper's torch modules (the wrapper itself, or its attributes that are modules)."""
    mods = [wrapper] if isinstance(wrapper, torch.nn.Module) else [
        v for v in vars(wrapper).values() if isinstance(v, torch.nn.Module)]
    return [p for m in mods for p in m.parameters()]


def atomic_numbers(numbers: Any, where: str) -> np.ndarray:
    """`numbers` as an `(N,)` int64 array, refusing values that are not integers (naming the atom ids).

    Raises:
        WrapperContractError: a non-numeric dtype, or non-finite or non-integral values.
    """
    z = np.asarray(numbers).reshape(-1)
    if z.dtype.kind in "iu":
        return z.astype(np.int64)
    if z.dtype.kind != "f":
        raise WrapperContractError(
            f"{where}: atomic numbers must be integers, got dtype {z.dtype}; pass an integer array "
            "(e.g. atoms.numbers)."
        )
    bad = np.flatnonzero(~np.isfinite(z) | (z != np.round(z)))
    if len(bad):
        shown = ", ".join(f"atom {int(i)}: {z[i]!r}" for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise WrapperContractError(
            f"{where}: atomic numbers must be whole numbers, but {len(bad)} are not ({shown}); a species is "
            "never rounded. Pass the integer atomic numbers (e.g. atoms.numbers)."
        )
    return z.astype(np.int64)


# ---------------------------------------------------------------- stage results


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} ({', '.join(_describe(v) for v in x[:4])})"
    return f"{type(x).__name__} {x!r:.40}"


def features(wrapper: Any, method: str, h: Any, rows: int, stage: str, count: int | None = None
             ) -> tuple[torch.Tensor, ...]:
    """Node features `h` (a tensor or a tuple) as a tuple, checked: `count` tensors, each `(rows, ...)` of the dtype."""
    parts = tuple(h) if isinstance(h, (tuple, list)) else (h,)
    want = f"a tensor or a tuple of tensors, each ({rows}, ...) (one row per block row) of " \
           f"{wrapper.dtype}"
    if count is not None and len(parts) != count:
        want += f", {count} of them as embed returns"
    ok = (count is None or len(parts) == count) and len(parts) > 0 and all(
        isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == rows and t.dtype == wrapper.dtype
        for t in parts)
    if not ok:
        fix = ""
        if any(isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] < rows for t in parts):
            fix = " A wrapper that computes on g.receiver_slice(...) must hand back g.to_rows(...)."
        raise WrapperContractError(
            f"{label(wrapper)}.{method} (stage {stage}) returned {_describe(h)}; the protocol expects node "
            f"features: {want}.{fix}"
        )
    return parts


def energy(wrapper: Any, method: str, e: Any, rows: int, stage: str) -> torch.Tensor:
    """A per-row energy `e`, checked: shape exactly `(rows,)` and the wrapper's dtype."""
    if isinstance(e, torch.Tensor) and tuple(e.shape) == (rows,) and e.dtype == wrapper.dtype:
        return e
    fix = ""
    if isinstance(e, torch.Tensor):
        if e.ndim == 0:
            fix = (" A scalar would be added to every row of every device's block (a result that depends on the "
                   "device count): return the per-row terms, not their sum.")
        elif tuple(e.shape) == (rows,):
            fix = f" Return it in {wrapper.dtype} (e.to({wrapper.dtype}))."
        elif e.numel() == rows:
            fix = f" Return e.reshape({rows}) (e.g. e[:, 0] for a (rows, 1) readout): a (rows, 1) energy would " \
                  "broadcast against the (rows,) sum into a (rows, rows) matrix."
        elif e.shape[0] < rows:
            fix = " A wrapper that computes on g.receiver_slice(...) must hand back g.to_rows(...)."
    raise WrapperContractError(
        f"{label(wrapper)}.{method} (stage {stage}) returned a node energy that is {_describe(e)}; the protocol "
        f"expects shape ({rows},), one energy term per block row, of {wrapper.dtype}.{fix}"
    )


def interaction(wrapper: Any, i: int, g: Any, h: Any, stage: str, count: int) -> tuple[Any, torch.Tensor]:
    """`wrapper.interaction(i, g, h)`, its features and energy term checked."""
    return interaction_result(wrapper, i, g, wrapper.interaction(i, g, h), stage, count)


def interaction_result(wrapper: Any, i: int, g: Any, out: Any, stage: str, count: int) -> tuple[Any, torch.Tensor]:
    """`out`, what `wrapper.interaction(i, g, h)` returned, checked: a pair (features, `(rows,)` energy term)."""
    method = f"interaction({i}, g, h)"
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise WrapperContractError(
            f"{label(wrapper)}.{method} (stage {stage}) returned {_describe(out)}; the protocol expects a pair "
            "(new node features, (rows,) energy term of the layer)."
        )
    h_new, e = out
    features(wrapper, method, h_new, g.n_rows, stage, count)
    return h_new, energy(wrapper, method, e, g.n_rows, stage)


def embed(wrapper: Any, g: Any, stage: str) -> Any:
    """`wrapper.embed(g)`, checked."""
    h = wrapper.embed(g)
    features(wrapper, "embed(g)", h, g.n_rows, stage)
    return h


def node_energies(wrapper: Any, g: Any, total: torch.Tensor, stage: str) -> torch.Tensor:
    """`wrapper.node_energies(g, total)`, checked."""
    return energy(wrapper, "node_energies(g, layer_energy)", wrapper.node_energies(g, total), g.n_rows, stage)


def edge_features(wrapper: Any, g: Any, feats: Any, stage: str) -> Any:
    """`feats` (what `wrapper.edge_features(g)` returned), checked: None or `(E, ...)` tensors."""
    if feats is None:
        return None
    parts = tuple(feats) if isinstance(feats, (tuple, list)) else (feats,)
    n_edges = int(g.edge_index.shape[1])
    if not parts or not all(isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == n_edges for t in parts):
        raise WrapperContractError(
            f"{label(wrapper)}.edge_features(g) (stage {stage}) returned {_describe(feats)}; the protocol expects "
            f"None or one or more per-edge tensors ({n_edges}, ...) (a tensor or a tuple). Return only tensors "
            "with one row per edge (move node-wise work into the layers)."
        )
    return feats


class ShapeRecord:
    """The output shapes of one stage op per input shapes: a later call that returns others is refused.

    JAX sizes a stage's outputs from one run when it traces the program; a stage whose output shapes
    depend on the values (an edge mask, a `nonzero`) would return other shapes later.
    """

    def __init__(self, wrapper: Any, stage: str) -> None:
        self.wrapper, self.stage, self.seen = wrapper, stage, {}

    def check(self, inputs: tuple[torch.Tensor, ...], outputs: Any) -> None:
        key = tuple(tuple(t.shape) for t in inputs)
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        got = tuple((tuple(t.shape), t.dtype) for t in outs)
        first = self.seen.setdefault(key, got)
        if first != got:
            raise WrapperContractError(
                f"{label(self.wrapper)} (stage {self.stage}) returned shapes {[s for s, _ in got]} on inputs of "
                f"shapes {list(key)}, but {[s for s, _ in first]} when the program was traced on the same input "
                "shapes; a stage's output shapes must depend on its input shapes only (static shapes). Keep every "
                "row and edge of the block (mask values instead of dropping rows or edges)."
            )
