"""A TCP connection from every rank to rank 0, so a process that dies is named at once.

The watchdog's heartbeats (`torch/watchdog.py`) tell a dead rank from a busy one only
after its limit, and JAX aborts the survivors of a dead rank 0 (whose process runs
JAX's coordination service) about 0.3 s after it dies, naming no rank. A socket
closed by the operating system says more, sooner: when a rank's process ends, its end
of the connection closes. Rank 0 listens on a free port (published in JAX's
key-value store with a random token); every other rank connects and says the token
and its rank (a connection without the token is dropped). A rank that leaves
normally says goodbye first (`bye()`), one that ends through the watchdog has left
a fault record; any other end of a connection is a process that died (killed,
crashed, out of memory), and `on_lost(rank)` is called on the rank that sees it:
rank 0 for any other rank, the others for rank 0.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

_BYE = b"B"
_CONNECT_S = 30.0
_TOKEN = 16  # bytes
_HELLO = _TOKEN + 4  # the token, then the rank


class Lifeline:
    """This rank's end of the connections (see the module docstring).

    Args:
        rank, world: this process's rank and the number of processes.
        host: where the others reach rank 0 (the JAX coordinator's host).
        publish, fetch: `publish("port token")` on rank 0 makes them known; `fetch()` on the others waits for
            that text (None: never published).
        on_lost: called, on the lifeline's thread, with the rank whose process ended without goodbye.
    """

    def __init__(self, rank: int, world: int, host: str, publish: Callable[[str], None],
                 fetch: Callable[[], str | None], on_lost: Callable[[int], None]) -> None:
        self.rank, self.world, self.host = rank, world, host
        self._publish, self._fetch, self._on_lost = publish, fetch, on_lost
        self._closing = False
        self._token = secrets.token_bytes(_TOKEN) if rank == 0 else b""
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="jaxbridge-lifeline", daemon=True)

    def start(self) -> Lifeline:
        if self.rank == 0:
            self._sock = _listener()
            self._publish(f"{self._sock.getsockname()[1]} {self._token.hex()}")
        self._thread.start()
        return self

    def bye(self) -> None:
        """This rank leaves normally: its connection's end is no fault."""
        self._closing = True
        if self.rank != 0 and self._sock is not None:
            try:
                self._sock.sendall(_BYE)
            except OSError:
                pass

    def _run(self) -> None:
        try:
            self._serve() if self.rank == 0 else self._hold()
        except OSError:
            pass  # the lifeline only adds to the watchdog, which still runs

    def _hold(self) -> None:
        """Connect to rank 0 and wait: its end of the connection closing is rank 0's process ending."""
        published, deadline = self._fetch(), time.monotonic() + _CONNECT_S
        if published is None:
            return
        port, token = published.split()
        while True:
            try:
                self._sock = socket.create_connection((self.host, int(port)), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.2)
        self._sock.settimeout(None)
        self._sock.sendall(bytes.fromhex(token) + struct.pack("!i", self.rank))
        while True:
            try:
                data = self._sock.recv(64)
            except OSError:
                data = b""
            if not data:
                if not self._closing:
                    self._on_lost(0)
                return

    def _serve(self) -> None:
        """Accept every other rank's connection; a connection that ends without goodbye is a rank that died."""
        listener, peers, clean = self._sock, {}, set()
        pending: dict[socket.socket, bytes] = {}
        while True:
            ready, _, _ = select.select([listener, *pending, *peers], [], [], 1.0)
            for s in ready:
                if s is listener:
                    conn, _ = listener.accept()
                    pending[conn] = b""
                elif s in pending:
                    try:
                        data = s.recv(_HELLO - len(pending[s]))
                    except OSError:
                        data = b""
                    got = pending[s] + data
                    if not data or got[:_TOKEN] != self._token[:len(got)]:  # closed, or not one of ours
                        del pending[s]
                        s.close()
                    elif len(got) == _HELLO:
                        del pending[s]
                        peers[s] = struct.unpack("!i", got[_TOKEN:])[0]
                    else:
                        pending[s] = got
                else:
                    try:
                        data = s.recv(64)
                    except OSError:
                        data = b""
                    r = peers[s]
                    if _BYE in data:
                        clean.add(r)
                    if not data:
                        del peers[s]
                        s.close()
                        if r not in clean:
                            self._on_lost(r)


def _listener() -> socket.socket:
    """A listening TCP socket on a free port of every local address (IPv6 dual-stack where there is IPv6)."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
    except OSError:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("0.0.0.0", 0))
    s.listen(128)
    return s
