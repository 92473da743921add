"""Spec files: a bare DistributionSpec dict, or the `{"version": 2, "core": ...}` envelope.

Envelope keys other than `version` and `core` (system_reductions, output_kinds,
compile, ...) belong to the model-level spec; they are kept verbatim so a file
writes back exactly as it was read, and `SpecFile.mlip` decodes (and validates) them
as an `MLIPSpec`. Loading imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from .distribution import DistributionSpec
from .errors import SpecError, SpecTypeError, json_type, type_name
from .frozen import FrozenDict, freeze_json, thaw_json
from .json_guard import check_depth, scan_text

SUPPORTED_VERSION = 2

# Envelope keys of nvalchemi-toolkit 0.2.0's MLIPSpec and the values it writes by default.
ENVELOPE_DEFAULTS: dict[str, Any] = {
    "system_reductions": True,
    "node_energy_key": None,
    "node_virial_key": None,
    "gp_replicate_geometry": False,
    "owned_only_outputs": [],
    "all_reduce_outputs": [],
    "output_kinds": [],
    "compile": None,
}


@dataclasses.dataclass(frozen=True)
class SpecFile:
    """A loaded spec file.

    Args:
        distribution: the DistributionSpec (the whole bare file, or the envelope's "core").
        envelope: the v2 envelope's other keys, verbatim (deep-frozen), or None for a
            bare file.
    """

    distribution: DistributionSpec
    envelope: FrozenDict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.distribution, DistributionSpec):
            raise SpecTypeError(f"SpecFile.distribution must be a DistributionSpec, got {type_name(self.distribution)}.")
        if self.envelope is not None:
            if not isinstance(self.envelope, Mapping):
                raise SpecTypeError(f"SpecFile.envelope must be a mapping or None, got {type_name(self.envelope)}.")
            if clash := sorted({"version", "core"} & set(self.envelope)):
                raise SpecError(f"SpecFile.envelope must not contain {clash}; they are written from the spec.")
            check_depth(self.envelope, "SpecFile.envelope")
            object.__setattr__(self, "envelope", freeze_json(self.envelope))

    @property
    def mlip(self) -> Any:
        """The file as an MLIPSpec: the envelope decoded and validated, or a bare file with the default envelope.

        Raises:
            SpecError: an envelope key is unknown or holds a bad value (the message gives its JSON path).
        """
        from .mlip import MLIPSpec

        return MLIPSpec.from_spec_file(self)

    @property
    def version(self) -> int | None:
        """2 for an envelope, None for a bare file."""
        return None if self.envelope is None else SUPPORTED_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON: bare, or the envelope with `version` and `core` first."""
        core = self.distribution.to_dict()
        if self.envelope is None:
            return core
        return {"version": SUPPORTED_VERSION, "core": core, **thaw_json(self.envelope)}

    def to_v2(self) -> SpecFile:
        """The same spec in a v2 envelope (a bare file gets the reference's default keys)."""
        if self.envelope is not None:
            return self
        return SpecFile(self.distribution, FrozenDict(ENVELOPE_DEFAULTS))

    def to_bare(self, *, drop_envelope: bool = False) -> SpecFile:
        """The same spec as a bare DistributionSpec file.

        Raises:
            SpecError: the envelope holds non-default values that a bare file cannot
                keep, unless `drop_envelope=True`.
        """
        if self.envelope is None:
            return self
        lost = sorted(k for k, v in thaw_json(self.envelope).items() if ENVELOPE_DEFAULTS.get(k, object()) != v)
        if lost and not drop_envelope:
            raise SpecError(
                f"converting to a bare file would drop the envelope keys {lost}, which hold "
                "non-default values; keep the v2 form, or pass drop_envelope=True "
                "(CLI: --drop-envelope) to discard them."
            )
        return SpecFile(self.distribution)


def parse_json(text: str, source: str = "") -> Any:
    """Parse spec JSON text, refusing what json.loads would take silently (see `json_guard.scan_text`).

    Raises:
        SpecError: invalid JSON (with line and column), nesting deeper than 32 levels, a
            duplicate key or a huge integer (with the JSON path).
    """
    scan_text(text, source)
    duplicates: list[str] = []

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs) and not duplicates:  # scan_text finds these first, with the path
            seen: set[str] = set()
            duplicates.append(next(k for k, _ in pairs if k in seen or seen.add(k)))
        return d

    try:
        value = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        loc = f"{source}:{e.lineno}:{e.colno}" if source else f"line {e.lineno} column {e.colno}"
        raise SpecError(f"{loc}: not valid JSON: {e.msg}.", path="$") from None
    except RecursionError:  # only if scan_text missed it
        raise SpecError(f"{source or 'the JSON'}: nested too deeply to parse; remove the extra nesting.",
                        path="$") from None
    except ValueError as e:  # e.g. an integer past Python's digit limit, if scan_text missed it
        raise SpecError(f"{source or 'the JSON'}: cannot be read: {e}.", path="$") from None
    if duplicates:
        raise SpecError(
            f"{source or 'the JSON'}: duplicate key {duplicates[0][:60]!r} in one object; keep one of them.",
            path="$",
        )
    return value


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a UTF-8 JSON file; every error is a SpecError naming the file and the line (or byte)."""
    source = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SpecError(
            f"{source}: byte {e.start} (line {line}) is 0x{data[e.start]:02x}, which is not UTF-8 ({e.reason}); "
            "spec files are UTF-8 JSON. Re-save the file as UTF-8.",
            path="$",
        ) from None
    return parse_json(text, source)


def split_envelope(d: Any, where: str = "$") -> tuple[Mapping[str, Any], dict[str, Any] | None]:
    """(core dict, envelope extras or None for a bare file); checks the version."""
    if not isinstance(d, Mapping):
        raise SpecTypeError(f"a spec file must hold a JSON object, got {json_type(d)}.", path=where)
    if "version" not in d and "core" not in d:
        return d, None
    if "version" not in d:
        raise SpecError('has "core" but no "version"; add "version": 2.', path=where)
    version = d["version"]
    if isinstance(version, bool) or version != SUPPORTED_VERSION:
        raise SpecError(
            f"unsupported spec file version {version!r}; this build reads version {SUPPORTED_VERSION} "
            "(the nvalchemi-toolkit 0.2.0 format) or a bare DistributionSpec object.",
            path=f"{where}.version",
        )
    if "core" not in d:
        raise SpecError('a version 2 file needs "core" (the DistributionSpec object).', path=where)
    return d["core"], {k: v for k, v in d.items() if k not in ("version", "core")}


def load_spec(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> SpecFile:
    """Load a spec file (or its parsed dict) without importing jax or torch.

    Ops and replacements stay lazy names; they are resolved only at install/compile.

    Args:
        path_or_dict: a path to a JSON file, or the already parsed JSON (an object; any
            other value is reported as not being one).

    Returns:
        a SpecFile; `.distribution` is the DistributionSpec, `.envelope` the other v2
        keys (None for a bare file), `.mlip` the whole file as an MLIPSpec.

    Raises:
        SpecError: invalid JSON, an unsupported version, or an invalid spec (the
            message gives the JSON path and the fix).

    Example:
        >>> load_spec({"version": 2, "core": {"policy": {"kind": "local"}}}).distribution.policy is None
        True
    """
    source = ""
    if isinstance(path_or_dict, str | bytes | os.PathLike):
        source = os.fsdecode(path_or_dict)
        d = read_json(source)
    else:  # already parsed JSON
        d = path_or_dict
        check_depth(d)
    try:
        core, extras = split_envelope(d)
        where = "$" if extras is None else "$.core"
        spec = DistributionSpec.from_dict(core, where=where, source=source)
    except SpecError as e:
        if source:
            raise type(e)(e.detail, path=f"{source}: {e.path}" if e.path else source) from None
        raise
    return SpecFile(spec, None if extras is None else FrozenDict(extras))


def save_spec(spec: Any, path: str | os.PathLike[str]) -> None:
    """Write a spec file as indented JSON: a SpecFile, an MLIPSpec (version 2) or a DistributionSpec (bare)."""
    from .mlip import MLIPSpec

    if isinstance(spec, DistributionSpec):
        spec = SpecFile(spec)
    if not isinstance(spec, SpecFile | MLIPSpec):
        raise SpecTypeError(f"save_spec expects a SpecFile, MLIPSpec or DistributionSpec, got {type_name(spec)}.")
    text = json.dumps(spec.to_dict(), indent=2)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
