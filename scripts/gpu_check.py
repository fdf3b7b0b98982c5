"""CudaBackend for real on one GPU: the checks behind ``scripts/gpu-check.sh``.

Needs Python, torch with CUDA and cuda-bindings; no vLLM, no SGLang, no
network. ``--fake-driver PATH`` loads the stand-in driver (tests/fakecuda)
first: the driver-level rows then run on host memory and the rows that need
kernels are reported SKIP with the reason (that is how CI runs it).

Prints one row per check (PASS / FAIL / SKIP and what was measured); the exit
status is 1 if any row failed, 2 if CudaBackend cannot be reserved at all.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from allocator import CudaBackend, FencedBackend, PageLayout, torch_unmap_fence

MiB = 1 << 20
PAGE = 2 * MiB
KVCACHED_A100_US = {"map": 1.45, "unmap": 25.6}  # kvcached's published A100 figures, per page


class Skip(Exception):
    """The check cannot run here (the message says why)."""


@dataclass
class Row:
    name: str
    status: str
    detail: str


class Checks:
    """Runs each check on a fresh backend; collects rows."""

    def __init__(self, device: int, fake: bool, iterations: int) -> None:
        self.device, self.fake, self.iterations = device, fake, iterations
        self.rows: list[Row] = []
        self.torch: Any = None
        if not fake:
            try:
                import torch

                if torch.cuda.is_available():
                    self.torch = torch
            except ImportError:
                pass

    # -------------------------------------------------------------- plumbing
    def run(self, name: str, check: Callable[[], str]) -> None:
        try:
            detail = check()
            self.rows.append(Row(name, "PASS", detail))
        except Skip as exc:
            self.rows.append(Row(name, "SKIP", str(exc)))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a FAIL row
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self.rows.append(Row(name, "FAIL", last[:300]))

    def need_gpu(self) -> Any:
        if self.fake:
            raise Skip("GPU only: the stand-in driver runs no kernels")
        if self.torch is None:
            raise Skip("GPU only: torch has no CUDA device here")
        return self.torch

    def backend(self, pages: int, regions: int, **kw: Any) -> CudaBackend:
        return CudaBackend.reserve(PageLayout(PAGE, pages, regions), device=self.device, **kw)

    def fill(self, backend: CudaBackend, region: int, page: int, value: int) -> None:
        address = backend.base_address + backend.layout.page_offset(region, page)
        if self.torch is not None:
            view = backend.tensor(region)[page * PAGE : (page + 1) * PAGE]
            view.fill_(value)
        else:  # the stand-in's device memory is host memory
            ctypes.memset(address, value, PAGE)

    def page_is(self, backend: CudaBackend, region: int, page: int, value: int) -> bool:
        """Whether every byte of ``page`` in ``region`` equals ``value``."""
        if self.torch is not None:
            view = backend.tensor(region)[page * PAGE : (page + 1) * PAGE]
            return bool((view == value).all().item())
        address = backend.base_address + backend.layout.page_offset(region, page)
        return ctypes.string_at(address, PAGE) == bytes([value]) * PAGE

    # -------------------------------------------------------------- checks
    def free_memory_follows_pages(self) -> str:
        pages, regions = 64, 2
        with self.backend(pages, regions, spare_handles=0) as backend:
            bundle = backend.layout.bundle_bytes
            before = backend.device_free_bytes()
            backend.map_many(range(pages))
            used = before - backend.device_free_bytes()
            backend.unmap_many(range(pages // 2))
            half = before - backend.device_free_bytes()
            backend.unmap_many(range(pages // 2, pages))
            after = before - backend.device_free_bytes()
        want = pages * bundle
        ok = used >= 0.95 * want and abs(half - want / 2) <= 0.05 * want and after <= 0.05 * want
        detail = (
            f"mapped {want // MiB} MiB: free fell {used // MiB} MiB; half unmapped: "
            f"{half // MiB} MiB; all unmapped: {after // MiB} MiB"
        )
        if not ok:
            raise AssertionError(detail)
        return detail

    def torch_views_read_write(self) -> str:
        torch = self.need_gpu()
        with self.backend(4, 2) as backend:
            backend.map_many([0, 1])
            view = backend.tensor(1)[: 2 * PAGE]
            view.fill_(3)
            total = int(view.sum(dtype=torch.int64).item())
            floats = view.view(torch.float32)
            floats.copy_(torch.arange(floats.numel(), device=view.device, dtype=torch.float32))
            last = float(floats[-1].item())
            del view, floats
            torch.cuda.synchronize()
        if total != 3 * 2 * PAGE or last != 2 * PAGE / 4 - 1:
            raise AssertionError(f"read back sum={total} last={last}")
        return "uint8 fill/sum and float32 copy on a region view read back exactly"

    def data_survives_unmapping(self) -> str:
        pages, regions = 16, 3
        with self.backend(pages, regions) as backend:
            backend.map_many(range(pages))
            for region in range(regions):
                for page in range(pages):
                    self.fill(backend, region, page, 1 + (page * 7 + region) % 250)
            backend.unmap_many([p for p in range(pages) if p % 2])
            backend.map_many([p for p in range(pages) if p % 4 == 1])  # reused handles
            bad = [
                (r, p)
                for r in range(regions)
                for p in range(0, pages, 2)
                if not self.page_is(backend, r, p, 1 + (p * 7 + r) % 250)
            ]
        if bad:
            raise AssertionError(f"pages changed after other pages' unmapping: {bad[:5]}")
        return f"{pages // 2} pages x {regions} regions intact after unmap/remap of the others"

    def _kv(self, backend: CudaBackend, torch: Any, tokens: int, heads: int, dim: int) -> Any:
        """[2 (K, V), blocks, tokens, heads, dim] fp16 over regions 0 (K) and 1 (V)."""
        block_bytes = tokens * heads * dim * 2
        blocks = backend.layout.region_bytes // block_bytes
        views = [
            backend.tensor(r).view(torch.float16).view(blocks, tokens, heads, dim) for r in (0, 1)
        ]
        return views, PAGE // block_bytes

    def attention_reads_through_block_table(self) -> str:
        torch = self.need_gpu()
        tokens, heads, dim = 16, 8, 128
        with self.backend(16, 2) as backend:
            backend.map_many(range(16))
            (k, v), per_page = self._kv(backend, torch, tokens, heads, dim)
            k.normal_()
            v.normal_()
            table = torch.tensor(
                [b for p in (1, 4, 9) for b in range(p * per_page, (p + 1) * per_page, 3)],
                device=k.device,
            )
            q = torch.randn(heads, dim, device=k.device, dtype=torch.float16)

            def attend(k_cache: Any, v_cache: Any) -> Any:
                keys = k_cache[table].reshape(-1, heads, dim).transpose(0, 1)  # [H, T, D]
                vals = v_cache[table].reshape(-1, heads, dim).transpose(0, 1)
                weights = torch.softmax(
                    (keys @ q.unsqueeze(-1)).squeeze(-1).float() / dim**0.5, dim=-1
                )
                return (weights.unsqueeze(1) @ vals.float()).squeeze(1)

            want = attend(k, v)
            torch.cuda.synchronize()
            backend.unmap_many([p for p in range(16) if p not in (1, 4, 9)])
            got = attend(k, v)
            torch.cuda.synchronize()
            err = float((got - want).abs().max().item())
            del k, v
        if err > 1e-4:  # same kernels on the same inputs: identical in practice
            raise AssertionError(f"attention output changed by {err} after unmapping")
        return f"gather+matmul over {table.numel()} blocks identical with 13 of 16 pages unmapped"

    def graph_replays_after_unmap(self) -> str:
        torch = self.need_gpu()
        with self.backend(8, 2) as backend:
            backend.map_many(range(8))
            (k, _v), per_page = self._kv(backend, torch, 16, 8, 128)
            k.fill_(1)
            blocks = torch.arange(2 * per_page, 3 * per_page, device=k.device)  # page 2 only
            out = torch.zeros((), device=k.device, dtype=torch.float32)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out.copy_(k[blocks].float().sum())  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(k[blocks].float().sum())
            backend.unmap_many([p for p in range(8) if p != 2])
            results = []
            for _ in range(5):
                k[blocks] += 1
                graph.replay()
                torch.cuda.synchronize()
                results.append(float(out.item()))
            backend.map_many([0, 7])
            graph.replay()
            torch.cuda.synchronize()
            del k, _v
        per = per_page * 16 * 8 * 128
        if results != [per * (i + 2) for i in range(5)]:
            raise AssertionError(f"graph results {results}, want multiples of {per}")
        return "5 replays correct after 7 of 8 pages unmapped, and after remapping 2"

    def unmap_under_queued_kernels(self) -> str:
        torch = self.need_gpu()
        with self.backend(8, 2) as backend:
            fence = torch_unmap_fence(torch.device("cuda", self.device))
            fenced = FencedBackend(backend, fence)
            fenced.map_many(range(8))
            (k, _v), per_page = self._kv(backend, torch, 16, 8, 128)
            k.fill_(1)
            busy = torch.randn(4096, 4096, device=k.device)
            acc = torch.zeros((), device=k.device)
            for _ in range(20):  # tens of ms of queued work, then the read of page 5
                busy = busy @ busy
                busy /= busy.norm()
            acc += k[5 * per_page : 6 * per_page].float().sum()
            fence.record()
            t0 = time.perf_counter()
            fenced.unmap_many([5, 6])  # must wait for the queued read of page 5
            waited = time.perf_counter() - t0
            torch.cuda.synchronize()
            del k, _v
        want = per_page * 16 * 8 * 128
        if float(acc.item()) != want:
            raise AssertionError(f"read {acc.item()} from page 5, want {want}")
        return f"unmap waited {waited * 1e3:.1f} ms for the queued read (event fence); no fault"

    def latency(self, regions: int, label: str) -> str:
        pages = 8 if self.fake else 64  # the stand-in commits host memory: slow, and shared
        out = []
        for spares in (0, None):
            with self.backend(pages, regions, spare_handles=spares) as backend:
                maps, unmaps = [], []
                for _ in range(self.iterations):
                    for page in range(pages):
                        t0 = time.perf_counter_ns()
                        backend.map(page)
                        maps.append(time.perf_counter_ns() - t0)
                        t0 = time.perf_counter_ns()
                        backend.unmap(page)
                        unmaps.append(time.perf_counter_ns() - t0)
            name = "no spares" if spares == 0 else "spares"
            out.append(
                f"{name}: map {statistics.median(maps) / 1e3:.1f} us, unmap "
                f"{statistics.median(unmaps) / 1e3:.1f} us"
            )
        where = "stand-in driver" if self.fake else "GPU"
        ref = (
            (
                f"; kvcached A100 per page: map {KVCACHED_A100_US['map']} us, unmap "
                f"{KVCACHED_A100_US['unmap']} us"
            )
            if regions == 1
            else ""
        )
        return f"{label} ({where}, median of {len(maps)}) {'; '.join(out)}{ref}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--fake-driver",
        metavar="PATH",
        help="load this stand-in libcuda.so.1 first (CI without a GPU)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="rounds of map+unmap of every page per latency row (default 5 on "
        "a GPU, 1 on the stand-in driver)",
    )
    args = parser.parse_args(argv)
    if args.fake_driver:
        ctypes.CDLL(args.fake_driver, mode=ctypes.RTLD_GLOBAL)
    reason = CudaBackend.unavailable_reason(args.device)
    if reason is not None:
        print(
            f"gpu-check: cannot reserve a CudaBackend on device {args.device}: {reason}",
            file=sys.stderr,
        )
        return 2
    iterations = args.iterations or (1 if args.fake_driver else 5)
    checks = Checks(args.device, bool(args.fake_driver), iterations)
    checks.run("free memory falls and rises with pages", checks.free_memory_follows_pages)
    checks.run("torch views read and write", checks.torch_views_read_write)
    checks.run("data survives other pages' unmapping", checks.data_survives_unmapping)
    checks.run(
        "attention via block table, others unmapped", checks.attention_reads_through_block_table
    )
    checks.run("CUDA graph replays after unmapping", checks.graph_replays_after_unmap)
    checks.run("unmap under queued kernels (fence)", checks.unmap_under_queued_kernels)
    checks.run("map/unmap latency per 2 MiB page", lambda: checks.latency(1, "1 region"))
    checks.run("map/unmap latency per 36-layer bundle", lambda: checks.latency(36, "36 regions"))
    width = max(len(row.name) for row in checks.rows)
    print(f"{'check':<{width}}  result  detail")
    for row in checks.rows:
        print(f"{row.name:<{width}}  {row.status:<6}  {row.detail}")
    failed = [row for row in checks.rows if row.status == "FAIL"]
    print(
        f"gpu-check: {len(checks.rows) - len(failed)} of {len(checks.rows)} rows without "
        f"failure ({sum(r.status == 'SKIP' for r in checks.rows)} skipped)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
