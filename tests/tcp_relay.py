"""A TCP relay for the tests that put a faulty network between two real processes."""

from __future__ import annotations

import socket
import threading

from common.config import split_host_port


class TcpRelay:
    """Relays each TCP connection made to :attr:`address` (a free loopback port) to ``upstream``,
    with the faults a test asks for:

    - a gate: while :attr:`opened` is clear, a new connection waits before it is relayed;
    - ``cut_after_bytes``: on each of the first ``cut_connections`` connections, once that many bytes
      have gone from the client upstream, both sides are closed at once (a request cut off midway);
      with ``lose_replies``, the client's bytes go on but upstream's are dropped, and both sides are
      closed :attr:`REPLY_HOLD_S` later (a reply lost on its way).

    :attr:`connections` counts the connections relayed, :attr:`cut` those cut."""

    REPLY_HOLD_S = 2.0

    def __init__(self, upstream: str, cut_after_bytes: int | None = None, cut_connections: int = 1,
                 lose_replies: bool = False) -> None:
        self.upstream = split_host_port(upstream)
        self.cut_after_bytes = cut_after_bytes
        self.cut_connections = cut_connections
        self.lose_replies = lose_replies
        self.opened = threading.Event()
        self.opened.set()
        self.connections = 0
        self.cut = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        self.opened.wait()
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        self.connections += 1
        limit = self.cut_after_bytes if self.connections <= self.cut_connections else None
        passed = threading.Event()          # ``limit`` bytes went upstream on this connection
        threading.Thread(target=self._requests, args=(client, upstream, limit, passed), daemon=True).start()
        threading.Thread(target=self._replies, args=(upstream, client, passed), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, limit: int | None,
                  passed: threading.Event) -> None:
        sent = 0
        try:
            while data := client.recv(65536):
                if limit is not None and sent + len(data) >= limit and not passed.is_set():
                    passed.set()
                    self.cut += 1
                    if not self.lose_replies:
                        break
                    threading.Timer(self.REPLY_HOLD_S, _close, (client, upstream)).start()
                upstream.sendall(data)
                sent += len(data)
        except OSError:
            pass
        _close(client, upstream)

    def _replies(self, upstream: socket.socket, client: socket.socket, passed: threading.Event) -> None:
        try:
            while data := upstream.recv(65536):
                if not (self.lose_replies and passed.is_set()):
                    client.sendall(data)
        except OSError:
            pass
        _close(upstream, client)

    def close(self) -> None:
        """Stop accepting; a connection waiting at the gate goes through."""
        self.opened.set()
        self.listener.close()


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
