"""A `KernelPotential`'s call recipe checked against its adapter, once, at construction.

The recipe is `args`, one item per kernel argument: `"positions"` (must be a
`GatherInputs` argument), `"owned_mask"` (already in halo rows, so no
transform), a per-atom array name, or a Python scalar; and `energy_output`,
an `AllReduceSum` output. Each check raises naming the item and the fix.
"""

from __future__ import annotations

from typing import Any

RESERVED = ("positions", "owned_mask")


def pick_adapter(custom_ops: tuple[Any, ...], chosen: Any) -> Any:
    """The adapter named by `chosen` (adapter, op or target name), or the only one."""
    names = [_target(a) for a in custom_ops]
    if chosen is None:
        if len(custom_ops) == 1:
            return custom_ops[0]
        raise ValueError(
            f"KernelPotential: the spec has {len(custom_ops)} adapters {names}; say which one gives the energy "
            "with adapter= (the OpAdapter, its op, or its target name)."
        )
    hits = [a for a, n in zip(custom_ops, names)
            if a is chosen or a.op is chosen or (isinstance(chosen, str) and chosen in (n, a.op))]
    if len(hits) != 1:
        raise ValueError(
            f"KernelPotential: adapter={chosen!r} matches {len(hits)} of the spec's adapters {names}; pass the "
            "OpAdapter itself, its op, or one of those target names."
        )
    return hits[0]


def _target(adapter: Any) -> str:
    """The adapter's target name (`describe().target`), or its op for a stand-in."""
    try:
        return str(adapter.describe().target)
    except Exception:  # noqa: BLE001 - a stand-in without describe()
        return str(adapter.op)


def check_recipe(args: tuple[Any, ...], adapter: Any) -> None:
    """Item types, one positions item on a GatherInputs argument, no transform outside the recipe."""
    from ..spec.transforms import GatherInputs

    where = "KernelPotential"
    for i, item in enumerate(args):
        if isinstance(item, str):
            if item not in RESERVED and not item.isidentifier():
                raise ValueError(
                    f"{where}: args[{i}] = {item!r} is neither 'positions', 'owned_mask' nor a per-atom array "
                    "name (a Python identifier such as 'charges')."
                )
        elif not isinstance(item, (bool, int, float)):
            raise TypeError(
                f"{where}: args[{i}] is {type(item).__name__}; recipe items are 'positions', 'owned_mask', a "
                "per-atom array name, or a Python scalar (constant arrays: close over them in the kernel)."
            )
    if args.count("positions") != 1:
        raise ValueError(
            f"{where}: args must name 'positions' exactly once, got {args.count('positions')} in {args!r}; put "
            "'positions' at the kernel's positions argument."
        )
    pos = args.index("positions")
    transforms = adapter.arg_transforms
    if not isinstance(transforms.get(pos), GatherInputs):
        raise ValueError(
            f"{where}: args[{pos}] is 'positions', but the adapter has "
            f"{type(transforms.get(pos)).__name__ if pos in transforms else 'no transform'} on argument {pos}; "
            f"declare it gathered: OpAdapter(op, gather_inputs=[{pos}], ...)."
        )
    for i, item in enumerate(args):
        if item == "owned_mask" and i in transforms:
            raise ValueError(
                f"{where}: args[{i}] is 'owned_mask' (the halo block's owned rows), but the adapter declares "
                f"{type(transforms[i]).__name__}() on argument {i}; remove that transform."
            )
    if beyond := sorted(p for p in transforms if p >= len(args)):
        raise ValueError(
            f"{where}: the adapter declares {type(transforms[beyond[0]]).__name__}() on argument {beyond[0]}, but "
            f"args has only {len(args)} items; extend args to cover every transformed argument."
        )


def check_energy_output(index: Any, adapter: Any) -> None:
    """`energy_output` is an output index >= 0 with `AllReduceSum()` declared on it."""
    from ..spec.transforms import AllReduceSum

    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"KernelPotential: energy_output must be an output index >= 0, got {index!r}.")
    if not isinstance(adapter.output_transforms.get(index), AllReduceSum):
        raise ValueError(
            f"KernelPotential: energy_output={index}, but the adapter's output {index} has no AllReduceSum() "
            f"(it has {adapter.output_transforms.get(index)!r}); the energy must be summed over devices: "
            f"OpAdapter(op, ..., all_reduce_outputs=[{index}]), or point energy_output at that output."
        )
