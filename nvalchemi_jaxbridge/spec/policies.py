"""Storage policies: how per-atom rows are stored across ranks.

`None` means local storage (no distribution). JSON form: `{"kind": ..., **fields}`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from .errors import SpecError, SpecTypeError, jpath, json_type, short, type_name, unknown

SCATTER_MODES = ("local", "halo_correction")
GATHER_MODES = ("local", "halo_read")


@runtime_checkable
class StoragePolicy(Protocol):
    """What a storage policy provides to the spec layer: a kind and its JSON form."""

    kind: str

    def to_dict(self) -> dict[str, Any]: ...


def _check_mode(cls: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"{cls}({name}=...): " + unknown("mode", value, allowed) + ".")


@dataclasses.dataclass(frozen=True)
class HaloStoragePolicy:
    """Each rank stores its owned rows plus ghost copies of its neighbours' rows.

    Args:
        scatter_mode: "halo_correction" adds ghost partials into their owners;
            "local" skips that correction.
        gather_mode: "halo_read" refreshes ghost rows from their owners; "local" does not.
    """

    scatter_mode: str = "halo_correction"
    gather_mode: str = "halo_read"
    kind: ClassVar[str] = "halo"

    def __post_init__(self) -> None:
        _check_mode(type(self).__name__, "scatter_mode", self.scatter_mode, SCATTER_MODES)
        _check_mode(type(self).__name__, "gather_mode", self.gather_mode, GATHER_MODES)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: kind and both modes."""
        return {"kind": self.kind, "scatter_mode": self.scatter_mode, "gather_mode": self.gather_mode}


@dataclasses.dataclass(frozen=True)
class RefreshOnlyHaloPolicy(HaloStoragePolicy):
    """Halo storage whose ghost rows are refreshed but never folded back into owners."""

    kind: ClassVar[str] = "refresh_halo"


@dataclasses.dataclass(frozen=True)
class PlainShard:
    """Each rank stores only its own rows (sharded storage, no ghosts)."""

    kind: ClassVar[str] = "shard"

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the kind only."""
        return {"kind": self.kind}


@dataclasses.dataclass(frozen=True)
class GraphParallelPolicy(PlainShard):
    """Sharded storage for graph-parallel models (whole-graph gathers, owned-row outputs)."""

    kind: ClassVar[str] = "graph_parallel"


def _fields_only(d: Mapping[str, Any], allowed: set[str], kind: str, where: str) -> None:
    if extra := sorted(set(d) - allowed - {"kind"}):
        raise SpecError(
            f"unknown field(s) {extra} for policy kind {kind!r}; allowed: {sorted(allowed) or 'none'}.",
            path=jpath(where, extra[0]),
        )


def _halo_builder(cls: type, default_scatter: str) -> Callable[[Mapping[str, Any]], Any]:
    def build(d: Mapping[str, Any], where: str = "policy") -> Any:
        _fields_only(d, {"scatter_mode", "gather_mode"}, cls.kind, where)
        for name, allowed in (("scatter_mode", SCATTER_MODES), ("gather_mode", GATHER_MODES)):
            if name in d and not isinstance(d[name], str):
                raise SpecTypeError(
                    f"{name} must be a string, one of {list(allowed)}; got {json_type(d[name])} {short(d[name])}.",
                    path=jpath(where, name),
                )
            if name in d and d[name] not in allowed:
                raise SpecError(unknown("mode", d[name], allowed) + ".", path=jpath(where, name))
        return cls(d.get("scatter_mode", default_scatter), d.get("gather_mode", "halo_read"))

    return build


def _plain_builder(cls: type) -> Callable[[Mapping[str, Any]], Any]:
    def build(d: Mapping[str, Any], where: str = "policy") -> Any:
        _fields_only(d, set(), cls.kind, where)
        return cls()

    return build


def _local_builder(d: Mapping[str, Any], where: str = "policy") -> None:
    _fields_only(d, set(), "local", where)
    return None


# The one explicit registry of the spec layer: policy kind -> builder(dict) -> policy.
# Tests that register kinds snapshot and restore it.
_BUILTIN_POLICY_KINDS: dict[str, Callable[..., Any]] = {
    "local": _local_builder,
    "halo": _halo_builder(HaloStoragePolicy, "halo_correction"),
    # A refresh_halo record without scatter_mode means "local" (the reference's
    # loader default), although RefreshOnlyHaloPolicy() defaults to halo_correction.
    "refresh_halo": _halo_builder(RefreshOnlyHaloPolicy, "local"),
    "shard": _plain_builder(PlainShard),
    "graph_parallel": _plain_builder(GraphParallelPolicy),
}
_POLICY_KINDS: dict[str, Callable[..., Any]] = dict(_BUILTIN_POLICY_KINDS)


def register_policy_kind(kind: str, builder: Callable[[Mapping[str, Any]], Any]) -> None:
    """Register a builder for a custom policy kind.

    Args:
        kind: the JSON `"kind"` string; must not be a built-in kind.
        builder: called with the policy's JSON dict; returns the policy object, which
            must have `kind` and `to_dict()`.

    Raises:
        SpecError: `kind` is built in, or not a non-empty string.
        TypeError: `builder` is not callable.
    """
    if not isinstance(kind, str) or not kind:
        raise SpecError(f"register_policy_kind: kind must be a non-empty string, got {kind!r}.")
    if kind in _BUILTIN_POLICY_KINDS:
        raise SpecError(
            f"register_policy_kind: {kind!r} is a built-in policy kind; choose another name."
        )
    if not callable(builder):
        raise SpecTypeError(
            f"register_policy_kind({kind!r}, ...): builder must be callable "
            f"(dict -> policy), got {type_name(builder)}."
        )
    _POLICY_KINDS[kind] = builder


def lookup_policy_kind(kind: str) -> Callable[..., Any] | None:
    """The builder registered for `kind`, or None."""
    return _POLICY_KINDS.get(kind)


def policy_kinds() -> list[str]:
    """All known policy kinds, sorted."""
    return sorted(_POLICY_KINDS)


def is_storage_policy(x: object) -> bool:
    """True for None or an object with a string `kind` and a callable `to_dict`."""
    return x is None or (isinstance(getattr(x, "kind", None), str) and callable(getattr(x, "to_dict", None)))


def policy_to_dict(policy: StoragePolicy | None) -> dict[str, Any]:
    """JSON form of a policy; None (local storage) is `{"kind": "local"}`."""
    if policy is None:
        return {"kind": "local"}
    if not is_storage_policy(policy):
        raise SpecTypeError(
            f"policy_to_dict: expected a storage policy or None, got {type_name(policy)}; "
            "use HaloStoragePolicy(), PlainShard(), ... or a registered custom kind."
        )
    return policy.to_dict()


def policy_from_dict(d: Mapping[str, Any], where: str = "policy") -> StoragePolicy | None:
    """Inverse of policy_to_dict; custom kinds go through their registered builder."""
    if not isinstance(d, Mapping):
        raise SpecError(
            f"a policy must be an object like {{\"kind\": \"halo\"}}, got {json_type(d)}.", path=where
        )
    if "kind" not in d:
        raise SpecError(
            f"policy {short(dict(d))} has no \"kind\"; expected one of {policy_kinds()}.", path=where
        )
    kind = d["kind"]
    if not isinstance(kind, str):
        raise SpecTypeError(
            f"a policy's \"kind\" must be a string, one of {policy_kinds()}; got {json_type(kind)} {short(kind)}.",
            path=jpath(where, "kind"),
        )
    builder = _POLICY_KINDS.get(kind)
    if builder is None:
        raise SpecError(
            unknown("policy kind", kind, _POLICY_KINDS)
            + ". A custom kind must be registered with register_policy_kind(kind, builder) first.",
            path=jpath(where, "kind"),
        )
    if kind in _BUILTIN_POLICY_KINDS:
        return builder(d, where)
    policy = builder(d)
    if not is_storage_policy(policy):
        raise SpecTypeError(
            f"the builder registered for policy kind {kind!r} returned {type_name(policy)}, "
            "which has no string `kind` and callable `to_dict()`; return a policy object.",
            path=where,
        )
    return policy
