"""Errors of the layout layer."""

from __future__ import annotations


class HaloOverflowError(ValueError):
    """A capacity of a `HaloPlan` is smaller than the rows the system needs.

    `overflows` maps each capacity name to `(needed, reserved)`.
    """

    def __init__(self, message: str, overflows: dict[str, tuple[int, int]]):
        super().__init__(message)
        self.overflows = overflows
