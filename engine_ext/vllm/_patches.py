"""Every change kvsidecar makes to vLLM, in one table, each with its version range.

A patch names its target (``module:attr`` or ``module:Class.attr``), the vLLM
versions it was written against (``packaging.specifiers``) and a factory that
turns the original into the replacement. :func:`apply_patches` checks the
installed version against every range first and refuses to start outside
them (nothing is patched then); applying twice changes nothing (replacements
carry a marker attribute).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["PATCHES", "Patch", "UnsupportedVllmVersion", "apply_patches", "supported_range"]

_MARK = "__kvsidecar_patch__"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside a patch's range: a configuration error, fatal at start."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One replacement of a vLLM symbol."""

    target: str  # "package.module:Name" or "package.module:Class.method"
    versions: SpecifierSet  # vLLM versions this patch was written and tested against
    replacement: Callable[[Any], Any]  # original -> replacement
    why: str  # one line for the docs and the log


def _block_pool(original: Any) -> Any:
    from engine_ext.vllm._block_pool import ElasticBlockPool

    if not issubclass(ElasticBlockPool, original):
        raise UnsupportedVllmVersion(
            f"{original!r} is not the BlockPool ElasticBlockPool extends; vLLM changed"
        )
    return ElasticBlockPool


def _run_busy_loop(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        from engine_ext.vllm._runtime import current_runtime

        runtime = current_runtime()
        if runtime is None:
            return original(self, *args, **kwargs)
        runtime.begin_schedule(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            runtime.end_schedule()

    schedule.__wrapped__ = original  # type: ignore[attr-defined]
    return schedule


def _allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from engine_ext.vllm._runtime import current_runtime

        runtime = current_runtime()
        if runtime is None:
            return original(self, request, *args, **kwargs)
        return runtime.allocating(original, self, request, args, kwargs)

    allocate_slots.__wrapped__ = original  # type: ignore[attr-defined]
    return allocate_slots


def _refuse_dp_busy_loop(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _plan_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    from engine_ext.vllm._gpu_kv import plan_kv_cache

    return plan_kv_cache(original)


def _place_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    from engine_ext.vllm._gpu_kv import place_kv_cache

    return place_kv_cache(original)


_V033 = SpecifierSet(">=0.33.0,<0.34")

PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.core.kv_cache_coordinator:BlockPool", _V033, _block_pool,
        "KVCacheCoordinator builds its BlockPool by this module-level name (ENGINES.md 1.5)",
    ),
    Patch(
        "vllm.v1.engine.core:EngineCoreProc.run_busy_loop", _V033, _run_busy_loop,
        "start the control socket/registration on the busy-loop thread (after any fork); "
        "close them when the loop ends",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule", _V033, _schedule,
        "safe points: limit passes (take target, evict, unmap) run only before and after "
        "schedule(), never between a prefix lookup and its touch (docs/vllm.md)",
    ),
    Patch(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", _V033, _allocate_slots,
        "liveness: a RUNNING request's blocks may go above the target (never preempted by a "
        "limit); admissions the limit keeps out are reported as waiting_for_memory",
    ),
    Patch(
        "vllm.v1.engine.core:DPEngineCoreProc.run_busy_loop", _V033, _refuse_dp_busy_loop,
        "refuse data parallel with the extension on: its loop never applies a limit",
    ),
    Patch(
        "vllm.v1.engine.core:get_kv_cache_configs", _V033, _plan_kv_cache,
        "GPU path (CUDA, uni executor): refuse unsupported set-ups, round num_blocks down to "
        "whole CudaBackend pages before the scheduler is built (ENGINES.md 1.10)",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:allocate_kv_cache", _V033, _place_kv_cache,
        "GPU path: KV tensors as vLLM's own views over a CudaBackend reservation, published "
        "for the ElasticBlockPool, which maps pages on demand (ENGINES.md 1.10)",
    ),
    Patch(
        "vllm.v1.worker.gpu.attn_utils:allocate_kv_cache", _V033, _place_kv_cache,
        "the same for model runner V2 (vLLM 0.33's default), which calls it by this name",
    ),
)  # fmt: skip


def supported_range() -> SpecifierSet:
    """The vLLM versions every patch supports."""
    combined = SpecifierSet()
    for patch in PATCHES:
        combined &= patch.versions
    return combined


def apply_patches(vllm_version: str) -> list[str]:
    """Check the version, then apply every patch not applied yet; return the targets changed."""
    version = Version(vllm_version)
    for patch in PATCHES:
        if version not in patch.versions:
            raise UnsupportedVllmVersion(
                f"kvsidecar supports vLLM {supported_range()} but vLLM {vllm_version} is "
                f"installed ({patch.target} is pinned to {patch.versions}); install a supported "
                "vLLM or unset KVSIDECAR_ENABLE"
            )
    changed: list[str] = []
    for patch in PATCHES:
        owner, name = _resolve(patch.target)
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        if getattr(current, _MARK, False):
            continue
        replacement = patch.replacement(current)
        try:
            setattr(replacement, _MARK, True)
        except (AttributeError, TypeError) as exc:  # pragma: no cover - functions/classes accept it
            raise UnsupportedVllmVersion(f"cannot mark the patch for {patch.target}: {exc}") from exc
        setattr(owner, name, replacement)
        changed.append(patch.target)
    return changed


def is_patched(target: str) -> bool:
    """Whether ``target`` currently holds our replacement."""
    owner, name = _resolve(target)
    return bool(getattr(getattr(owner, name), _MARK, False))


def _resolve(target: str) -> tuple[Any, str]:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if not hasattr(owner, name):
        raise UnsupportedVllmVersion(f"vLLM has no {target}; this vLLM is not supported")
    return owner, name
