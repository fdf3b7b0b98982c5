"""Peers that never finish an answer, and the kernel's count of this process's memory:
for the tests that a reader bounds what it reads (time and bytes)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["EndlessServer", "rss_bytes", "send_endless"]

MODES = ("flood", "drip")


def send_endless(conn: socket.socket, mode: str, sent: Callable[[int], None]) -> None:
    """Answer on ``conn`` with a body that never ends, until the reader hangs up:
    ``flood`` streams 1 MiB chunks as fast as they are read, ``drip`` sends one byte of a
    long body every 0.1 s. ``sent`` is told each chunk's size."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    try:
        if mode == "flood":
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            while True:
                conn.sendall(chunk)
                sent(1 << 20)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while True:
            conn.sendall(b" ")
            sent(1)
            time.sleep(0.1)
    except OSError:
        pass


class EndlessServer:
    """A TCP server on 127.0.0.1 that reads a request and answers it with
    :func:`send_endless`; counts the connections and the bytes sent."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.sent = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
            except OSError:
                return
            send_endless(conn, self.mode, self._count)

    def _count(self, n: int) -> None:
        self.sent += n

    def close(self) -> None:
        try:  # wakes the accept() of the server thread (a close alone leaves it blocked)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def rss_bytes() -> int:
    """This process's resident memory, as the kernel counts it (``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")
