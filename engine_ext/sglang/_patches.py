"""The SGLang tables: every symbol kvsidecar wraps, every private member it relies on.

Rows in the format of :mod:`engine_ext._patching`, applied (all checked
first, all or nothing) by :func:`._install.install`. Each wrapper keeps the
real signature (``functools.wraps``), does its part and calls the original.
A factory is ``(original, session) -> replacement``; the :class:`Session` is
the one of the installing process (settings read once, in ``install``). To add
a row: write the factory here and append a ``Patch`` to :data:`PATCHES`.

===========================================================  =================================
target                                                        what the wrapper adds
===========================================================  =================================
``Engine.run_scheduler_process_func`` (parent process)        scheduler processes start through
                                                              :func:`._install.run_scheduler_process`
                                                              (SGLang spawns them: patches made in
                                                              the parent do not reach them)
``KVCacheConfigurator._profile_available_bytes``              the pool is sized for the virtual KV
                                                              capacity (docs/overcommit.md), not
                                                              for the free memory measured now
``MHATokenToKVPool._create_buffers_normal``                   K/V tensors on a kvsidecar reservation
``KVCacheConfigurator._build_token_to_kv_pool_allocator``     :class:`ElasticTokenAllocator`
``Scheduler.__init__``                                        attach the :class:`SglangRuntime` (the
                                                              tree cache exists now); refuse what
                                                              the adapter does not support (before
                                                              and after SGLang's own __init__:
                                                              pdmux, PD role switch, PP,
                                                              disaggregation loops)
``Scheduler.get_next_batch_to_run``                           coordinator pass before admission;
                                                              after it, the state follows the
                                                              pages the batch mapped (no pass)
``Scheduler.process_batch_result``                            record the unmap fence (GPU unmaps
                                                              wait on that event, not a sync);
                                                              after it, the state follows the
                                                              pages its frees unmapped
``Scheduler.on_idle``                                         pass when a limit is pending; leak
                                                              check total synced
``Scheduler._record_scheduler_state_for_paused_engine``       the same idle pass while generation
                                                              is paused (``/pause_generation``
                                                              in_place/retract: the loops skip
                                                              ``get_next_batch_to_run`` and
                                                              ``on_idle`` then)
===========================================================  =================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet

from .. import EngineSettings
from .._errors import EngineExtConfigError
from .._patching import Patch, Touch

__all__ = ["PATCHES", "TOUCHES", "Patch", "Session", "Touch"]

V0_5_23 = SpecifierSet("==0.5.23")


@dataclass(slots=True)
class Session:
    """What the wrappers of one installation share (one per process)."""

    settings: EngineSettings
    engine_version: str
    scheduler_entry: Callable[..., Any]  # what spawned scheduler processes run
    runtimes: list[Any] = field(
        default_factory=list
    )  # SglangRuntimes attached here (closed on uninstall)


# -- wrappers ---------------------------------------------------------------------------


def _wrap_scheduler_process_func(original: Any, session: Session) -> Any:
    return session.scheduler_entry


def _wrap_profile_bytes(original: Any, session: Session) -> Any:
    from ._kv_memory import virtual_kv_bytes

    @functools.wraps(original)
    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
        virtual = virtual_kv_bytes(
            str(self.device),
            int(getattr(self, "gpu_id", 0) or 0),
            session.settings.virtual_kv_bytes,
        )
        if virtual is None:
            return int(original(self, pre_model_load_memory))
        return virtual  # address space only: pages are mapped on demand, up to the limit

    return _profile_available_bytes


def _wrap_create_buffers(original: Any, session: Session) -> Any:
    from ._kv_placement import place_kv_buffers

    @functools.wraps(original)
    def _create_buffers_normal(self: Any) -> None:
        place_kv_buffers(self, session.settings)

    return _create_buffers_normal


def _wrap_build_allocator(original: Any, session: Session) -> Any:
    from ._kv_placement import build_elastic_allocator

    @functools.wraps(original)
    def _build_token_to_kv_pool_allocator(self: Any, **kwargs: Any) -> Any:
        if kwargs.get("token_to_kv_pool_allocator") is not None:
            return original(self, **kwargs)  # a shared allocator handed in (draft worker)
        return build_elastic_allocator(self, kwargs["token_to_kv_pool"], session.settings)

    return _build_token_to_kv_pool_allocator


def _wrap_scheduler_init(original: Any, session: Session) -> Any:
    from ._runtime import SglangRuntime

    @functools.wraps(original)
    def __init__(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> None:
        _refuse_unsupported(server_args)
        original(self, server_args, port_args, *args, **kwargs)
        _refuse_unsupported_loop(self)
        runtime = SglangRuntime.attach(
            self, session.settings, engine_version=session.engine_version, signal_cleanup=True
        )
        session.runtimes.append(runtime)

    return __init__


def _wrap_next_batch(original: Any, session: Session) -> Any:
    from ._runtime import runtime_of

    @functools.wraps(original)
    def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is None:
            return original(self, *args, **kwargs)
        runtime.before_schedule()
        batch = original(self, *args, **kwargs)
        runtime.refresh_state()  # the batch's pages are mapped: the state shows them
        return batch

    return get_next_batch_to_run


def _wrap_process_batch_result(original: Any, session: Session) -> Any:
    from ._runtime import runtime_of

    @functools.wraps(original)
    def process_batch_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is None:
            return original(self, *args, **kwargs)
        runtime.after_batch()  # first: processing the result frees blocks
        result = original(self, *args, **kwargs)
        runtime.refresh_state()  # the frees may have unmapped retired pages
        return result

    return process_batch_result


def _wrap_on_idle(original: Any, session: Session) -> Any:
    """The idle pass before ``original``: ``Scheduler.on_idle``, and the paused-engine
    record, which is all SGLang's loops call per iteration while generation is paused
    (no ``get_next_batch_to_run``, no ``on_idle``, no allocation: the pass is safe there
    and a limit is taken while paused rather than at ``/continue_generation``)."""
    from ._runtime import runtime_of

    @functools.wraps(original)
    def on_idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_of(self)
        if runtime is not None:
            runtime.on_idle()
        return original(self, *args, **kwargs)

    return on_idle


def _refuse_unsupported(server_args: Any) -> None:
    """Fail closed on set-ups the adapter cannot keep consistent."""
    problems = []
    for name in ("tp_size", "pp_size", "dp_size"):
        if int(getattr(server_args, name, 1) or 1) != 1:
            problems.append(f"--{name.replace('_', '-')} > 1 (one scheduler rank only)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        problems.append("--enable-hierarchical-cache")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        problems.append("--disaggregation-mode (its event loops run no kvsidecar pass)")
    problems.extend(_loop_problems(server_args))
    if int(getattr(server_args, "page_size", None) or 1) < 2:
        problems.append("--page-size 1 (pass --page-size 16 or larger)")
    if problems:
        raise EngineExtConfigError(
            "kvsidecar's SGLang adapter does not support: "
            + ", ".join(problems)
            + "; remove these options or start without kvsidecar (KVSIDECAR_ENABLE=0)"
        )


def _loop_problems(flags: Any) -> list[str]:
    """Options that select an event loop where the adapter's hooks never run.

    A limit is taken only in ``get_next_batch_to_run`` and ``on_idle``
    (docs/sglang.md, "Safe points"): ``event_loop_normal``/``_overlap`` call
    both. The pdmux loop never calls ``get_next_batch_to_run`` (a limit would
    be accepted and never applied); the PD role switch runs the
    disaggregation loops.
    """
    problems = []
    if getattr(flags, "enable_pdmux", False):
        problems.append(
            "--enable-pdmux (its loop never calls get_next_batch_to_run, where "
            "kvsidecar applies limits)"
        )
    if getattr(flags, "enable_pd_role_switch", False):
        problems.append("--enable-pd-role-switch (it runs the disaggregation loops)")
    return problems


def _refuse_unsupported_loop(scheduler: Any) -> None:
    """After SGLang chose its flags: fail closed if the loop it will run has no hooks."""
    problems = _loop_problems(scheduler)
    problems.extend(_loop_problems(getattr(scheduler, "server_args", None)))
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if mode not in (None, "null"):
        problems.append("--disaggregation-mode (its event loops run no kvsidecar pass)")
    if problems:
        raise EngineExtConfigError(
            "kvsidecar's SGLang adapter cannot apply limits in the event loop SGLang would "
            "run: " + ", ".join(sorted(set(problems))) + "; remove these options or start "
            "without kvsidecar (KVSIDECAR_ENABLE=0)"
        )


_SCHED = "sglang.srt.managers.scheduler"
_MEM = "sglang.srt.mem_cache"
_COMPONENTS = "sglang.srt.managers.scheduler_components"

#: Every patch, applied in this order by :func:`._install.install`.
PATCHES: tuple[Patch, ...] = (
    Patch(
        "sglang.srt.entrypoints.engine:Engine.run_scheduler_process_func",
        V0_5_23,
        _wrap_scheduler_process_func,
        "SGLang spawns schedulers: they must enter through the adapter to be patched too",
    ),
    Patch(
        f"{_MEM}.kv_cache_configurator:KVCacheConfigurator._profile_available_bytes",
        V0_5_23,
        _wrap_profile_bytes,
        "size the pool for the virtual KV capacity (docs/overcommit.md), not the free memory",
    ),
    Patch(
        f"{_MEM}.memory_pool:MHATokenToKVPool._create_buffers_normal",
        V0_5_23,
        _wrap_create_buffers,
        "K/V tensors on a kvsidecar reservation",
    ),
    Patch(
        f"{_MEM}.kv_cache_configurator:KVCacheConfigurator._build_token_to_kv_pool_allocator",
        V0_5_23,
        _wrap_build_allocator,
        "the scheduler's allocator is ElasticTokenAllocator",
    ),
    Patch(
        f"{_SCHED}:Scheduler.__init__",
        V0_5_23,
        _wrap_scheduler_init,
        "attach the SglangRuntime once the tree cache exists; refuse unsupported set-ups",
    ),
    Patch(
        f"{_SCHED}:Scheduler.get_next_batch_to_run",
        V0_5_23,
        _wrap_next_batch,
        "a coordinator pass before admission; the state refreshed after it (pages mapped)",
    ),
    Patch(
        f"{_SCHED}:Scheduler.process_batch_result",
        V0_5_23,
        _wrap_process_batch_result,
        "record the unmap fence after each batch: GPU unmaps wait on that event, not on a "
        "device-wide sync (allocator.UnmapFence); the state refreshed after it (pages unmapped)",
    ),
    Patch(
        f"{_SCHED}:Scheduler.on_idle",
        V0_5_23,
        _wrap_on_idle,
        "a pass when a limit is pending; leak-check total synced",
    ),
    Patch(
        f"{_SCHED}:Scheduler._record_scheduler_state_for_paused_engine",
        V0_5_23,
        _wrap_on_idle,
        "while generation is paused the loops skip both hooks above: the idle pass runs here",
    ),
)

#: Private SGLang members the adapter uses without a patch; checked by ``install``.
TOUCHES: tuple[Touch, ...] = (
    Touch(
        f"{_MEM}.radix_cache:RadixCache._split_node",
        V0_5_23,
        "_reclaimers splits a node to keep the cached prefix in front of a victim page",
    ),
    Touch(
        f"{_MEM}.radix_cache:RadixCache._delete_leaf",
        V0_5_23,
        "_reclaimers removes evicted nodes leaf by leaf; _counts hooks it (on the instance)",
    ),
    Touch(
        f"{_MEM}.radix_cache:RadixCache._insert_helper",
        V0_5_23,
        "_counts hooks it (on the instance) to mark the leaf an insert adds as evictable",
    ),
    Touch(
        f"{_MEM}.radix_cache:RadixCache.evictable_size_",
        V0_5_23,
        "_counts reads it to see whether an insert added a leaf",
    ),
    Touch(
        f"{_MEM}.rust_tree_core.adapter:RustUnifiedTreeCore.collect_path_info",
        V0_5_23,
        "_counts finds the path nodes whose lock state a lock/unlock/insert changed",
    ),
    Touch(
        f"{_MEM}.unified_radix_cache:UnifiedRadixCache._evict_device_next_node",
        V0_5_23,
        "_reclaimers walks the tree core's eviction order",
    ),
    Touch(
        f"{_MEM}.unified_radix_cache:UnifiedRadixCache._evict_device_leaf",
        V0_5_23,
        "_reclaimers evicts the leaves that hold victim pages",
    ),
    Touch(
        f"{_SCHED}:Scheduler.invariant_checker",
        V0_5_23,
        "_accounting syncs the idle leak check's total",
    ),
    Touch(
        f"{_SCHED}:Scheduler.pool_stats_observer",
        V0_5_23,
        "_accounting rebinds the observer with the capacity as its total",
    ),
    Touch(
        f"{_SCHED}:Scheduler.load_inquirer",
        V0_5_23,
        "_accounting rebinds the observer the load inquirer holds",
    ),
    Touch(
        f"{_SCHED}:Scheduler.chunked_req",
        V0_5_23,
        "_runtime counts the request in the middle of a chunked prefill as running",
    ),
    Touch(
        "sglang.srt.managers.schedule_batch:ReqKvInfo.kv_allocated_len",
        V0_5_23,
        "_runtime reads what the chunked request holds (output reservation)",
    ),
    Touch(
        f"{_COMPONENTS}.invariant_checker:SchedulerInvariantChecker.max_total_num_tokens",
        V0_5_23,
        "_accounting sets the leak check's total",
    ),
    Touch(
        f"{_COMPONENTS}.pool_stats_observer:SchedulerPoolStatsObserver.max_total_num_tokens",
        V0_5_23,
        "_accounting replaces the observer's total (dataclasses.replace)",
    ),
)
