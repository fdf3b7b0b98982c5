"""kvsidecar's adapter for SGLang 0.5.23 (docs/sglang.md, docs/engine-hooks.md 2).

* :class:`ElasticTokenAllocator` -- SGLang's paged token-to-KV allocator over
  the core's :class:`allocator.BlockAllocator` (SGLang page = block).
* :class:`RadixTreeReclaimer` / :class:`UnifiedTreeReclaimer` -- page-aware
  eviction from ``RadixCache`` / ``UnifiedRadixCache`` (Rust tree core).
* :class:`SglangRuntime` -- one scheduler's runtime: coordinator pass before
  admission and on idle, leak-check totals kept truthful.
* :func:`install` -- version guard + the patch table (``_patches.PATCHES``);
  ``python -m engine_ext.sglang.launch_server`` runs it, then SGLang's server;
  :func:`run_scheduler_process` is the scheduler processes' entry (install,
  then SGLang's own ``run_scheduler_process``).
* :func:`prepare_cpu_imports` -- lets SGLang's memory modules import on a
  CPU-only machine (a torchvision stand-in); :func:`install` calls it.

Importing this package imports SGLang's allocator module but patches
nothing; :func:`install` does, once.
"""

from ._allocator import ElasticTokenAllocator
from ._cpu_imports import prepare_cpu_imports
from ._install import install, installed_patches, run_scheduler_process, uninstall
from ._kv_memory import KVGeometry, KVReservation, reserve_kv
from ._reclaimers import RadixTreeReclaimer, UnifiedTreeReclaimer, make_reclaimer
from ._runtime import SglangRuntime, runtime_of
from ._version import SUPPORTED, check_version, installed_sglang_version

__all__ = [
    "SUPPORTED",
    "ElasticTokenAllocator",
    "KVGeometry",
    "KVReservation",
    "RadixTreeReclaimer",
    "SglangRuntime",
    "UnifiedTreeReclaimer",
    "check_version",
    "install",
    "installed_patches",
    "installed_sglang_version",
    "make_reclaimer",
    "prepare_cpu_imports",
    "reserve_kv",
    "run_scheduler_process",
    "runtime_of",
    "uninstall",
]
