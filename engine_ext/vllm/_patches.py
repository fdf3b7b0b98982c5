"""Every change kvsidecar makes to vLLM, and every private vLLM member it relies on.

Two tables in the format of :mod:`engine_ext._patching`: :data:`PATCHES`
(attributes we replace) and :data:`TOUCHES` (private members we use without
replacing them). :func:`apply_patches` checks the installed version and every
target of both tables before it changes anything, refuses to start outside
them (nothing is patched then), and is idempotent; :func:`remove_patches`
undoes what it did in this process. To add a row: write the factory
``(original, context) -> replacement`` here and append a ``Patch`` to the table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet

from engine_ext._patching import (
    AppliedPatches,
    Patch,
    Touch,
    UnsupportedEngineError,
    is_patched,
)
from engine_ext._patching import apply_patches as _apply_table
from engine_ext._patching import supported_range as _range_of

__all__ = [
    "PATCHES",
    "TOUCHES",
    "Patch",
    "Touch",
    "UnsupportedVllmVersion",
    "apply_patches",
    "is_patched",
    "remove_patches",
    "supported_range",
]


class UnsupportedVllmVersion(UnsupportedEngineError):
    """The installed vLLM does not match the tables: a configuration error, fatal at start."""


def _block_pool(original: Any, _: object) -> Any:
    from engine_ext.vllm._block_pool import ElasticBlockPool

    if not issubclass(ElasticBlockPool, original):
        raise UnsupportedVllmVersion(
            f"{original!r} is not the BlockPool ElasticBlockPool extends; vLLM changed"
        )
    return ElasticBlockPool


def _run_busy_loop(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    def run_busy_loop(self: Any) -> Any:
        from engine_ext.vllm._runtime import current_runtime

        runtime = current_runtime()
        if runtime is None:
            return original(self)
        runtime.attach_engine(self)
        try:
            return original(self)
        finally:
            runtime.close()  # socket and registration go with the loop

    run_busy_loop.__wrapped__ = original  # type: ignore[attr-defined]
    return run_busy_loop


def _schedule(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    from engine_ext.vllm._runtime import schedule_patch

    return schedule_patch(original)


def _allocate_slots(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    from engine_ext.vllm._block_pool import ElasticBlockPool
    from engine_ext.vllm._runtime import allocate_slots_patch

    return allocate_slots_patch(original, ElasticBlockPool)


def _update_from_output(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    from engine_ext.vllm._runtime import update_from_output_patch

    return update_from_output_patch(original)


def _preempt_request(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    def preempt_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        from engine_ext.vllm._runtime import current_runtime

        result = original(self, *args, **kwargs)
        runtime = current_runtime()
        if runtime is not None:
            runtime.preempted()  # after the original: a refused preemption is not counted
        return result

    preempt_request.__wrapped__ = original  # type: ignore[attr-defined]
    return preempt_request


def _refuse_dp_busy_loop(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    def run_busy_loop(self: Any) -> Any:
        from engine_ext.vllm._runtime import current_runtime

        if current_runtime() is not None:
            from engine_ext._errors import EngineExtConfigError

            raise EngineExtConfigError(
                "kvsidecar: data parallel (DPEngineCoreProc) is not supported: its busy loop "
                "keeps stepping dummy batches and never reaches the hook that applies limits; "
                "run one vLLM server per GPU with --data-parallel-size 1, or unset "
                "KVSIDECAR_ENABLE"
            )
        return original(self)

    run_busy_loop.__wrapped__ = original  # type: ignore[attr-defined]
    return run_busy_loop


def _plan_kv_cache(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    from engine_ext.vllm._gpu_kv import plan_kv_cache

    return plan_kv_cache(original)


def _place_kv_cache(original: Callable[..., Any], _: object) -> Callable[..., Any]:
    from engine_ext.vllm._gpu_kv import place_kv_cache

    return place_kv_cache(original)


_V033 = SpecifierSet(">=0.33.0,<0.34")

PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.core.kv_cache_coordinator:BlockPool",
        _V033,
        _block_pool,
        "KVCacheCoordinator builds its BlockPool by this module-level name (docs/engine-hooks.md 1.5)",
    ),
    Patch(
        "vllm.v1.engine.core:EngineCoreProc.run_busy_loop",
        _V033,
        _run_busy_loop,
        "start the control socket/registration on the busy-loop thread (after any fork); "
        "close them when the loop ends",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        _V033,
        _schedule,
        "safe points: limit passes (take target, evict, unmap) run only before and after "
        "schedule(), never between a prefix lookup and its touch (docs/vllm.md)",
    ),
    Patch(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
        _V033,
        _allocate_slots,
        "liveness: a RUNNING request's blocks may go above the target (never preempted by a "
        "limit); admissions the limit keeps out are reported as waiting_for_memory; a copy "
        "of vLLM's method with the running check compiled in (engine_ext/_inline.py)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        _V033,
        _update_from_output,
        "device ordering: record the unmap fence after each forward pass, so GPU unmaps wait "
        "on that event, not on a device-wide sync (allocator.UnmapFence); after it, when "
        "requests finished, a safe point if mapped pages moved (the state follows /proc), "
        "else the idle hook armed (the demand when it goes idle)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
        _V033,
        _preempt_request,
        "num_preemptions: every preemption vLLM makes, counted exactly (the demand fields)",
    ),
    Patch(
        "vllm.v1.engine.core:DPEngineCoreProc.run_busy_loop",
        _V033,
        _refuse_dp_busy_loop,
        "refuse data parallel with the extension on: its loop never applies a limit",
    ),
    Patch(
        "vllm.v1.engine.core:get_kv_cache_configs",
        _V033,
        _plan_kv_cache,
        "GPU path (CUDA, uni executor): refuse unsupported set-ups, round num_blocks down to "
        "whole CudaBackend pages before the scheduler is built (docs/engine-hooks.md 1.10)",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:allocate_kv_cache",
        _V033,
        _place_kv_cache,
        "GPU path: KV tensors as vLLM's own views over a CudaBackend reservation, published "
        "for the ElasticBlockPool, which maps pages on demand (docs/engine-hooks.md 1.10)",
    ),
    Patch(
        "vllm.v1.worker.gpu.attn_utils:allocate_kv_cache",
        _V033,
        _place_kv_cache,
        "the same for model runner V2 (vLLM 0.33's default), which calls it by this name",
    ),
)


TOUCHES: tuple[Touch, ...] = (
    Touch(
        "vllm.v1.engine.core:EngineCore._idle_state_callbacks",
        _V033,
        "_runtime arms a one-shot idle callback there so an idle engine applies a limit",
    ),
    Touch(
        "vllm.v1.engine.core:EngineCoreProc.input_queue",
        _V033,
        "_runtime puts a WAKEUP request there to wake a blocked busy loop",
    ),
    Touch(
        "vllm.v1.engine:EngineCoreRequestType.WAKEUP",
        _V033,
        "the request type _runtime puts on input_queue to wake the busy loop",
    ),
)

_lock = threading.Lock()
_applied: list[AppliedPatches] = []  # every apply in this process, for remove_patches


def supported_range() -> SpecifierSet:
    """The vLLM versions every row supports."""
    return _range_of((*PATCHES, *TOUCHES))


def apply_patches(vllm_version: str) -> AppliedPatches:
    """Check the version and every target, then apply every patch not applied yet.

    Returns the handle; its ``targets`` are the targets changed now (empty
    when everything was patched already). Raises :class:`UnsupportedVllmVersion`.
    """
    try:
        applied = _apply_table("vLLM", vllm_version, PATCHES, TOUCHES)
    except UnsupportedVllmVersion:
        raise
    except UnsupportedEngineError as exc:
        raise UnsupportedVllmVersion(str(exc)) from None
    with _lock:
        _applied.append(applied)
    return applied


def remove_patches() -> list[str]:
    """Undo every :func:`apply_patches` of this process; return the targets restored."""
    with _lock:
        restored: list[str] = []
        while _applied:
            restored += _applied.pop().undo()
        return restored
