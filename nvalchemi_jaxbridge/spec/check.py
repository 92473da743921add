"""check_spec_file: every problem of a spec file, each with its JSON path."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .positions import position_from_key
from .distribution import _KEYS as _CORE_KEYS
from .distribution import DistributionSpec
from .errors import SpecError, jpath, json_type, short, unknown
from .files import ENVELOPE_DEFAULTS, read_json, split_envelope
from .json_guard import check_depth
from .mlip import ForceStrategy, MLIPSpec, OutputKind
from .op_ref import parse_op_name
from .policies import HaloStoragePolicy, PlainShard, policy_from_dict
from .third_party import adapter_from_dict
from .transforms import arg_transform_from_dict, output_transform_from_dict

OUTPUT_KINDS = tuple(k.value for k in OutputKind)
FORCE_STRATEGIES = tuple(s.value for s in ForceStrategy)
_HALO_ONLY = {"gather_inputs", "slice_owned", "scatter_outputs", "all_reduce_sum"}
_SHARD_ONLY = {"gather_inputs_full", "slice_outputs_owned"}
_FAILED = object()  # what _Collector.attempt returns when fn raised (None is a valid result)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem in a spec file: where (a JSON path such as `$.core.policy.kind`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class _Collector:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def attempt(self, where: str, fn: Callable[[], Any]) -> Any:
        """Run fn; record a SpecError (or TypeError) as a problem and return _FAILED."""
        try:
            return fn()
        except SpecError as e:
            self.add(e.path or where, e.detail)
        except (TypeError, ValueError) as e:
            self.add(where, str(e))
        return _FAILED


def check_spec_file(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> list[Problem]:
    """Every problem of a spec file, each with its JSON path; [] when the file is valid.

    Unlike `load_spec`, which stops at the first error, this keeps going: one bad
    transform does not hide a bad policy. It also reports what loads but would fail
    or be lost later: transforms for the other storage kind, unknown envelope keys, and
    envelope values that `SpecFile.mlip` / `MLIPSpec.from_dict` refuse (an output both
    owned-only and all-reduced, a name listed twice, an empty compile policy).

    Example:
        >>> bad = {"policy": {"kind": "halo"}, "custom_ops": [
        ...     {"op": "demo::conv", "arg_transforms": {"0": {"type": "gather_input"}}}]}
        >>> print(check_spec_file(bad)[0])
        $.custom_ops[0].arg_transforms["0"].type: unknown transform 'gather_input'; did you mean 'gather_inputs'? expected one of ['gather_inputs', 'gather_inputs_full', 'slice_owned'].
    """
    c = _Collector()
    if isinstance(path_or_dict, str | bytes | os.PathLike):
        d = c.attempt("$", lambda: read_json(path_or_dict))
        if d is _FAILED:
            return c.problems
    else:  # already parsed JSON
        d = path_or_dict
        if c.attempt("$", lambda: check_depth(d)) is _FAILED:
            return c.problems
    split = c.attempt("$", lambda: split_envelope(d))
    if split is _FAILED:
        if isinstance(d, Mapping) and "core" in d:
            _check_core(c, d["core"], "$.core")
        return c.problems
    core, extras = split
    where = "$" if extras is None else "$.core"
    if extras is not None:
        _check_envelope(c, extras)
    _check_core(c, core, where)
    return c.problems


def _check_core(c: _Collector, d: Any, where: str) -> None:
    if not isinstance(d, Mapping):
        c.add(where, f"a DistributionSpec must be an object, got {json_type(d)}.")
        return
    n_before = len(c.problems)
    for key in sorted(set(d) - set(_CORE_KEYS)):
        c.add(jpath(where, key), unknown("key", key, _CORE_KEYS) + ".")
    policy = None
    if "policy" not in d:
        c.add(where, 'missing "policy"; write {"kind": "local"} for local storage.')
    else:
        policy = c.attempt(jpath(where, "policy"), lambda: policy_from_dict(d["policy"], jpath(where, "policy")))
    for key, check in (("custom_ops", _check_op), ("third_party_helpers", _check_helper)):
        items = d.get(key, [])
        if not isinstance(items, list | tuple):
            c.add(jpath(where, key), f"{key} must be a list, got {json_type(items)}.")
            continue
        for i, item in enumerate(items):
            check(c, item, jpath(jpath(where, key), i), policy)
    fields = d.get("shard_fields", [])
    if not isinstance(fields, list | tuple):
        c.add(jpath(where, "shard_fields"), f"shard_fields must be a list of names, got {json_type(fields)}.")
    else:
        for i, f in enumerate(fields):
            if not isinstance(f, str) or not f:
                c.add(jpath(jpath(where, "shard_fields"), i), f"field names must be non-empty strings, got {short(f)}.")
            elif f in fields[:i]:
                c.add(jpath(jpath(where, "shard_fields"), i), f"{f!r} is listed twice; list each field once.")
    if len(c.problems) == n_before:  # anything the piecewise checks cannot see
        c.attempt(where, lambda: DistributionSpec.from_dict(d, where=where))


def _check_op(c: _Collector, d: Any, where: str, policy: Any) -> None:
    if not isinstance(d, Mapping):
        c.add(where, f'an op adapter must be an object with "op", got {json_type(d)}.')
        return
    allowed = ("op", "arg_transforms", "output_transforms")
    for key in sorted(set(d) - set(allowed)):
        hint = " (third-party adapters go in third_party_helpers)" if key == "kind" else ""
        c.add(jpath(where, key), unknown("key", key, allowed) + hint + ".")
    if "op" not in d:
        c.add(where, 'missing "op"; write it as "<namespace>::<name>", e.g. "demo::spread".')
    elif not isinstance(d["op"], str):
        c.add(jpath(where, "op"), f"\"op\" must be a string 'ns::name', got {json_type(d['op'])}.")
    else:
        c.attempt(jpath(where, "op"), lambda: parse_op_name(d["op"]))
    for slot, decode in (("arg_transforms", arg_transform_from_dict), ("output_transforms", output_transform_from_dict)):
        table = d.get(slot, {})
        here = jpath(where, slot)
        if not isinstance(table, Mapping):
            c.add(here, f'{slot} must be an object {{"<position>": {{...}}}}, got {json_type(table)}.')
            continue
        for key, value in table.items():
            kpath = jpath(here, str(key))
            c.attempt(kpath, lambda k=key, p=kpath: position_from_key(k, p))
            t = c.attempt(kpath, lambda v=value, p=kpath: decode(v, p))
            if t is not _FAILED:
                _check_storage_kind(c, t.kind, policy, jpath(kpath, "type"))


def _check_storage_kind(c: _Collector, kind: str, policy: Any, where: str) -> None:
    if isinstance(policy, HaloStoragePolicy) and kind in _SHARD_ONLY:
        c.add(where, f"{kind!r} acts on sharded storage (PlainShard, GraphParallelPolicy) but the policy is "
                     f"{policy.kind!r}; it would be rejected at compile time. Use a halo transform or change the policy.")
    elif isinstance(policy, PlainShard) and kind in _HALO_ONLY:
        c.add(where, f"{kind!r} acts on halo storage (HaloStoragePolicy) but the policy is {policy.kind!r}; "
                     "it would be rejected at compile time. Use gather_inputs_full / slice_outputs_owned or change the policy.")


def _check_helper(c: _Collector, d: Any, where: str, policy: Any) -> None:
    c.attempt(where, lambda: adapter_from_dict(d, where=where, install_site=where))


def _check_names(c: _Collector, v: Any, path: str) -> list[str]:
    """A list of output names: each entry non-empty and listed once. Returns the valid names."""
    if not isinstance(v, list | tuple):
        c.add(path, f"must be a list of output names, got {short(v)}.")
        return []
    names: list[str] = []
    for i, name in enumerate(v):
        if not isinstance(name, str) or not name:
            c.add(jpath(path, i), f"output names must be non-empty strings, got {short(name)}.")
        elif name in names:
            c.add(jpath(path, i), f"{name!r} is listed twice; list each output once.")
        else:
            names.append(name)
    return names


def _check_envelope(c: _Collector, extras: Mapping[str, Any]) -> None:
    n_before = len(c.problems)
    lists: dict[str, list[str]] = {}
    for key, v in extras.items():
        path = jpath("$", key)
        if key not in ENVELOPE_DEFAULTS:
            c.add(path, unknown("envelope key", key, ENVELOPE_DEFAULTS) + "; nvalchemi-toolkit would ignore it.")
        elif key in ("system_reductions", "gp_replicate_geometry") and not isinstance(v, bool):
            c.add(path, f"must be true or false, got {short(v)}.")
        elif key in ("node_energy_key", "node_virial_key") and not (v is None or isinstance(v, str) and v):
            c.add(path, f"must be a non-empty string or null, got {short(v)}.")
        elif key in ("owned_only_outputs", "all_reduce_outputs"):
            lists[key] = _check_names(c, v, path)
        elif key == "output_kinds":
            _check_output_kinds(c, v, path)
        elif key == "compile":
            _check_compile(c, v, path)
    owned = lists.get("owned_only_outputs", [])
    reduced = extras.get("all_reduce_outputs") if "all_reduce_outputs" in lists else None
    for i, name in enumerate(reduced if isinstance(reduced, list | tuple) else []):
        if name in owned:
            c.add(jpath(jpath("$", "all_reduce_outputs"), i),
                  f"{name!r} is also in owned_only_outputs; an output is either already correct on its owner's "
                  "rows (owned_only) or a per-rank partial summed over ranks (all_reduce). Remove it from one.")
    if len(c.problems) == n_before:  # anything the piecewise checks cannot see
        known = {k: v for k, v in extras.items() if k in ENVELOPE_DEFAULTS}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c.attempt("$", lambda: MLIPSpec._from_envelope(DistributionSpec(), known, "$"))


def _check_output_kinds(c: _Collector, v: Any, path: str) -> None:
    if isinstance(v, Mapping):
        pairs = []
        for k, kind in v.items():
            if k == "":
                c.add(jpath(path, ""), "output names must be non-empty strings, got ''.")
            else:
                pairs.append((jpath(path, str(k)), k, kind))
    elif isinstance(v, list | tuple):
        pairs = []
        for i, p in enumerate(v):
            if not (isinstance(p, list | tuple) and len(p) == 2):
                c.add(jpath(path, i), f'must be a pair ["<output>", "<kind>"], got {short(p)}.')
            elif not isinstance(p[0], str) or not p[0]:
                c.add(jpath(jpath(path, i), 0), f"output names must be non-empty strings, got {short(p[0])}.")
            elif any(p[0] == q[1] for q in pairs):
                c.add(jpath(jpath(path, i), 0), f"output {p[0]!r} is declared twice; give each output one kind.")
            else:
                pairs.append((jpath(jpath(path, i), 1), p[0], p[1]))
    else:
        c.add(path, f"must be a list of [output, kind] pairs, got {json_type(v)}.")
        return
    for p, name, kind in pairs:
        if not isinstance(kind, str):
            c.add(p, f"output kind for {name!r}: must be a string, one of {list(OUTPUT_KINDS)}, got {json_type(kind)}.")
        elif kind not in OUTPUT_KINDS:
            c.add(p, unknown(f"output kind for {name!r}:", kind, OUTPUT_KINDS) + ".")


def _check_compile(c: _Collector, v: Any, path: str) -> None:
    if v is None:
        return
    if not isinstance(v, Mapping):
        c.add(path, f"must be null or an object, got {json_type(v)}.")
        return
    if not v:
        c.add(path, "an empty compile policy {} declares nothing; write null for no policy.")
        return
    allowed = ("static_shapes", "force_strategy", "stress_via_strain")
    for key in v:
        if key == "graph_padder":
            c.add(jpath(path, key), "graph_padder is dropped on load (nvalchemi-toolkit never writes it); remove it.")
        elif key not in allowed:
            c.add(jpath(path, key), unknown("compile key", key, allowed) + ".")
        elif key != "force_strategy" and not isinstance(v[key], bool):
            c.add(jpath(path, key), f"must be true or false, got {short(v[key])}.")
    if "force_strategy" not in v:
        c.add(path, f'missing "force_strategy"; one of {list(FORCE_STRATEGIES)}.')
    elif v["force_strategy"] not in FORCE_STRATEGIES:
        c.add(jpath(path, "force_strategy"), unknown("force strategy", v["force_strategy"], FORCE_STRATEGIES) + ".")
