"""A small engine over the real core pieces and real rank processes (test helper).

Real: ``HostBackend`` memfd, ``RankGroup`` + rank processes (``python -m
engine_ext.ranks``), ``RankedBackend``, ``PageAllocator``/``BlockAllocator``,
``ElasticInstance`` (mailbox, coordinator, control socket) with the
``RankChannelBarrier``. Toy: the prefix cache (the shared ``ToyPrefixCache``,
full blocks keyed by their whole prefix)
and the "model": every scheduled token is written by the *ranks* into its KV
slot (TP rank t writes word t, PP stage p writes its regions), and a sampled
token is a digest of the KV read back from the scheduler's own view, so a
rank that skipped a write or a page that lost its data changes the output.

Thread: the test thread is the engine thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
from engine_ext import ElasticInstance, EngineBinding, EngineSettings
from engine_ext.cpu_harness import ToyPrefixCache
from engine_ext.ranks import RankChannelBarrier, RankedBackend, RankGroup, memfd_view

BLOCK_SIZE = 16  # tokens per block
SLOT_BYTES = 64  # bytes of one token slot in one region
BLOCK_BYTES = BLOCK_SIZE * SLOT_BYTES
LAYOUT = PageLayout(page_bytes=4096, num_pages=24, num_regions=4)
BLOCKS_PER_PAGE = LAYOUT.page_bytes // BLOCK_BYTES


@dataclass
class Request:
    tokens: list[int]
    prompt_len: int
    table: list[int] = field(default_factory=list)
    written: int = 0  # tokens whose KV the ranks wrote


class ToyEngine:
    """One instance: scheduler (this process) + ``tp * pp`` rank processes."""

    def __init__(
        self,
        tmp: Path,
        tp: int,
        pp: int,
        *,
        delays: dict[int, float] | None = None,
        name: str = "kvsidecar-test-ranks",
    ) -> None:
        self.tp, self.pp, self.name = tp, pp, name
        owner = HostBackend.reserve(LAYOUT, name=name)
        group = RankGroup.spawn(str(tmp / "ranks.sock"), tp * pp, barrier_delay_s=delays)
        self.group = group
        self.backend = RankedBackend.start(
            owner, group, tp=tp, pp=pp, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES, timeout_s=30
        )
        self.pages = PageAllocator(self.backend)
        self.blocks = BlockAllocator(self.pages, BLOCKS_PER_PAGE)
        self.cache = ToyPrefixCache(self.blocks)
        self.woken = threading.Event()
        settings = EngineSettings(runtime_dir=tmp / "run", instance_id=f"toy-{tp}x{pp}")
        self.instance = ElasticInstance(
            settings,
            EngineBinding(
                engine="toy",
                engine_version="0",
                blocks=self.blocks,
                reclaimers=(self.cache,),
                wake=self.woken.set,
            ),
        )
        self.barrier = RankChannelBarrier(self.backend, wait_s=0.05)
        self.barrier.set_wake(self.woken.set)
        self.instance.coordinator.set_rank_barrier(self.barrier)
        self.instance.start()

    def close(self) -> None:
        self.instance.close()
        self.backend.release()

    # -- requests ---------------------------------------------------------------------
    def admit(self, prompt: list[int], *, make_room: bool = False) -> Request | None:
        """Allocate the prompt's blocks (prefix hits first) and prefill; None if it does not fit
        (``make_room``: after evicting cached blocks oldest first, as an engine's cache does)."""
        self.instance.step()
        req = Request(tokens=list(prompt), prompt_len=len(prompt))
        hits = 0
        for i in range(len(prompt) // BLOCK_SIZE):
            block = self.cache.lookup(tuple(prompt[: (i + 1) * BLOCK_SIZE]))
            if block is None:
                break
            req.table.append(block)
            hits += 1
        needed = -(-len(prompt) // BLOCK_SIZE) - hits
        for block in req.table:  # hits first: making room must not evict them
            self.cache.acquire(block)
        fresh = self.cache.allocate(needed, make_room=make_room) if needed else []
        if fresh is None:
            self.cache.release(req.table)  # the hits are evictable again
            return None
        req.table.extend(fresh)
        req.written = hits * BLOCK_SIZE
        self._write(req)
        return req

    def decode(self, req: Request, num_tokens: int) -> None:
        """Sample ``num_tokens`` tokens, each from the KV read back, writing each one."""
        for _ in range(num_tokens):
            req.tokens.append(self._sample(req))
            if len(req.tokens) > len(req.table) * BLOCK_SIZE:
                self.instance.step()
                block = self.cache.allocate(1, make_room=True)
                if block is None:  # a running request: above the target, as the pools serve it
                    block = self.blocks.alloc_above_target(1)
                    assert block is not None, "decode ran out of blocks"
                    self.cache.acquire(block[0])  # the request's reference, as allocate() takes
                req.table.extend(block)
            self._write(req)

    def finish(self, req: Request) -> None:
        """Full blocks go to the prefix cache; the partial tail block is freed."""
        for i, block in enumerate(req.table):
            if (i + 1) * BLOCK_SIZE <= req.written:  # full: cached unless its prefix already is
                self.cache.insert(block, tuple(req.tokens[: (i + 1) * BLOCK_SIZE]))
        self.cache.release(req.table)
        req.table = []

    abort = finish

    # -- the "model" ------------------------------------------------------------------
    def _write(self, req: Request) -> None:
        start, stop = req.written, len(req.tokens)
        positions = range(start, stop)
        fields = {
            "blocks": [req.table[p // BLOCK_SIZE] for p in positions],
            "offsets": [p % BLOCK_SIZE for p in positions],
            "values": req.tokens[start:stop],
        }
        self.group.run_step(fields, timeout_s=30)
        req.written = stop

    def read_slot(self, region: int, block: int, offset: int, word: int) -> int:
        address = (
            self.backend.base_address
            + region * LAYOUT.region_bytes
            + block * BLOCK_BYTES
            + offset * SLOT_BYTES
            + word * 4
        )
        return int(ctypes.c_int32.from_address(address).value)

    def _sample(self, req: Request) -> int:
        seen = []
        for position in range(req.written):
            block, offset = req.table[position // BLOCK_SIZE], position % BLOCK_SIZE
            for region in range(LAYOUT.num_regions):
                for word in range(self.tp):
                    seen.append(self.read_slot(region, block, offset, word))
        digest = hashlib.blake2b(repr(seen).encode(), digest_size=4).digest()
        return 3 + int.from_bytes(digest, "little") % 30000

    # -- measurements -----------------------------------------------------------------
    def rank_pages(self, pid: int) -> set[int]:
        """Pages a process maps in EVERY region, from its /proc/<pid>/maps (all-or-none checked)."""
        per_region: list[set[int]] = [set() for _ in range(LAYOUT.num_regions)]
        for offset, length in memfd_view(pid, self.name):
            for byte in range(offset, offset + length, LAYOUT.page_bytes):
                region, rest = divmod(byte, LAYOUT.region_bytes)
                per_region[region].add(rest // LAYOUT.page_bytes)
        first = per_region[0]
        assert all(s == first for s in per_region), f"pid {pid} maps a page in some regions only"
        return first

    def scheduler_pages(self) -> set[int]:
        return {p for p in range(LAYOUT.num_pages) if self.backend.is_mapped(p)}
