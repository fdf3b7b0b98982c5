"""Interface of the C module built from ``engine_ext/vllm/_block_speedups.c``."""

from collections.abc import Callable
from typing import Any

class BlockFields:
    """ElasticBlockPool's per-block loops for blocks of exactly one (slotted) class."""

    cls: type
    def __init__(self, cls: type) -> None: ...
    def take(self, all_blocks: list[Any], ids: list[int]) -> list[Any]:
        """``[all_blocks[i] for i in ids]``, each checked free (ref_cnt 0, no hash), ref_cnt 1."""
    def split_freed(
        self, blocks: Any, pool: object
    ) -> tuple[list[int], list[Any], list[int], list[Any]] | list[Any]:
        """One reference off each block: (ids to free, blocks to cache, their ids, other
        pools' blocks); or, with a block of another class, the blocks as a list, unchanged."""
    def append_n(self, queue: Any, blocks: list[Any]) -> bool:
        """``FreeKVCacheBlockQueue.append_n(blocks)``; False (nothing changed) if a block is
        of another class."""
    def popleft_n(self, queue: Any, n: int, hold: bool = False) -> tuple[list[Any], list[int]]:
        """``FreeKVCacheBlockQueue.popleft_n(n)`` and the popped blocks' ids; ``hold``: each
        block checked free (ref_cnt 0, else AssertionError, nothing changed), ref_cnt 1."""
    def touch(self, queue: Any, blocks: Any) -> list[int] | None:
        """``BlockPool.touch(blocks)`` without a metrics collector: the ids of the blocks it
        unlinked from the queue; None (nothing changed) if a block is of another class."""

class RunningAllocate:
    """``KVCacheManager.allocate_slots`` with its running-request path in C: a RUNNING
    request of a ``pool_class`` pool whose ``overdraft`` is up calls ``original`` with the
    arguments as given (``refusal`` raised becomes None). With ``globals`` (the runtime
    module's namespace), a plain admission too: ``globals["_runtime"]`` a ``StepState``
    runtime of this manager's pool, no limit, no output reservation (what
    ``VllmRuntime.allocating`` does then, a refusal handed to its
    ``_refused_admission``). Every other call goes to ``otherwise``. ``num_tokens_list``
    (``(Request, name)``, checked by ``_runtime.num_tokens_list``): that admission reads
    ``request.num_tokens`` of exactly that class as ``len(request.<name>)`` when it is a
    list. Binds to instances as a function does."""

    __wrapped__: Callable[..., Any]
    otherwise: Callable[..., Any]
    def __init__(
        self,
        original: Callable[..., Any],
        pool_class: type,
        running: object,
        otherwise: Callable[..., Any],
        refusal: type[BaseException],
        globals: dict[str, Any] = ...,
        num_tokens_list: tuple[type, str] | None = None,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any: ...

class StepState:
    """``VllmRuntime``'s base: the fields the step's brackets read, as object slots
    (``pool``, ``_blocks``, ``_pages``, ``_scheduler``, ``_fence``, ``_reservation``, the
    safe points' gate ``_woken``, ``_steady``, ``_seen_*``, ``_refresh_due``, the demand's
    ``_demand_events``, ``_refused_blocks``, ``_device_refused``, the prefix-hit window
    ``_hits``, and ``_in_update``, ``_freed_in_update``). Unset until assigned."""

class HitWindow:
    """``engine_ext._hit_window.PrefixHitWindow`` with its ring in C (the plain
    admission records into it without a Python frame); counts are C ``long long``."""

    changes: int
    def __init__(self, size: int = 128) -> None: ...
    def record(self, hit_tokens: int, looked_up_tokens: int) -> None: ...
    @property
    def rate(self) -> float | None: ...
    def __len__(self) -> int: ...

class StepHook:
    """``Scheduler.schedule`` (``kind`` "schedule") or ``Scheduler.update_from_output``
    ("update_from_output") between the hooks of ``globals["_runtime"]`` (read at each
    call): ``begin_schedule``/``end_schedule`` or ``begin_update``/``end_update``, the
    end hook as a ``finally`` block. For a ``StepState`` runtime whose gate holds, the
    flags the hook would set are set in C and the Python method is not called. Binds to
    instances as a function does."""

    __wrapped__: Callable[..., Any]
    def __init__(
        self, original: Callable[..., Any], globals: dict[str, Any], kind: str
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any: ...
