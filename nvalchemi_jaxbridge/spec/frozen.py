"""Immutable, hashable containers for declarations that must compare and hash."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class FrozenDict[K, V](Mapping[K, V]):
    """A read-only, hashable mapping; reads like a dict, compares equal to an equal dict."""

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(items or {}))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self._data.items())))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __or__(self, other: Mapping[K, V]) -> dict[K, V]:
        return {**self._data, **other}

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only; build a new one instead")

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self):
        return (type(self), (self._data,))

    def copy(self) -> dict[K, V]:
        """A mutable copy as a plain dict."""
        return dict(self._data)


def freeze_json(x: Any) -> Any:
    """JSON data made hashable: dicts -> FrozenDict, lists -> tuples (recursively)."""
    if isinstance(x, Mapping):
        return FrozenDict({k: freeze_json(v) for k, v in x.items()})
    if isinstance(x, list | tuple):
        return tuple(freeze_json(v) for v in x)
    return x


def thaw_json(x: Any) -> Any:
    """Inverse of freeze_json: FrozenDict -> dict, tuples -> lists."""
    if isinstance(x, Mapping):
        return {k: thaw_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [thaw_json(v) for v in x]
    return x


class _KeyedEquality:
    """Equality and hash by `_key()`, for declarations of one exact type (a subclass sets `_key`).

    Mixed into the adapter dataclasses (declared with `eq=False`, so dataclasses
    does not replace these two methods).
    """

    __slots__ = ()

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())
