"""The patch table: every SGLang symbol kvsidecar wraps, with the versions it was written for.

Each wrapper keeps the real signature (``functools.wraps``), does its part
and calls the original. They act only in a process where :func:`install`
ran with ``KVSIDECAR_ENABLE`` on; the settings are read once, in ``install``.

===========================================================  =================================
target                                                        what the wrapper adds
===========================================================  =================================
``Engine.run_scheduler_process_func`` (parent process)        scheduler processes start through
                                                              :func:`._child.run_scheduler_process`
                                                              (SGLang spawns them: patches made in
                                                              the parent do not reach them)
``KVCacheConfigurator._profile_available_bytes``              the pool is sized for the virtual KV
                                                              capacity (docs/overcommit.md), not
                                                              for the free memory measured now
``MHATokenToKVPool._create_buffers_normal``                   K/V tensors on a kvsidecar reservation
``KVCacheConfigurator._build_token_to_kv_pool_allocator``     :class:`ElasticTokenAllocator`
``Scheduler.__init__``                                        attach the :class:`ElasticPool` (the
                                                              tree cache exists now); refuse what
                                                              the adapter does not support (before
                                                              and after SGLang's own __init__:
                                                              pdmux, PD role switch, PP,
                                                              disaggregation loops)
``Scheduler.get_next_batch_to_run``                           coordinator pass before admission
``Scheduler.on_idle``                                         pass when a limit is pending; leak
                                                              check total synced
===========================================================  =================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet

from .. import EngineSettings
from .._errors import EngineExtConfigError

__all__ = ["PATCHES", "Patch", "Session"]

V0_5_23 = SpecifierSet("==0.5.23")
Wrapper = Callable[[Any, "Session"], Any]


@dataclass(frozen=True, slots=True)
class Patch:
    """One wrapped attribute: ``module:owner.attr`` for SGLang in ``versions``."""

    module: str
    owner: str  # class name in the module
    attr: str
    versions: SpecifierSet
    wrap: Wrapper  # (original, session) -> replacement
    static: bool = False  # the attribute is a staticmethod

    @property
    def target(self) -> str:
        return f"{self.module}:{self.owner}.{self.attr}"


@dataclass(slots=True)
class Session:
    """What the wrappers of one installation share (one per process)."""

    settings: EngineSettings
    engine_version: str
    pools: list[Any]  # ElasticPools attached in this process (closed on uninstall)


# -- wrappers ---------------------------------------------------------------------------


def _wrap_scheduler_process_func(original: Any, session: Session) -> Any:
    from ._child import run_scheduler_process

    return run_scheduler_process


def _wrap_profile_bytes(original: Any, session: Session) -> Any:
    from ._kv_memory import virtual_kv_bytes

    @functools.wraps(original)
    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
        virtual = virtual_kv_bytes(str(self.device), int(getattr(self, "gpu_id", 0) or 0),
                                   session.settings.virtual_kv_bytes)
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
    from ._runtime import ElasticPool

    @functools.wraps(original)
    def __init__(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> None:
        _refuse_unsupported(server_args)
        original(self, server_args, port_args, *args, **kwargs)
        _refuse_unsupported_loop(self)
        pool = ElasticPool.attach(self, session.settings, engine_version=session.engine_version,
                                  signal_cleanup=True)
        session.pools.append(pool)

    return __init__


def _wrap_next_batch(original: Any, session: Session) -> Any:
    from ._runtime import pool_of

    @functools.wraps(original)
    def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = pool_of(self)
        if pool is not None:
            pool.before_schedule()
        return original(self, *args, **kwargs)

    return get_next_batch_to_run


def _wrap_on_idle(original: Any, session: Session) -> Any:
    from ._runtime import pool_of

    @functools.wraps(original)
    def on_idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = pool_of(self)
        if pool is not None:
            pool.on_idle()
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
            "kvsidecar's SGLang adapter does not support: " + ", ".join(problems)
            + "; remove these options or start without kvsidecar (KVSIDECAR_ENABLE=0)")


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
        problems.append("--enable-pdmux (its loop never calls get_next_batch_to_run, where "
                        "kvsidecar applies limits)")
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
            "without kvsidecar (KVSIDECAR_ENABLE=0)")


_SCHED = "sglang.srt.managers.scheduler"

#: Every patch, applied in this order by :func:`._install.install`.
PATCHES: tuple[Patch, ...] = (
    Patch("sglang.srt.entrypoints.engine", "Engine", "run_scheduler_process_func", V0_5_23,
          _wrap_scheduler_process_func, static=True),
    Patch("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator",
          "_profile_available_bytes", V0_5_23, _wrap_profile_bytes),
    Patch("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool", "_create_buffers_normal",
          V0_5_23, _wrap_create_buffers),
    Patch("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator",
          "_build_token_to_kv_pool_allocator", V0_5_23, _wrap_build_allocator),
    Patch(_SCHED, "Scheduler", "__init__", V0_5_23, _wrap_scheduler_init),
    Patch(_SCHED, "Scheduler", "get_next_batch_to_run", V0_5_23, _wrap_next_batch),
    Patch(_SCHED, "Scheduler", "on_idle", V0_5_23, _wrap_on_idle),
)
