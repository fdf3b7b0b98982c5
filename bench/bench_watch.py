"""Sidecar: what open event streams (``GET /instances?watch=1``, dashboards) cost the
operator's writes on a large sidecar.

Run: ``python bench/bench_watch.py [--instances 1000] [--streams 0,10,50] [--puts 100]``
(CPU; about a minute).

``kvsidecar serve`` runs as its own process on a fresh SQLite file with
``--instances`` desired limits stored. For each count in ``--streams``, that many
event streams are opened and read to the end by threads of this process (as
dashboards would read them), then ``--puts`` sequential ``PUT
/instances/{id}/limit`` are timed, 20 ms apart; each changes the list, so every
stream gets an event after each. The figure is the PUT's p50/p99 and its ratio to
the run with no stream, all in one run on one machine.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx
from _sidecar_process import SidecarProcess


def _open_streams(port: int, count: int) -> list[socket.socket]:
    """``count`` event streams, each drained by a thread until its socket closes."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /instances?watch=1 HTTP/1.1\r\nHost: bench\r\n\r\n")
        socks.append(sock)

        def drain(sock: socket.socket = sock) -> None:
            try:
                while sock.recv(1 << 20):
                    pass
            except OSError:
                pass

        threading.Thread(target=drain, daemon=True).start()
    return socks


def _put_latencies(client: httpx.Client, puts: int, deadline_s: float) -> list[float]:
    latencies = []
    end = time.monotonic() + deadline_s
    for n in range(puts):
        start = time.perf_counter()
        client.put(f"/instances/i{n}/limit", json={"limit": f"{n % 64 + 2}G"})
        latencies.append(time.perf_counter() - start)
        if time.monotonic() > end:
            break
        time.sleep(0.02)
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--streams", default="0,10,50")
    parser.add_argument("--puts", type=int, default=100)
    parser.add_argument("--deadline-s", type=float, default=120.0, help="per stream count")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",")]
    sidecar = SidecarProcess({"KVSIDECAR_MAX_WAIT_S": "300"}, keep_log=False)
    port = int(sidecar.url.rsplit(":", 1)[1])
    try:
        with httpx.Client(base_url=sidecar.url, timeout=300) as client:
            for n in range(args.instances):
                client.put(f"/instances/i{n}/limit", json={"limit": "1G"})
            base: float | None = None
            print(f"{args.instances} instances; PUT latency with event streams open")
            for count in counts:
                socks = _open_streams(port, count)
                time.sleep(1.0)
                lat = _put_latencies(client, args.puts, args.deadline_s)
                for sock in socks:
                    sock.close()
                time.sleep(0.5)
                p50 = statistics.median(lat)
                p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
                base = p50 if base is None else base
                note = "" if len(lat) == args.puts else f" (only {len(lat)} PUTs in time)"
                print(
                    f"  streams {count:4d}: p50 {p50 * 1e3:7.1f} ms  p99 {p99 * 1e3:7.1f} ms"
                    f"  p50 / no streams {p50 / base:6.2f}x{note}"
                )
    finally:
        sidecar.stop()


if __name__ == "__main__":
    main()
