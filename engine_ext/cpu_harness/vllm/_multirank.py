"""TP/PP rank processes for the CPU harness (``KVSIDECAR_STUB_TP`` / ``KVSIDECAR_STUB_PP``).

vLLM's own world size stays 1: the stub executor keeps one in-process
``StubWorker`` for the request table and sampling, and this module gives it
``tp * pp`` *rank processes* (``python -m engine_ext.ranks``) that each attach
the worker's KV memfd into a reservation of their own and do the KV writes of
every step: TP rank ``t`` writes word ``t`` of each token slot, PP stage ``p``
writes the regions (layers) of its stage. The sampler reads the KV back
from the scheduler's view, so a rank that skipped a write changes the tokens.

The worker's KV backend becomes a :class:`engine_ext.ranks.RankedBackend`
(map on every rank before a block is handed out; an unmap is sent tagged with
its step and counted only when every rank acked) and
``KVMemory.rank_barrier`` carries the coordinator's rank barrier, which the
adapter runtime installs (``_runtime.build_backing``).

Thread: the EngineCore busy-loop thread, like the stub worker.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ._worker import _FIRST_SAMPLED_ID, StubWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput

    from engine_ext.ranks import RankGroup

    from ._worker import _RequestState

__all__ = ["MultiRankSettings", "MultiRankStubWorker", "make_stub_worker"]


class MultiRankSettings(BaseSettings):
    """How many rank processes the CPU harness starts (env prefix ``KVSIDECAR_``)."""

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore")

    stub_tp: int = Field(default=1, ge=1, le=8)  # tensor-parallel ranks (each writes a word)
    stub_pp: int = Field(default=1, ge=1, le=8)  # pipeline stages (each writes its layers)
    rank_barrier_wait_s: float = Field(default=0.05, gt=0, le=5)  # bounded wait per pass
    rank_timeout_s: float = Field(default=60.0, gt=0)  # start-up, map and step acks
    #: A rank that makes no progress this long while it owes something (takes no byte of what
    #: was sent, acks none of the ops it received: stopped, wedged) is dead.
    rank_send_timeout_s: float = Field(default=60.0, gt=0, le=3600)


def make_stub_worker(vllm_config: VllmConfig, page_bytes: int) -> StubWorker:
    """The executor's worker: plain, or with rank processes when TP x PP > 1."""
    settings = MultiRankSettings()
    if settings.stub_tp * settings.stub_pp == 1:
        return StubWorker(vllm_config, page_bytes)
    return MultiRankStubWorker(vllm_config, page_bytes, settings)


class MultiRankStubWorker(StubWorker):
    """A ``StubWorker`` whose KV writes run on rank processes. Owns the rank group."""

    def __init__(
        self, vllm_config: VllmConfig, page_bytes: int, settings: MultiRankSettings
    ) -> None:
        super().__init__(vllm_config, page_bytes)
        self.settings = settings
        self.tp, self.pp = settings.stub_tp, settings.stub_pp
        if self.pp > 2 * self.num_layers:
            raise ValueError(
                f"KVSIDECAR_STUB_PP={self.pp} exceeds the model's {2 * self.num_layers} KV regions"
            )
        self.group: RankGroup | None = None
        self._batch: tuple[list[int], list[int], list[int]] = ([], [], [])

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        from allocator import HostBackend
        from engine_ext import load_engine_settings
        from engine_ext.ranks import RankChannelBarrier, RankedBackend, RankGroup

        super().initialize_from_config(kv_cache_config)
        memory = self.memory
        assert memory is not None and isinstance(memory.backend, HostBackend)
        engine = load_engine_settings()
        group = RankGroup.spawn_private(
            engine.resolved_runtime_dir(),
            engine.resolved_instance_id("vllm"),
            self.tp * self.pp,
            timeout_s=self.settings.rank_timeout_s,
            send_timeout_s=self.settings.rank_send_timeout_s,
        )
        block_size = self.vllm_config.cache_config.block_size
        try:
            backend = RankedBackend.start(
                memory.backend,
                group,
                tp=self.tp,
                pp=self.pp,
                block_bytes=memory.block_bytes,
                slot_bytes=memory.block_bytes // block_size,
                timeout_s=self.settings.rank_timeout_s,
            )
        except BaseException:
            group.close()
            raise
        self.group = group
        memory.backend = backend
        memory.rank_barrier = RankChannelBarrier(backend, wait_s=self.settings.rank_barrier_wait_s)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._batch = ([], [], [])
        # bookkeeping; _write collects the KV writes
        output = super().execute_model(scheduler_output)
        blocks, offsets, values = self._batch
        assert self.group is not None
        self.group.run_step(
            {"blocks": blocks, "offsets": offsets, "values": values},
            timeout_s=self.settings.rank_timeout_s,
        )
        return output

    def _write(self, state: _RequestState, num_tokens: int) -> None:
        start = state.num_computed_tokens
        stop = start + num_tokens
        blocks, offsets = self._slots(state, start, stop)
        self._batch[0].extend(int(b) for b in blocks.tolist())
        self._batch[1].extend(int(o) for o in offsets.tolist())
        self._batch[2].extend(state.token_ids[start:stop])
        state.num_computed_tokens = stop
        state.pending_sample = stop >= len(state.token_ids)

    def _next_token(self, state: _RequestState) -> int:
        blocks, offsets = self._slots(state, 0, state.num_computed_tokens)
        seen: Any = torch.stack([region[blocks, offsets, : self.tp] for region in self._regions])
        if bool((seen == seen[..., :1]).all()):
            # every TP rank wrote its word: the single-rank stub's token (it reads word 0),
            # so outputs compare across TP/PP sizes; a rank that skipped a write or wrote
            # stale KV leaves its word different and changes the token
            seen = seen[..., 0]
        digest = hashlib.blake2b(seen.numpy().tobytes(), digest_size=8).digest()
        span = self.vocab_size - _FIRST_SAMPLED_ID
        return int(_FIRST_SAMPLED_ID + int.from_bytes(digest, "little") % span)
