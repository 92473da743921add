"""MLIPSpec: the model-level (version 2) spec, JSON-identical to nvalchemi-toolkit 0.2.0's.

A `DistributionSpec` (the JSON's `"core"`) plus what the model level needs to know about a
model's outputs: their kind (per node, per graph, global), how per-rank values combine
(owned-only, all-reduce), how forces are produced (`CompilePolicy.force_strategy`) and the
per-node energy/virial keys. Imports neither jax nor torch.

Deliberate differences from the reference (its JSON is unchanged):

- hashable, and `compile` takes part in equality: two specs that differ only in
  `force_strategy` make the model compute forces differently, so they are not equal;
- validated at construction: an output both `owned_only` and `all_reduce`, empty names,
  unknown kinds or strategies and unknown envelope keys raise instead of loading;
- `merge` keeps `output_kinds` and `gp_replicate_geometry`, and raises on conflicts that the
  reference resolves silently (first non-null key wins, or `compile` dropped with a warning).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .distribution import DistributionSpec
from .errors import SpecError, SpecTypeError, jpath, json_type, type_name, unknown
from .files import SUPPORTED_VERSION, read_json, split_envelope
from .frozen import FrozenDict
from .json_guard import check_depth
from .mlip_fields import ENVELOPE_KEYS as ENVELOPE_KEYS
from .mlip_fields import CompilePolicy as CompilePolicy
from .mlip_fields import ForceStrategy as ForceStrategy
from .mlip_fields import OutputKind as OutputKind
from .mlip_fields import OutputSpec as OutputSpec
from .mlip_fields import Reduce as Reduce
from .mlip_fields import _check_bool, _check_name, _kinds, _names, _output_spec, _rebased
from .policies import GraphParallelPolicy, HaloStoragePolicy


# --------------------------------------------------------------------------- MLIPSpec


@dataclasses.dataclass(frozen=True)
class MLIPSpec:
    """What a whole model needs from the framework: a DistributionSpec plus its outputs' semantics.

    Args:
        distribution: the DistributionSpec (the JSON's `"core"`).
        owned_only_outputs: outputs already correct on their owner's rows (kept, not reduced).
        all_reduce_outputs: outputs whose per-rank values are partials summed over ranks.
        output_kinds: `{name: kind}` or `[(name, kind), ...]`, kinds from `OutputKind`.
        system_reductions: route per-system scatters (energy sums) through the owned-only
            sum plus all-reduce.
        node_energy_key: a per-node energy output the framework sums into "energy", or None.
        node_virial_key: a per-node virial output the framework turns into "stress", or None.
        gp_replicate_geometry: graph-parallel only: run the model on the all-gathered geometry.
        outputs: the one-place form, lowered into the three fields above and not stored:
            `{"energy": "per_graph", "stress": ("per_graph", "all_reduce"),
            "forces": ("per_node", "owned_only")}` (values: a kind, a (kind, reduce) pair or an
            `OutputSpec`). As in the reference, an `"unknown"` kind records no kind, only its reduce.
        compile: a CompilePolicy, or None (the model computes its own forces).

    Names are stored as sorted tuples and `output_kinds` as a FrozenDict sorted by name, so
    specs built either way compare equal, hash, and write the same JSON. Unlike the reference,
    `compile` takes part in equality (it changes what the model computes).

    Raises:
        SpecError: an output in both owned_only_outputs and all_reduce_outputs, a name listed
            twice, a kind declared two ways, or an unknown kind (the message lists the allowed
            ones).
        SpecTypeError: a field of the wrong type.

    Example:
        >>> spec = MLIPSpec(DistributionSpec(HaloStoragePolicy()),
        ...                 outputs={"energy": "per_graph", "stress": ("per_graph", "all_reduce")})
        >>> spec.all_reduce_outputs, spec.kind_of("stress").value, spec.reduce_of("energy").value
        (('stress',), 'per_graph', 'none')
    """

    distribution: DistributionSpec
    owned_only_outputs: tuple[str, ...] = ()
    all_reduce_outputs: tuple[str, ...] = ()
    output_kinds: FrozenDict[str, OutputKind] = FrozenDict()
    system_reductions: bool = True
    node_energy_key: str | None = None
    node_virial_key: str | None = None
    gp_replicate_geometry: bool = False
    outputs: dataclasses.InitVar[Mapping[str, Any] | None] = None
    compile: CompilePolicy | None = None

    def __post_init__(self, outputs: Mapping[str, Any] | None) -> None:
        if not isinstance(self.distribution, DistributionSpec):
            raise SpecTypeError(
                f"MLIPSpec.distribution must be a DistributionSpec, got {type_name(self.distribution)}; "
                "wrap a policy as DistributionSpec(policy=...).",
                path="MLIPSpec.distribution",
            )
        for name in ("system_reductions", "gp_replicate_geometry"):
            _check_bool(getattr(self, name), f"MLIPSpec.{name}")
        for name in ("node_energy_key", "node_virial_key"):
            if (v := getattr(self, name)) is not None:
                _check_name(v, f"MLIPSpec.{name}", "output keys")
        owned = list(_names(self.owned_only_outputs, "MLIPSpec.owned_only_outputs"))
        reduced = list(_names(self.all_reduce_outputs, "MLIPSpec.all_reduce_outputs"))
        kinds = _kinds(self.output_kinds, "MLIPSpec.output_kinds")
        if outputs is not None:
            if not isinstance(outputs, Mapping):
                raise SpecTypeError(f"must be a mapping name -> declaration, got {type_name(outputs)}.",
                                    path="MLIPSpec.outputs")
            for name, value in outputs.items():
                here = jpath("MLIPSpec.outputs", str(name))
                _check_name(name, here)
                out = _output_spec(value, here)
                if out.kind is not OutputKind.UNKNOWN:
                    if kinds.get(name, out.kind) is not out.kind:
                        raise SpecError(
                            f"output {name!r} is {out.kind.value!r} here but {kinds[name].value!r} in output_kinds; "
                            "declare each output once.",
                            path=here,
                        )
                    kinds[name] = out.kind
                target = {Reduce.OWNED_ONLY: owned, Reduce.ALL_REDUCE: reduced}.get(out.reduce)
                if target is not None and name not in target:
                    target.append(name)
        if both := [n for n in reduced if n in owned]:
            raise SpecError(
                f"{sorted(both)} listed in both owned_only_outputs and all_reduce_outputs; an output is either "
                "already correct on its owner's rows (owned_only) or a per-rank partial summed over ranks "
                "(all_reduce). Remove it from one of them.",
                path=f"MLIPSpec.all_reduce_outputs[{reduced.index(both[0])}]",
            )
        if self.compile is not None and not isinstance(self.compile, CompilePolicy):
            hint = "; build it with CompilePolicy.from_dict(...)" if isinstance(self.compile, Mapping) else ""
            raise SpecTypeError(
                f"MLIPSpec.compile must be a CompilePolicy or None, got {type_name(self.compile)}{hint}.",
                path="MLIPSpec.compile",
            )
        object.__setattr__(self, "owned_only_outputs", tuple(sorted(owned)))
        object.__setattr__(self, "all_reduce_outputs", tuple(sorted(reduced)))
        object.__setattr__(self, "output_kinds", FrozenDict({k: kinds[k] for k in sorted(kinds)}))

    # ----------------------------------------------------------------- queries

    @property
    def force_strategy(self) -> ForceStrategy:
        """The compile policy's force strategy; `model_internal` (the reference default) without one."""
        return ForceStrategy.MODEL_INTERNAL if self.compile is None else self.compile.force_strategy

    def kind_of(self, name: str) -> OutputKind:
        """The declared kind of an output; `OutputKind.UNKNOWN` when it has none."""
        return self.output_kinds.get(name, OutputKind.UNKNOWN)

    def reduce_of(self, name: str) -> Reduce:
        """How an output combines across ranks: OWNED_ONLY, ALL_REDUCE, or NONE (by its kind)."""
        if name in self.owned_only_outputs:
            return Reduce.OWNED_ONLY
        if name in self.all_reduce_outputs:
            return Reduce.ALL_REDUCE
        return Reduce.NONE

    def output_specs(self) -> FrozenDict[str, OutputSpec]:
        """Every declared output (kind or reduce), sorted by name: the `outputs=` form of this spec."""
        names = sorted({*self.output_kinds, *self.owned_only_outputs, *self.all_reduce_outputs})
        return FrozenDict({n: OutputSpec(self.kind_of(n), self.reduce_of(n)) for n in names})

    # ----------------------------------------------------------------- builders

    def with_adapters(self, *adapters: Any) -> MLIPSpec:
        """A copy with adapters appended (OpAdapters to custom_ops, the rest to third_party_helpers)."""
        if not adapters:
            return self
        d = self.distribution
        core = DistributionSpec(d.policy, d.custom_ops, d.third_party_helpers, adapters, d.shard_fields)
        return dataclasses.replace(self, distribution=core)

    def with_compile(self, policy: CompilePolicy | None) -> MLIPSpec:
        """A copy with this compile policy (None: the model computes its own forces)."""
        return dataclasses.replace(self, compile=policy)

    def with_outputs(self, outputs: Mapping[str, Any]) -> MLIPSpec:
        """A copy where each output named in `outputs` is declared anew (its old kind and reduce dropped)."""
        names = set(outputs)
        return MLIPSpec(
            self.distribution,
            tuple(n for n in self.owned_only_outputs if n not in names),
            tuple(n for n in self.all_reduce_outputs if n not in names),
            {k: v for k, v in self.output_kinds.items() if k not in names},
            self.system_reductions, self.node_energy_key, self.node_virial_key, self.gp_replicate_geometry,
            outputs, self.compile,
        )

    def merge(self, other: MLIPSpec) -> MLIPSpec:
        """The spec of a pipeline running both models.

        - policy: None (local) yields to the other; two policies of one class keep it, halo
          modes taking the more permissive value (`halo_correction`, `halo_read`); anything
          else raises (unlike the reference, a mixed halo / refresh_halo pair raises too,
          since they fold ghost rows differently);
        - adapters concatenated, shard_fields an ordered union;
        - output sets and `output_kinds` united (the reference drops `output_kinds`); an
          `unknown` kind yields to a declared one, two different kinds raise;
        - `system_reductions` and `gp_replicate_geometry`: OR (either model needs it);
        - `node_energy_key`, `node_virial_key`, `compile`: equal or set on one side only (the
          key) / on both sides (compile), else SpecError. The reference keeps the first key
          silently and drops a mismatched compile with a warning.

        Raises:
            SpecError: the conflicts listed above, or an output owned-only in one spec and
                all-reduced in the other.
        """
        if not isinstance(other, MLIPSpec):
            raise SpecTypeError(f"MLIPSpec.merge expects an MLIPSpec, got {type_name(other)}.")
        a, b = self.distribution, other.distribution
        core = DistributionSpec(
            _merge_policies(a.policy, b.policy),
            a.custom_ops + b.custom_ops,
            a.third_party_helpers + b.third_party_helpers,
            shard_fields=tuple(dict.fromkeys(a.shard_fields + b.shard_fields)),
        )
        kinds = dict(self.output_kinds)
        for name, kind in other.output_kinds.items():
            mine = kinds.get(name, OutputKind.UNKNOWN)
            if OutputKind.UNKNOWN not in (mine, kind) and mine is not kind:
                raise SpecError(
                    f"MLIPSpec.merge: output {name!r} is {mine.value!r} in one spec and {kind.value!r} in the "
                    "other; rename one model's output, or declare the same kind in both (with_outputs)."
                )
            if kind is not OutputKind.UNKNOWN:
                kinds[name] = kind
        keys = {}
        for field in ("node_energy_key", "node_virial_key"):
            x, y = getattr(self, field), getattr(other, field)
            if x is not None and y is not None and x != y:
                raise SpecError(
                    f"MLIPSpec.merge: {field} is {x!r} in one spec and {y!r} in the other; the framework "
                    f"reduces one such output. Set the same {field} on both (dataclasses.replace)."
                )
            keys[field] = x if x is not None else y
        if self.compile != other.compile:
            raise SpecError(
                f"MLIPSpec.merge: the compile policies differ ({self.compile!r} vs {other.compile!r}); "
                "they decide how forces are computed, so pick one and set it on both with with_compile(...)."
            )
        return MLIPSpec(
            core,
            self.owned_only_outputs + tuple(n for n in other.owned_only_outputs if n not in self.owned_only_outputs),
            self.all_reduce_outputs + tuple(n for n in other.all_reduce_outputs if n not in self.all_reduce_outputs),
            kinds,
            self.system_reductions or other.system_reductions,
            gp_replicate_geometry=self.gp_replicate_geometry or other.gp_replicate_geometry,
            compile=self.compile,
            **keys,
        )

    # ----------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        """The reference's version 2 JSON: `version`, `core`, then the model-level keys."""
        return {
            "version": SUPPORTED_VERSION,
            "core": self.distribution.to_dict(),
            "system_reductions": self.system_reductions,
            "node_energy_key": self.node_energy_key,
            "node_virial_key": self.node_virial_key,
            "gp_replicate_geometry": self.gp_replicate_geometry,
            "owned_only_outputs": list(self.owned_only_outputs),
            "all_reduce_outputs": list(self.all_reduce_outputs),
            "output_kinds": [[k, v.value] for k, v in self.output_kinds.items()],
            "compile": None if self.compile is None else self.compile.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "$", source: str = "") -> MLIPSpec:
        """Inverse of to_dict. Ops stay lazy names: a spec naming an op not importable here loads.

        Args:
            d: the version 2 JSON object.
            where: JSON path of `d`, for messages.
            source: a file name recorded in each adapter's install_site.

        Raises:
            SpecError: a missing or unsupported `version`, an unknown key, or a bad value; the
                message starts with the JSON path (`$.output_kinds[2][1]`, `$.compile.force_strategy`).
        """
        if not isinstance(d, Mapping):
            raise SpecTypeError(f"an MLIPSpec must be a JSON object, got {json_type(d)}.", path=where)
        check_depth(d, where)
        core, extras = split_envelope(d, where)
        if extras is None:
            raise SpecError(
                'missing "version": an MLIPSpec is the version 2 envelope {"version": 2, "core": {...}, ...}. '
                "For a bare DistributionSpec use MLIPSpec(DistributionSpec.from_dict(d)), or "
                "load_spec(path).mlip, which gives it the default envelope.",
                path=where,
            )
        distribution = DistributionSpec.from_dict(core, where=jpath(where, "core"), source=source)
        return cls._from_envelope(distribution, extras, where)

    @classmethod
    def _from_envelope(cls, distribution: DistributionSpec, extras: Mapping[str, Any], where: str) -> MLIPSpec:
        """The spec from a decoded core and the envelope's other keys (JSON values, maybe deep-frozen)."""
        for key in extras:
            if key not in ENVELOPE_KEYS:
                raise SpecError(
                    unknown("envelope key", key, ENVELOPE_KEYS)
                    + "; nvalchemi-toolkit would ignore it, and so a misspelt key would pass unnoticed. "
                    "Fix the name or remove the key.",
                    path=jpath(where, str(key)),
                )
        fields = {k: extras[k] for k in ENVELOPE_KEYS if k in extras}
        for key in ("owned_only_outputs", "all_reduce_outputs"):
            if key in fields and not isinstance(fields[key], list | tuple):
                raise SpecTypeError(f"must be a list of output names, got {json_type(fields[key])}.",
                                    path=jpath(where, key))
        if "output_kinds" in fields and not isinstance(fields["output_kinds"], list | tuple | Mapping):
            raise SpecTypeError(f'must be a list of ["<output>", "<kind>"] pairs, got {json_type(fields["output_kinds"])}.',
                                path=jpath(where, "output_kinds"))
        if (raw := fields.get("compile")) is not None:
            fields["compile"] = CompilePolicy.from_dict(raw, where=jpath(where, "compile"))
        try:
            return cls(distribution, **fields)
        except SpecError as e:
            raise type(e)(e.detail, path=_rebased(e, "MLIPSpec", where)) from None

    @classmethod
    def from_spec_file(cls, f: Any) -> MLIPSpec:
        """The MLIPSpec of a loaded SpecFile; a bare file gets the default envelope."""
        from .files import SpecFile

        if not isinstance(f, SpecFile):
            raise SpecTypeError(f"MLIPSpec.from_spec_file expects a SpecFile (from load_spec), got {type_name(f)}.")
        if f.envelope is None:
            return cls(f.distribution)
        return cls._from_envelope(f.distribution, f.envelope, "$")

    def to_spec_file(self) -> Any:
        """This spec as a SpecFile (version 2 envelope)."""
        from .files import SpecFile

        d = self.to_dict()
        return SpecFile(self.distribution, {k: v for k, v in d.items() if k not in ("version", "core")})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON file (indent=2), as `save_spec(self, path)`."""
        from .files import save_spec

        save_spec(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MLIPSpec:
        """Read a version 2 file; errors name the file and the JSON path. Imports neither jax nor torch."""
        source = os.fspath(path)
        d = read_json(source)  # a syntax error names the file, line and column already
        try:
            return cls.from_dict(d, source=source)
        except SpecError as e:
            raise type(e)(e.detail, path=f"{source}: {e.path}" if e.path else source) from None


def _merge_policies(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if type(a) is not type(b):
        raise SpecError(
            f"MLIPSpec.merge: cannot merge storage policies {type_name(a)} and {type_name(b)}; "
            "the models must share one storage kind. Build both with the same policy."
        )
    if isinstance(a, HaloStoragePolicy):
        return type(a)(
            "halo_correction" if "halo_correction" in (a.scatter_mode, b.scatter_mode) else a.scatter_mode,
            "halo_read" if "halo_read" in (a.gather_mode, b.gather_mode) else a.gather_mode,
        )
    if a != b:
        raise SpecError(
            f"MLIPSpec.merge: the storage policies {a!r} and {b!r} differ; build both with the same policy."
        )
    return a


# --------------------------------------------------------------------------- presets

_HALO = HaloStoragePolicy("halo_correction", "halo_read")
_STANDARD_OUTPUTS = {"energy": "per_graph", "forces": "per_node", "stress": "per_graph", "atomic_energies": "per_node"}

#: Scatter-heavy MPNNs (MACE, NequIP, ...) on halo storage: the reference's preset, same JSON.
SPEC_MPNN_HALO = MLIPSpec(DistributionSpec(_HALO), outputs=_STANDARD_OUTPUTS)
#: The same MPNNs graph-parallel: per-node outputs owned-only, forces by autograd of the global energy.
SPEC_MPNN_GP = MLIPSpec(
    DistributionSpec(GraphParallelPolicy(), shard_fields=()),
    outputs={**_STANDARD_OUTPUTS, "forces": ("per_node", "owned_only"), "atomic_energies": ("per_node", "owned_only")},
    compile=CompilePolicy(force_strategy=ForceStrategy.FRAMEWORK_FROM_GLOBAL_ENERGY),
)
#: The reference's model presets whose JSON is identical to SPEC_MPNN_HALO (adapters come at run time).
SPEC_UMA_HALO = SPEC_LJ_HALO = SPEC_EWALD_HALO = SPEC_PME_HALO = SPEC_DFTD3_HALO = SPEC_MPNN_HALO
