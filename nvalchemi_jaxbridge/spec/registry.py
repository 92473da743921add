"""AdapterRegistry: installs a list of adapters in order and restores them all."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .status import AdapterState, AdapterStatus


@dataclasses.dataclass
class _Handle:
    """One adapter's lifecycle inside a registry (mutable by design)."""

    adapter: Any
    state: AdapterState = "pending"
    memento: Any = None
    error: str | None = None


class AdapterRegistry:
    """Owns the install/restore lifecycle of a set of adapters.

    `install` is all-or-nothing: when an adapter fails, every adapter this registry
    installed so far is restored and the original exception is re-raised. `restore`
    is best-effort and idempotent: it never raises, and failures are recorded in
    `list_active()`.

    Example:
        >>> reg = AdapterRegistry()
        >>> reg.install([])
        >>> reg.list_active()
        []
    """

    def __init__(self) -> None:
        self._handles: list[_Handle] = []

    def install(self, adapters: Iterable[Any]) -> None:
        """Install each adapter in order; on the first failure roll back all, then re-raise."""
        for adapter in adapters:
            handle = _Handle(adapter)
            self._handles.append(handle)
            try:
                handle.memento = adapter.install()
            except Exception as e:
                handle.state, handle.error = "failed", repr(e)
                self.restore()
                raise
            handle.state = "installed"

    def restore(self) -> None:
        """Restore installed adapters in reverse order; never raises, safe to call twice."""
        for handle in reversed(self._handles):
            if handle.state != "installed":
                continue
            try:
                handle.adapter.restore(handle.memento)
            except Exception as e:  # recorded, so one broken adapter does not block the rest
                handle.error = repr(e)
                continue
            handle.state, handle.memento = "restored", None

    def list_active(self) -> list[AdapterStatus]:
        """Status of every adapter this registry has seen (failed and restored included)."""
        return [h.adapter.describe(state=h.state, error=h.error) for h in self._handles]
