"""Convert declarations built with nvalchemi-toolkit's own classes into ours, via their JSON form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_TRANSFORM_KINDS = {
    "GatherInputs": "gather_inputs",
    "GatherInputsFull": "gather_inputs_full",
    "SliceOwned": "slice_owned",
    "ScatterOutputs": "scatter_outputs",
    "AllReduceSum": "all_reduce_sum",
    "SliceOutputsOwned": "slice_outputs_owned",
}
_ARG_KINDS = ("gather_inputs", "gather_inputs_full", "slice_owned")
_POLICY_KINDS = ("local", "halo", "refresh_halo", "shard", "graph_parallel")


def _json_of(obj: Any) -> Any:
    """`obj`'s JSON form: `to_dict()` for objects that have it, a mapping as is; round-tripped through json."""
    if isinstance(obj, Mapping):
        d = obj
    elif callable(getattr(obj, "to_dict", None)):
        d = obj.to_dict()
    else:
        raise TypeError(
            f"from_nvalchemi: {type(obj).__module__}.{type(obj).__name__} has no to_dict(); pass an "
            "nvalchemi OpAdapter, DistributionSpec, storage policy, transform, third-party adapter, "
            "MLIPSpec, or their JSON dict"
        )
    try:
        return json.loads(json.dumps(d))
    except TypeError as e:
        raise TypeError(f"from_nvalchemi: the to_dict() of {type(obj).__name__} is not JSON ({e})") from None


def from_nvalchemi(obj: Any) -> Any:
    """One nvalchemi-toolkit declaration as the matching `nvalchemi_jaxbridge.spec` object.

    Duck-typed: anything with a `to_dict()` (or a dict of that form) is
    converted through JSON, so it works with or without nvalchemi installed.
    Transform markers (no `to_dict`) are matched by class name.

    Args:
        obj: an `OpAdapter`, `DistributionSpec`, `MLIPSpec` (its `core`), storage
            policy, transform, or third-party adapter of nvalchemi-toolkit.

    Returns:
        Our `OpAdapter`, `DistributionSpec`, policy (None for local storage),
        transform or third-party adapter; lazy op names stay lazy.

    Raises:
        TypeError: the object has no recognisable JSON form.
        ValueError: the JSON is of an unknown kind.

    Example:
        >>> ours = from_nvalchemi(nvalchemi_model.distribution_spec())
    """
    from ..spec import adapter, distribution, policies, third_party, transforms

    name = type(obj).__name__
    if name in _TRANSFORM_KINDS and not hasattr(obj, "to_dict"):
        kind = _TRANSFORM_KINDS[name]
        d = {"type": kind, **({"replicated_consumer": bool(obj.replicated_consumer)} if kind == "all_reduce_sum"
                              else {})}
        if kind in _ARG_KINDS:
            return transforms.arg_transform_from_dict(d)
        return transforms.output_transform_from_dict(d)
    d = _json_of(obj)
    if not isinstance(d, dict):
        raise TypeError(f"from_nvalchemi: expected a JSON object from {name}, got {type(d).__name__}")
    if "version" in d and "core" in d:  # MLIPSpec v2: the distribution part is "core"
        return distribution.DistributionSpec.from_dict(d["core"], where="$.core")
    if "policy" in d:
        return distribution.DistributionSpec.from_dict(d)
    if "op" in d:
        return adapter.OpAdapter.from_dict(d)
    if "type" in d:
        if d["type"] in _ARG_KINDS:
            return transforms.arg_transform_from_dict(d)
        return transforms.output_transform_from_dict(d)
    if d.get("kind") in _POLICY_KINDS or policies.lookup_policy_kind(d.get("kind", "")) is not None:
        return policies.policy_from_dict(d)
    if "kind" in d:
        return third_party.adapter_from_dict(d)
    raise ValueError(
        f"from_nvalchemi: cannot tell what {name} is from its keys {sorted(d)}; expected an OpAdapter "
        "('op'), a DistributionSpec ('policy'), an MLIPSpec ('version', 'core'), a transform ('type'), "
        "or a policy / third-party adapter ('kind')"
    )
