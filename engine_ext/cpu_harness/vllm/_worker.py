"""A model-free vLLM worker for CPU: deterministic tokens computed from real KV memory.

The worker owns a KV reservation on the allocator's ``HostBackend`` (one
region per layer and K/V, ``PageLayout``) and per-request state (token ids,
block table). Every scheduled token is *written* into its KV slot in every
region (the token id, as int32), and every sampled token is computed from the
token ids *read back* from the request's blocks, so:

* a prefix-cache hit on a block whose memory was unmapped or reused would
  change the output (tokens are comparable across runs);
* a write to a page that is not mapped faults (SIGSEGV on the PROT_NONE
  reservation): the block pool must map before it hands a block out.

Thread: every method runs on the EngineCore busy-loop thread (the executor
calls it synchronously).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.vllm import KVMemory, clear_kv_memory, publish_kv_memory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput

__all__ = ["StubWorker"]

#: Bytes the stub reports as available for KV when ``--kv-cache-memory-bytes`` is unset.
DEFAULT_KV_BYTES = 64 << 20
#: First token id the stub samples: past the specials (<unk>, <s>, </s>) so it never stops early.
_FIRST_SAMPLED_ID = 3


@dataclass(slots=True)
class _RequestState:
    token_ids: list[int]  # prompt + tokens sampled so far
    block_ids: list[int]  # block table of KV group 0
    num_computed_tokens: int = 0  # tokens whose KV is written
    pending_sample: bool = field(default=False)  # this step completes the known tokens


class StubWorker:
    """Per-rank state of the stub executor: KV reservation and request table."""

    def __init__(self, vllm_config: VllmConfig, page_bytes: int) -> None:
        self.vllm_config = vllm_config
        self.page_bytes = page_bytes
        model = vllm_config.model_config
        self.num_layers = model.get_num_layers(vllm_config.parallel_config)
        self.num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = model.get_head_size()
        self.vocab_size = model.get_vocab_size()
        self.memory: KVMemory | None = None
        self._regions: list[torch.Tensor] = []  # int32 [num_blocks, block_size, slot_words]
        self._requests: dict[str, _RequestState] = {}
        self._scheduled: SchedulerOutput | None = None
        self._mapped_all = False

    # -- start-up RPCs ------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(
            block_size=self.vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=torch.float16,
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.num_layers)}

    def determine_available_memory(self) -> int:
        """The KV budget, rounded down to whole pages (so blocks fill whole pages)."""
        budget = self.vllm_config.cache_config.kv_cache_memory_bytes or DEFAULT_KV_BYTES
        bundle_bytes = self.page_bytes * 2 * self.num_layers
        return int(budget // bundle_bytes * bundle_bytes)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # layer-outermost: each layer/K-V region is contiguous

    def set_kv_cache_layout(self, layout_name: str, cp_interleave_size: int) -> None:
        del layout_name, cp_interleave_size  # the stub has its own fixed layout

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def compile_or_warm_up_model(self) -> None:
        return None  # nothing to compile

    def update_max_model_len(self, max_model_len: int) -> None:
        self.vllm_config.model_config.max_model_len = max_model_len

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        from allocator import HostBackend, PageLayout

        block_size = self.vllm_config.cache_config.block_size
        block_bytes = block_size * self.num_kv_heads * self.head_dim * 2  # fp16
        if self.page_bytes % block_bytes:
            raise ValueError(
                f"page_bytes {self.page_bytes} is not a multiple of one block's bytes "
                f"{block_bytes} (block_size {block_size}): set KVSIDECAR_PAGE_BYTES accordingly"
            )
        blocks_per_page = self.page_bytes // block_bytes
        num_blocks = kv_cache_config.num_blocks
        num_pages = -(-num_blocks // blocks_per_page)
        layout = PageLayout(
            page_bytes=self.page_bytes, num_pages=num_pages, num_regions=2 * self.num_layers
        )
        backend = HostBackend.reserve(layout, name="kvsidecar-stub-kv")
        self.memory = KVMemory(backend, layout, block_bytes, num_blocks)
        slot_words = block_bytes // block_size // 4
        self._regions = [
            backend.tensor(r).view(torch.int32).view(num_pages * blocks_per_page, block_size, -1)
            for r in range(layout.num_regions)
        ]
        assert self._regions[0].shape[2] == slot_words
        publish_kv_memory(self.memory)

    # -- steps --------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Write the scheduled tokens' KV; None (sample next), or vLLM's empty output when
        nothing was scheduled, as vLLM's GPU model runner answers (with async scheduling
        the engine then takes this answer as the step's output: sample_tokens is not called).
        """
        memory = self.memory
        assert memory is not None, "initialize_from_config must run before execute_model"
        if not memory.claimed and not self._mapped_all:
            # No elastic block pool: the native behaviour maps the whole cache once.
            memory.backend.map_many(range(memory.layout.num_pages))
            self._mapped_all = True
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        self._add_new(scheduler_output)
        self._update_cached(scheduler_output)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self._write(self._requests[req_id], num_tokens)
        if not scheduler_output.total_num_scheduled_tokens:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            self._scheduled = None
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._scheduled = scheduler_output
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        from vllm.v1.outputs import ModelRunnerOutput

        scheduled = self._scheduled
        self._scheduled = None
        req_ids = list(scheduled.num_scheduled_tokens) if scheduled is not None else []
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self._requests[req_id]
            if state.pending_sample:
                token = self._next_token(state)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def shutdown(self) -> None:
        self._regions = []
        if self.memory is not None:
            self.memory.backend.release()
            self.memory = None
            clear_kv_memory()

    # -- internals ----------------------------------------------------------------
    def _add_new(self, out: SchedulerOutput) -> None:
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            self._requests[new.req_id] = _RequestState(
                token_ids=prompt,
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
            )

    def _update_cached(self, out: SchedulerOutput) -> None:
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            if req_id in cached.all_token_ids:
                state.token_ids = list(cached.all_token_ids[req_id])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _slots(self, state: _RequestState, start: int, stop: int) -> tuple[Any, Any]:
        block_size = self.vllm_config.cache_config.block_size
        positions = torch.arange(start, stop)
        table = torch.tensor(state.block_ids, dtype=torch.long)
        return table[positions // block_size], positions % block_size

    def _write(self, state: _RequestState, num_tokens: int) -> None:
        start = state.num_computed_tokens
        stop = start + num_tokens
        blocks, offsets = self._slots(state, start, stop)
        values = torch.tensor(state.token_ids[start:stop], dtype=torch.int32)
        for region in self._regions:
            region[blocks, offsets, 0] = values
        state.num_computed_tokens = stop
        state.pending_sample = stop >= len(state.token_ids)

    def _next_token(self, state: _RequestState) -> int:
        blocks, offsets = self._slots(state, 0, state.num_computed_tokens)
        seen = torch.stack([region[blocks, offsets, 0] for region in self._regions])
        digest = hashlib.blake2b(seen.numpy().tobytes(), digest_size=8).digest()
        span = self.vocab_size - _FIRST_SAMPLED_ID
        return int(_FIRST_SAMPLED_ID + int.from_bytes(digest, "little") % span)
