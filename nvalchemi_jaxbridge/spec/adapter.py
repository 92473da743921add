"""OpAdapter: which arguments and outputs of a kernel play which cross-rank role."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import SpecError, SpecTypeError, jpath, json_type, type_name, unknown
from .frozen import FrozenDict, _KeyedEquality
from .op_ref import normalize_op, op_key, op_qualname, op_target, resolve_op
from .positions import ARG_ROLES, OUTPUT_ROLES, apply_roles, check_transforms, position_from_key
from .status import AdapterState, AdapterStatus, capture_install_site
from .transforms import (
    AllReduceSum,
    ArgTransform,
    GatherInputs,
    GatherInputsFull,
    OutputTransform,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
    arg_transform_from_dict,
    output_transform_from_dict,
    transform_to_dict,
)

_DICT_KEYS = ("op", "arg_transforms", "output_transforms")


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class OpAdapter(_KeyedEquality):
    """Declare the cross-rank roles of a torch custom op's arguments and outputs.

    Args:
        op: a torch op (`torch.ops.ns.name`, normalised to `.default`; an explicit
            overload; a `torch.library.custom_op` object), a lazy name `"ns::name"` or
            `"ns::name.overload"` (resolved only at install/compile time), or a callable.
        arg_transforms: position -> GatherInputs / GatherInputsFull / SliceOwned.
        output_transforms: position -> ScatterOutputs / AllReduceSum / SliceOutputsOwned.
        gather_inputs, neighbors_inputs: positions that get GatherInputs().
        gather_inputs_full: positions that get GatherInputsFull().
        owned_slice_inputs: positions that get SliceOwned().
        scatter_outputs: output positions that get ScatterOutputs().
        all_reduce_outputs: output positions that get AllReduceSum() (partial gradients;
            for a replicated consumer use output_transforms={i: AllReduceSum(True)}).
        slice_outputs_owned: output positions that get SliceOutputsOwned().
        install_site: where it was declared; captured from the caller when empty.

    Raises:
        SpecError / SpecTypeError: a transform in the wrong slot, a non-int, negative or
            duplicate position, two different transforms for one position, a malformed
            op name. Messages name the adapter and the position.

    Example:
        >>> OpAdapter("demo::conv", gather_inputs=[0], scatter_outputs=[0]).to_dict()["arg_transforms"]
        {'0': {'type': 'gather_inputs'}}
    """

    op: Any
    arg_transforms: FrozenDict[int, ArgTransform]
    output_transforms: FrozenDict[int, OutputTransform]
    install_site: str = dataclasses.field(default="", compare=False)

    def __init__(
        self,
        op: Any,
        arg_transforms: Mapping[int, ArgTransform] | None = None,
        output_transforms: Mapping[int, OutputTransform] | None = None,
        *,
        gather_inputs: Iterable[int] = (),
        neighbors_inputs: Iterable[int] = (),
        gather_inputs_full: Iterable[int] = (),
        owned_slice_inputs: Iterable[int] = (),
        scatter_outputs: Iterable[int] = (),
        all_reduce_outputs: Iterable[int] = (),
        slice_outputs_owned: Iterable[int] = (),
        install_site: str = "",
    ) -> None:
        try:
            op = normalize_op(op)
        except SpecError as e:
            raise type(e)(e.detail, path=f"OpAdapter({op!r})") from None
        where = f"OpAdapter({op_target(op)!r})"
        args = check_transforms(arg_transforms, "arg_transforms", where)
        outs = check_transforms(output_transforms, "output_transforms", where)
        arg_table, out_table = dict(args), dict(outs)
        roles = dict(
            gather_inputs=gather_inputs,
            neighbors_inputs=neighbors_inputs,
            gather_inputs_full=gather_inputs_full,
            owned_slice_inputs=owned_slice_inputs,
            scatter_outputs=scatter_outputs,
            all_reduce_outputs=all_reduce_outputs,
            slice_outputs_owned=slice_outputs_owned,
        )
        apply_roles(arg_table, args, roles, ARG_ROLES, where)
        apply_roles(out_table, outs, roles, OUTPUT_ROLES, where)
        if not isinstance(install_site, str):
            raise SpecTypeError(f"install_site must be a str, got {type_name(install_site)}.", path=where)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "arg_transforms", FrozenDict(sorted(arg_table.items())))
        object.__setattr__(self, "output_transforms", FrozenDict(sorted(out_table.items())))
        object.__setattr__(self, "install_site", install_site or capture_install_site())

    def _key(self) -> tuple[Any, ...]:
        return (op_key(self.op), self.arg_transforms, self.output_transforms)

    def __copy__(self) -> OpAdapter:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> OpAdapter:
        return self

    def __reduce__(self):
        # Live torch ops do not pickle; their name does, and equality is by name.
        op = op_qualname(self.op) or self.op
        return (_rebuild, (op, dict(self.arg_transforms), dict(self.output_transforms), self.install_site))

    def __repr__(self) -> str:
        parts = [repr(op_qualname(self.op) or self.op)]
        if self.arg_transforms:
            parts.append(f"arg_transforms={self.arg_transforms!r}")
        if self.output_transforms:
            parts.append(f"output_transforms={self.output_transforms!r}")
        return f"OpAdapter({', '.join(parts)})"

    # -- positions by role (sorted tuples) --

    def _positions(self, table: Mapping[int, Any], cls: type) -> tuple[int, ...]:
        return tuple(sorted(p for p, t in table.items() if type(t) is cls))

    @property
    def gather_inputs(self) -> tuple[int, ...]:
        """Argument positions with GatherInputs."""
        return self._positions(self.arg_transforms, GatherInputs)

    @property
    def gather_inputs_full(self) -> tuple[int, ...]:
        """Argument positions with GatherInputsFull."""
        return self._positions(self.arg_transforms, GatherInputsFull)

    @property
    def owned_slice_inputs(self) -> tuple[int, ...]:
        """Argument positions with SliceOwned."""
        return self._positions(self.arg_transforms, SliceOwned)

    @property
    def scatter_outputs(self) -> tuple[int, ...]:
        """Output positions with ScatterOutputs."""
        return self._positions(self.output_transforms, ScatterOutputs)

    @property
    def all_reduce_outputs(self) -> tuple[int, ...]:
        """Output positions with AllReduceSum, either flag."""
        return self._positions(self.output_transforms, AllReduceSum)

    @property
    def all_reduce_replicated_outputs(self) -> tuple[int, ...]:
        """Output positions with AllReduceSum(replicated_consumer=True)."""
        return tuple(
            p for p, t in self.output_transforms.items()
            if type(t) is AllReduceSum and t.replicated_consumer
        )

    @property
    def slice_outputs_owned(self) -> tuple[int, ...]:
        """Output positions with SliceOutputsOwned."""
        return self._positions(self.output_transforms, SliceOutputsOwned)

    # -- lifecycle --

    def describe(self, state: AdapterState = "pending", error: str | None = None) -> AdapterStatus:
        """A snapshot of this adapter for AdapterRegistry.list_active()."""
        return AdapterStatus("op", op_target(self.op), state, self.install_site, error)

    def live_op(self) -> Any:
        """The op to dispatch on: a lazy name is resolved to its torch OpOverload here.

        Raises:
            OpResolutionError: the name is not registered (the message names the
                namespace and says to import the extension that registers it).
        """
        if isinstance(self.op, str):
            try:
                return resolve_op(self.op)
            except SpecError as e:
                raise type(e)(e.detail + f" (declared at {self.install_site or 'unknown site'})",
                              path=f"OpAdapter({self.op!r})") from None
        return self.op

    def install(self) -> Any:
        """Register this adapter's dispatch rule with the torch front door; returns a memento."""
        live = self.live_op()
        from ..torch.dispatch import install_adapter

        return install_adapter(self, live)

    def restore(self, memento: Any) -> None:
        """Undo install() given its memento."""
        from ..torch.dispatch import restore_adapter

        restore_adapter(memento)

    # -- JSON --

    def to_dict(self) -> dict[str, Any]:
        """JSON form: op name, then transforms keyed by decimal position strings."""
        name = op_qualname(self.op)
        if name is None:
            raise SpecError(
                f"op {op_target(self.op)} is a plain callable and has no 'ns::name' to write; "
                "register it as a torch custom op (torch.library.custom_op('ns::name', ...)) "
                "or patch it with a PythonAdapter instead.",
                path=f"OpAdapter({op_target(self.op)!r})",
            )
        return {
            "op": name,
            "arg_transforms": {str(p): transform_to_dict(t) for p, t in self.arg_transforms.items()},
            "output_transforms": {
                str(p): transform_to_dict(t) for p, t in self.output_transforms.items()
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "OpAdapter", install_site: str = "") -> OpAdapter:
        """Inverse of to_dict. The op stays a lazy name: nothing is imported or resolved.

        Args:
            d: the JSON dict.
            where: JSON path used in error messages.
            install_site: recorded as the declaration site (default: the caller).
        """
        if not isinstance(d, Mapping):
            raise SpecTypeError(
                f"an op adapter must be an object with \"op\", got {json_type(d)}.", path=where
            )
        if extra := sorted(set(d) - set(_DICT_KEYS)):
            raise SpecError(unknown("key", extra[0], _DICT_KEYS) + ".", path=jpath(where, extra[0]))
        if "op" not in d:
            raise SpecError(
                "missing \"op\"; write the op as \"<namespace>::<name>\", e.g. \"demo::spread\".",
                path=where,
            )
        op = d["op"]
        if not isinstance(op, str):
            raise SpecTypeError(f"\"op\" must be a string 'ns::name', got {json_type(op)}.", path=jpath(where, "op"))
        try:
            normalize_op(op)
        except SpecError as e:
            raise SpecError(e.detail, path=jpath(where, "op")) from None
        tables = []
        for slot, decode in (("arg_transforms", arg_transform_from_dict), ("output_transforms", output_transform_from_dict)):
            raw = d.get(slot, {})
            here = jpath(where, slot)
            if not isinstance(raw, Mapping):
                raise SpecTypeError(f"{slot} must be an object {{\"<position>\": {{...}}}}, got {json_type(raw)}.", path=here)
            table = {}
            for key, value in raw.items():
                kpath = jpath(here, str(key))
                table[position_from_key(key, kpath)] = decode(value, kpath)
            tables.append(table)
        return cls(op, tables[0], tables[1], install_site=install_site or capture_install_site())


def _rebuild(op: Any, args: dict[int, Any], outs: dict[int, Any], install_site: str) -> OpAdapter:
    """Unpickle an OpAdapter (torch ops come back as lazy names)."""
    return OpAdapter(op, args, outs, install_site=install_site)
