"""Torch autograd graphs kept from a differentiated forward until its backward: one table per call.

When JAX differentiates a call of a torch op, the forward runs the op once under
torch autograd and keeps `(leaves, outputs)` (the differentiated inputs, cloned,
and the results that get cotangents) in the call's `GraphTable` under a token,
an int32 pair `(salt, serial)` that reaches the backward as a residual. The
backward takes the entry out and calls `torch.autograd.grad` on it: one forward
and one backward, as `energy.backward()` in torch. An entry that is not there
(a pullback called twice, an entry evicted, a token of another table or
process: the salt differs) makes the backward re-run the op on the saved inputs
instead, which gives the same gradient at the cost of a second forward.

Bounded memory: at most `cap` entries live per table (`GRAPH_CAP`). A forward
whose backward never runs (a `jax.vjp` whose pullback is never called, a
gradient that dead-code elimination dropped) holds its graph until `cap` newer
forwards of the same call evict it. The FFI path keeps its graphs in C++ the
same way (`ffi/graphs.cc`: one table per differentiated-forward plan, that is
per op and static arguments; same cap), except that its forward reads XLA's
input buffers in place instead of cloning them, and its backward uses a graph
only when it gets those same buffers (else it re-runs the op). The backward is
not marked as a side effect (`has_side_effect`), which would keep it from being
dropped: a program whose gradient is unused would then pay for a backward it
does not need, and the effect would add ordering tokens to every differentiated
program; the cap bounds what a dropped backward leaves behind instead.

On a GPU the token is written with two fills on XLA's stream. On the callback
path the backward reads it back to the host, which waits for the stream to reach
it (one synchronisation per backward, where the forward it replaces cost a whole
run). The FFI path's backward finds the graph by where its token was written
instead (the program run, the device, the buffer's address) and checks the token
on the stream; it reads the token back only where that finds nothing (a pullback
run by another program than its forward, for example).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

GRAPH_CAP = 32  # live graphs per compiled call: 4 x 8 devices of one process; evicting one costs a re-run
TOKEN_SHAPE = (2,)  # (salt, serial), int32: valid with x64 off
TOKEN_DTYPE = np.int32
_SERIAL_MASK = 0x7FFFFFFF


class GraphTable:
    """The kept torch graphs of one compiled call, keyed by token; thread-safe (devices call concurrently).

    Args:
        cap: the most entries kept; a `keep` past it evicts the oldest.
    """

    def __init__(self, cap: int = GRAPH_CAP) -> None:
        self.cap = int(cap)
        self.salt = secrets.randbits(31)  # tells this table's tokens from any other's
        self._serials = itertools.count(1)
        self._entries: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.token_reads = 0  # backwards that named their graph by the token's value

    def keep(self, graph: Any) -> tuple[int, int]:
        """Store `graph`; returns its token. Evicts the oldest entries beyond the cap."""
        evicted = []
        with self._lock:
            serial = next(self._serials) & _SERIAL_MASK
            self._entries[serial] = graph
            while len(self._entries) > self.cap:
                evicted.append(self._entries.popitem(last=False))
        del evicted  # graphs are freed outside the lock
        return self.salt, serial

    def take(self, token: tuple[int, int]) -> Any | None:
        """The entry of `token`, removed from the table, or None when it is not (or no longer) here."""
        salt, serial = token
        with self._lock:
            self.token_reads += 1
            return self._entries.pop(serial, None) if salt == self.salt else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclasses.dataclass(frozen=True)
class GradCalls:
    """A differentiated forward that keeps its torch graph, the backward that takes it, and their counts
    (on either call path, for one set of differentiated arrays)."""

    forward: Callable[..., Any]  # (*arrays) -> (*results, token)
    backward: Callable[..., Any]  # (*saved arrays, token, *cotangents) -> gradients of the differentiated arrays
    kept: Callable[[], int]  # graphs held for backwards to come
    token_reads: Callable[[], int]  # backwards that read their token back from the device
