"""One TP/PP rank process: its own view of the KV memfd, driven by the rank channel.

A rank connects to the scheduler's rank socket, says hello, receives the
set-up (the owner's ``PageLayout``, the memfd path, its TP/PP coordinates and
the KV slot geometry), attaches the memfd into a reservation of its own
(``HostBackend.attach``) and then applies, in order, what the scheduler sends:

* ``map`` -- make pages readable/writable in its view;
* ``step`` -- the step's KV writes (its TP word, in the regions of its PP
  stage); ``finished_step`` becomes that step;
* ``unmap`` -- tagged with the step the pages were freed after; refused (the
  rank stops) if that step has not finished here, which the in-order channel
  makes impossible unless the scheduler is buggy;
* ``probe`` -- nothing, just an ack;
* ``stop`` -- release the view and exit.

The end of the stream also stops the rank, cleanly (status 0), even in the
middle of an op: the engine closed or died while sending it (``close()`` does
not wait on a stopped rank's full buffer); the cut op is not applied.

Every op is acknowledged *after* it was applied in this process's own
address space (every ``mprotect`` of the view returned), with the bytes this
rank maps counted from those calls. Ops that arrive together (one ``recv``)
are applied in order and their acks leave together (one ``send``). ``setup`` and ``probe`` re-measure the
view from ``/proc/self/maps`` and stop the rank if the kernel disagrees with
the count (parsing the maps per ack cost ~60% of a one-page round trip). ``barrier_delay_s`` delays the ack of
each ``unmap`` (a slow rank, for tests and drills). The rank exits when the
socket closes (the engine died), on SIGTERM and on SIGINT.

Thread: one thread, the process's main thread.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from allocator import HostBackend, PageLayout

from ._procmaps import view_mapped_bytes
from ._wire import (
    Ack,
    FrameReader,
    RankChannelError,
    StreamCutError,
    decode_op,
    encode_ack,
    send_message,
)

__all__ = ["RankWorker", "SlotGeometry"]


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where a token's KV slot lives inside a region (block-major, slot-minor)."""

    block_bytes: int  # bytes of one block in one region
    slot_bytes: int  # bytes of one token slot in one region


class RankWorker:
    """The rank side of the channel. Owns its attached backend and its socket."""

    def __init__(self, socket_path: str, rank: int, *, barrier_delay_s: float = 0.0) -> None:
        self.socket_path = socket_path
        self.rank = rank
        self.barrier_delay_s = barrier_delay_s
        self.finished_step = -1
        self.backend: HostBackend | None = None
        self._sock: socket.socket | None = None
        self._geometry: SlotGeometry | None = None
        self._regions: list[int] = []  # regions this rank writes (its PP stage)
        self._word = 0  # the 4-byte word of each slot this rank writes (its TP index)

    def run(self) -> int:
        """Serve until ``stop`` or end of stream; returns the process exit code."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        try:
            sock.connect(self.socket_path)
            send_message(sock, {"hello": self.rank, "pid": os.getpid()})
            reader = FrameReader(sock, decode_op)
            while True:
                messages = reader.read()
                if messages is None:
                    return 0
                acks: list[bytes] = []
                for message in messages:  # what one recv brought: acked in one send
                    op = message["op"]
                    if op == "stop":
                        return 0
                    self._apply(message)
                    measure = op == "setup" or op == "probe"
                    acks.append(encode_ack(self._ack(message["seq"], measure=measure)))
                sock.sendall(acks[0] if len(acks) == 1 else b"".join(acks))
        except StreamCutError:  # the engine closed (or died) with an op half sent to us:
            # its end, like any end of stream; the cut op is not applied, nothing to ack
            print(
                f"kvsidecar rank {self.rank}: the engine ended the stream in the middle of an "
                "op (it closed or died while sending); the op was not applied, exiting",
                flush=True,
            )
            return 0
        except (OSError, RankChannelError) as exc:
            print(f"kvsidecar rank {self.rank}: channel closed: {exc}", flush=True)
            return 1
        finally:
            sock.close()
            if self.backend is not None:
                self.backend.release()

    # -- ops -------------------------------------------------------------------------
    def _apply(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "map":
            self._require_backend().map_many(message["pages"])
        elif op == "unmap":
            after = int(message["after_step"])
            if after > self.finished_step:
                raise RankChannelError(
                    f"unmap after step {after} but this rank finished only "
                    f"step {self.finished_step}: the scheduler broke the order"
                )
            if self.barrier_delay_s > 0:
                time.sleep(self.barrier_delay_s)
            self._require_backend().unmap_many(message["pages"])
        elif op == "step":
            self._write(message["blocks"], message["offsets"], message["values"])
            self.finished_step = int(message["step"])
        elif op == "setup":
            self._setup(message)
        elif op != "probe":
            raise RankChannelError(f"unknown rank op {op!r}")

    def _setup(self, message: dict[str, Any]) -> None:
        layout = PageLayout(**message["layout"])
        self.backend = HostBackend.attach(layout, message["fd_path"])
        self._geometry = SlotGeometry(**message["geometry"])
        tp, pp = int(message["tp"]), int(message["pp"])
        tp_rank, pp_rank = self.rank % tp, self.rank // tp
        per_stage = -(-layout.num_regions // pp)
        self._regions = list(
            range(pp_rank * per_stage, min(layout.num_regions, (pp_rank + 1) * per_stage))
        )
        self._word = tp_rank
        if (tp_rank + 1) * 4 > self._geometry.slot_bytes:
            raise RankChannelError(
                f"a slot of {self._geometry.slot_bytes} bytes has no word for TP rank {tp_rank}"
            )

    def _write(self, blocks: list[int], offsets: list[int], values: list[int]) -> None:
        backend, geometry = self._require_backend(), self._geometry
        assert geometry is not None
        if blocks:
            self._check_slots(backend, geometry, blocks, offsets)
        base = backend.base_address + self._word * 4
        region_bytes = backend.layout.region_bytes
        for region in self._regions:
            region_base = base + region * region_bytes
            for block, offset, value in zip(blocks, offsets, values, strict=True):
                address = region_base + block * geometry.block_bytes + offset * geometry.slot_bytes
                ctypes.c_int32.from_address(address).value = value

    @staticmethod
    def _check_slots(
        backend: HostBackend, geometry: SlotGeometry, blocks: list[int], offsets: list[int]
    ) -> None:
        """Every slot of a step lies in its block, in the region, in pages this rank maps.

        A bad index would write another block's KV (another request's), another
        stage's layer, or fault on a page this rank does not map: refused (the rank
        stops with the reason) instead of written or killed by SIGSEGV."""
        layout = backend.layout
        slots = geometry.block_bytes // geometry.slot_bytes
        if min(offsets) < 0 or max(offsets) >= slots:
            raise RankChannelError(
                f"a step writes slot {min(offsets)}..{max(offsets)} of blocks of {slots} slots"
            )
        per_region = layout.region_bytes // geometry.block_bytes
        if min(blocks) < 0 or max(blocks) >= per_region:
            raise RankChannelError(
                f"a step writes block {min(blocks)}..{max(blocks)} of {per_region} per region"
            )
        block_bytes, page_bytes = geometry.block_bytes, layout.page_bytes
        for block in set(blocks):
            first = block * block_bytes // page_bytes
            last = ((block + 1) * block_bytes - 1) // page_bytes
            for page in range(first, last + 1):
                if not backend.is_mapped(page):
                    raise RankChannelError(
                        f"a step writes block {block} in page {page}, which this rank does not map"
                    )

    def _ack(self, seq: int, *, measure: bool = False) -> Ack:
        backend = self.backend
        pages = mapped = 0
        if backend is not None:
            pages = backend.num_mapped_pages
            mapped = pages * backend.layout.bundle_bytes
            if measure:
                seen = view_mapped_bytes("self", backend.base_address, backend.layout.total_bytes)
                if seen != mapped:
                    raise RankChannelError(
                        f"/proc/self/maps shows {seen} bytes of the KV view readable but "
                        f"{pages} pages ({mapped} bytes) were mapped here: the view is corrupt"
                    )
        return Ack(seq, self.finished_step, mapped, pages)

    def _require_backend(self) -> HostBackend:
        if self.backend is None:
            raise RankChannelError("an op arrived before the set-up")
        return self.backend
