"""Shared fixtures data and hypothesis strategies for the spec tests."""

from __future__ import annotations

import json
import pathlib

from hypothesis import strategies as st

import nvalchemi_jaxbridge as nb

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "nvalchemi_0_2_0"
OURS = FIXTURES / "ours"


def golden(name: str):
    """A golden fixture written by the nvalchemi-toolkit 0.2.0 wheel."""
    return json.loads((GOLDEN / name).read_text())


def canon(d) -> str:
    """The byte form compared for round trips."""
    return json.dumps(d, sort_keys=True)


ARG_TRANSFORMS = st.sampled_from([nb.GatherInputs(), nb.GatherInputsFull(), nb.SliceOwned()])
OUTPUT_TRANSFORMS = st.sampled_from(
    [nb.ScatterOutputs(), nb.AllReduceSum(), nb.AllReduceSum(True), nb.SliceOutputsOwned()]
)
_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
OP_NAMES = st.builds(
    lambda ns, name, ov: f"{ns}::{name}" + (f".{ov}" if ov else ""),
    _IDENT, _IDENT, st.one_of(st.none(), _IDENT.filter(lambda s: s != "default")),
)
OP_ADAPTERS = st.builds(
    nb.OpAdapter,
    OP_NAMES,
    st.dictionaries(st.integers(0, 12), ARG_TRANSFORMS, max_size=4),
    st.dictionaries(st.integers(0, 12), OUTPUT_TRANSFORMS, max_size=4),
)
POLICIES = st.sampled_from(
    [None, nb.HaloStoragePolicy(), nb.HaloStoragePolicy("local", "local"), nb.RefreshOnlyHaloPolicy(),
     nb.RefreshOnlyHaloPolicy("local", "halo_read"), nb.PlainShard(), nb.GraphParallelPolicy()]
)
_DOTTED = st.lists(_IDENT, min_size=1, max_size=3).map(".".join)
_REPLACEMENT = st.one_of(st.none(), st.builds(lambda m, q: f"{m}:{q}", _DOTTED, _DOTTED))
HELPERS = st.one_of(
    st.builds(nb.PythonAdapter, _DOTTED, _IDENT, _REPLACEMENT),
    st.builds(nb.JitAdapter, _DOTTED, _IDENT, _REPLACEMENT, st.sampled_from(["eager", "marshal"])),
    st.builds(
        lambda m, c, f, r, mode: nb.MethodAdapter(m, c, f, r, mode=mode),
        _DOTTED, _IDENT, _IDENT, _REPLACEMENT, st.sampled_from(["wrap", "marshal"]),
    ),
    st.builds(
        lambda t, label: nb.ModuleForwardAdapter(None, label=label, declared_target=t),
        _DOTTED, _IDENT,
    ),
)
SPECS = st.builds(
    nb.DistributionSpec,
    POLICIES,
    st.lists(OP_ADAPTERS, max_size=3).map(tuple),
    st.lists(HELPERS, max_size=3).map(tuple),
    shard_fields=st.lists(_IDENT, max_size=3, unique=True).map(tuple),
)
