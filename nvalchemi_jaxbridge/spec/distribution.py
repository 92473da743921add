"""DistributionSpec: a storage policy plus the adapters a model needs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from .adapter import OpAdapter
from .errors import SpecError, SpecTypeError, jpath, json_type, short, type_name, unknown
from .json_guard import check_depth
from .policies import StoragePolicy, is_storage_policy, policy_from_dict, policy_to_dict
from .registry import AdapterRegistry
from .third_party import adapter_from_dict, is_third_party_adapter

DEFAULT_SHARD_FIELDS: tuple[str, ...] = ("positions", "charges", "atomic_numbers")
_KEYS = ("policy", "custom_ops", "third_party_helpers", "shard_fields")


def _as_tuple(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise SpecTypeError(
            f"DistributionSpec.{name} must be a tuple or list, got {type_name(value)}.",
            path=f"DistributionSpec.{name}",
        )
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class DistributionSpec:
    """How per-atom storage is laid out across ranks, and which adapters run.

    Args:
        policy: a storage policy (HaloStoragePolicy(), PlainShard(), ...) or None (local).
        custom_ops: OpAdapters.
        third_party_helpers: PythonAdapter / JitAdapter / MethodAdapter /
            ModuleForwardAdapter (or a registered custom kind).
        adapters: either kind, mixed; moved into the two fields above at construction
            (op adapters after custom_ops, the rest after third_party_helpers), then ().
        shard_fields: the per-atom input fields that are sharded.

    Unlike the reference, specs are hashable and shard_fields takes part in equality.

    Example:
        >>> spec = DistributionSpec(HaloStoragePolicy(), adapters=(OpAdapter("demo::conv", gather_inputs=[0]),))
        >>> spec.custom_ops[0].gather_inputs, spec.adapters
        ((0,), ())
    """

    policy: StoragePolicy | None = None
    custom_ops: tuple[OpAdapter, ...] = ()
    third_party_helpers: tuple[Any, ...] = ()
    adapters: tuple[Any, ...] = ()
    shard_fields: tuple[str, ...] = DEFAULT_SHARD_FIELDS

    def __post_init__(self) -> None:
        if not is_storage_policy(self.policy):
            raise SpecTypeError(
                f"DistributionSpec.policy must be a StoragePolicy or None, got {type_name(self.policy)}; "
                "use HaloStoragePolicy(), RefreshOnlyHaloPolicy(), PlainShard(), "
                "GraphParallelPolicy(), None (local) or a registered custom kind.",
                path="DistributionSpec.policy",
            )
        ops = list(_as_tuple(self.custom_ops, "custom_ops"))
        helpers = list(_as_tuple(self.third_party_helpers, "third_party_helpers"))
        for i, a in enumerate(ops):
            if not isinstance(a, OpAdapter):
                raise SpecTypeError(
                    f"entries must be OpAdapter, got {type_name(a)}"
                    + ("; third-party adapters go in third_party_helpers." if is_third_party_adapter(a) else "."),
                    path=f"DistributionSpec.custom_ops[{i}]",
                )
        for i, a in enumerate(helpers):
            if not is_third_party_adapter(a):
                raise SpecTypeError(
                    f"entries must be third-party adapters (PythonAdapter, JitAdapter, MethodAdapter, "
                    f"ModuleForwardAdapter), got {type_name(a)}"
                    + ("; OpAdapters go in custom_ops." if isinstance(a, OpAdapter) else "."),
                    path=f"DistributionSpec.third_party_helpers[{i}]",
                )
        for i, a in enumerate(_as_tuple(self.adapters, "adapters")):
            if isinstance(a, OpAdapter):
                ops.append(a)
            elif is_third_party_adapter(a):
                helpers.append(a)
            else:
                raise SpecTypeError(
                    f"{type_name(a)} {a!r} is not an adapter; pass OpAdapter, PythonAdapter, "
                    "JitAdapter, MethodAdapter or ModuleForwardAdapter instances.",
                    path=f"DistributionSpec.adapters[{i}]",
                )
        fields = _as_tuple(self.shard_fields, "shard_fields")
        for i, f in enumerate(fields):
            if not isinstance(f, str) or not f:
                raise SpecTypeError(
                    f"field names must be non-empty strings, got {short(f)}.",
                    path=f"DistributionSpec.shard_fields[{i}]",
                )
            if f in fields[:i]:
                raise SpecError(f"{f!r} is listed twice; list each field once.", path=f"DistributionSpec.shard_fields[{i}]")
        object.__setattr__(self, "custom_ops", tuple(ops))
        object.__setattr__(self, "third_party_helpers", tuple(helpers))
        object.__setattr__(self, "adapters", ())
        object.__setattr__(self, "shard_fields", fields)

    @property
    def all_adapters(self) -> tuple[Any, ...]:
        """custom_ops then third_party_helpers: the order they are installed in."""
        return self.custom_ops + self.third_party_helpers

    @contextlib.contextmanager
    def installed(self) -> Iterator[AdapterRegistry]:
        """Install every adapter (all or none) for the body; restore them on exit, even on error.

        Yields:
            the AdapterRegistry, for `list_active()`.
        """
        registry = AdapterRegistry()
        registry.install(self.all_adapters)
        try:
            yield registry
        finally:
            registry.restore()

    def to_dict(self) -> dict[str, Any]:
        """JSON form; shard_fields is written only when it differs from the default."""
        d: dict[str, Any] = {
            "policy": policy_to_dict(self.policy),
            "custom_ops": [a.to_dict() for a in self.custom_ops],
            "third_party_helpers": [h.to_dict() for h in self.third_party_helpers],
        }
        if self.shard_fields != DEFAULT_SHARD_FIELDS:
            d["shard_fields"] = list(self.shard_fields)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "$", source: str = "") -> DistributionSpec:
        """Inverse of to_dict. Ops and replacements stay lazy names: nothing is imported.

        Args:
            d: the JSON dict.
            where: JSON path of `d`, for error messages.
            source: a file name recorded in each adapter's install_site.
        """
        if not isinstance(d, Mapping):
            raise SpecTypeError(f"a DistributionSpec must be an object, got {json_type(d)}.", path=where)
        check_depth(d, where)
        if extra := sorted(set(d) - set(_KEYS)):
            raise SpecError(unknown("key", extra[0], _KEYS) + ".", path=jpath(where, extra[0]))
        if "policy" not in d:
            raise SpecError(
                'missing "policy"; write {"kind": "local"} for local storage or e.g. '
                '{"kind": "halo", "scatter_mode": "halo_correction", "gather_mode": "halo_read"}.',
                path=where,
            )
        policy = policy_from_dict(d["policy"], jpath(where, "policy"))
        lists = {}
        for key in ("custom_ops", "third_party_helpers", "shard_fields"):
            value = d.get(key, [])
            if not isinstance(value, list | tuple):
                raise SpecTypeError(f"{key} must be a list, got {json_type(value)}.", path=jpath(where, key))
            lists[key] = value

        def site(path: str) -> str:
            return f"{source}:{path}" if source else path

        ops = []
        for i, a in enumerate(lists["custom_ops"]):
            path = jpath(jpath(where, "custom_ops"), i)
            ops.append(OpAdapter.from_dict(a, where=path, install_site=site(path)))
        helpers = []
        for i, h in enumerate(lists["third_party_helpers"]):
            path = jpath(jpath(where, "third_party_helpers"), i)
            helpers.append(adapter_from_dict(h, where=path, install_site=site(path)))
        fields = tuple(lists["shard_fields"]) if "shard_fields" in d else DEFAULT_SHARD_FIELDS
        try:
            return cls(policy, tuple(ops), tuple(helpers), shard_fields=fields)
        except SpecError as e:
            path = (e.path or "").replace("DistributionSpec.", f"{where}.", 1)
            raise type(e)(e.detail, path=path or where) from None
