"""Argument checks shared by the block potentials (no jax, no torch)."""

from typing import Any


def check_block(where: str, positions: Any, owned_mask: Any, charges: Any = None) -> int:
    """Check block shapes: positions (R, 3), owned_mask (R,), charges (R,); return R."""
    shape = tuple(positions.shape)
    if len(shape) != 2 or shape[1] != 3:
        raise ValueError(f"{where}: positions must have shape (R, 3), got {shape}.")
    rows = shape[0]
    if tuple(owned_mask.shape) != (rows,):
        raise ValueError(
            f"{where}: owned_mask must have shape ({rows},) like positions' rows, "
            f"got {tuple(owned_mask.shape)}; pass 1 for owned rows, 0 for ghost and padding rows."
        )
    if charges is not None and tuple(charges.shape) != (rows,):
        raise ValueError(
            f"{where}: charges must have shape ({rows},) like positions' rows, "
            f"got {tuple(charges.shape)}."
        )
    return rows


def check_scalars(where: str, **values: Any) -> None:
    """Check concrete scalar parameters are positive (alpha may be zero); traced values pass."""
    for name, v in values.items():
        if isinstance(v, (int, float)) and not (v > 0 or (name == "alpha" and v == 0)):
            raise ValueError(f"{where}: {name} must be positive, got {v!r}.")
