"""A model-free forward for SGLang's ``ModelRunner`` on CPU: tokens computed from real KV memory.

Harness only (installed in the scheduler process by
:func:`run_scheduler_process`, the scheduler entry of
:mod:`engine_ext.cpu_harness.sglang.serve`). SGLang builds everything else
for real: the ``ModelRunner`` (with the tiny model's dummy weights, never
used), its KV pool (``MHATokenToKVPool``, placed by the adapter on a
``HostBackend`` reservation), the tree cache, the scheduler and its loop.
Only ``ModelRunner._forward_raw`` -- the model's forward -- is replaced:

* every scheduled token's id is *written* (int32, first word of the row) into
  its KV slot (``out_cache_loc``) in every layer's K and V buffer;
* each request's next token is a hash of the token ids *read back* from all
  its slots (``req_to_token``), returned as logits with all mass on it, so
  SGLang's own sampler picks it whatever the sampling parameters.

Hence a prefix-cache hit on a slot whose memory was unmapped or reused
changes the output, and a write to a page the allocator did not map faults
(the reservation is ``PROT_NONE``). Tokens are comparable across runs.

Thread: the scheduler's thread that runs the forward (SGLang's own).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

__all__ = [
    "install_stub_runner",
    "run_scheduler_process",
    "stub_forward_raw",
    "uninstall_stub_runner",
]

_TARGET = ("sglang.srt.model_executor.model_runner", "ModelRunner", "_forward_raw")
#: First token id the stub samples: past the specials (<unk>, <s>, </s>) so it never stops early.
FIRST_SAMPLED_ID = 3
_lock = threading.Lock()
_original: Any = None


def _regions(pool: Any) -> list[torch.Tensor]:
    """Every K and V buffer of the pool as int32 rows ``[slots, words]`` (views, no copy)."""
    views = []
    for buffers in (pool.k_buffer, pool.v_buffer):
        for buf in buffers:
            views.append(buf.view(buf.shape[0], -1).view(torch.int32))
    return views


def stub_forward_raw(
    self: Any,
    forward_batch: Any,
    pp_proxy_tensors: Any = None,
    reinit_attn_backend: bool = False,
    split_forward_count: int = 1,
) -> Any:
    """``ModelRunner._forward_raw`` without a model (see the module docstring)."""
    del pp_proxy_tensors, reinit_attn_backend, split_forward_count
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    vocab = int(self.model_config.vocab_size)
    batch_size = int(forward_batch.batch_size)
    logits = torch.full((batch_size, vocab), float("-inf"), dtype=torch.float32)
    if batch_size and not forward_batch.forward_mode.is_idle():
        regions = _regions(self.token_to_kv_pool)
        slots = forward_batch.out_cache_loc.to(torch.long)
        ids = forward_batch.input_ids.to(torch.int32)
        for region in regions:
            region[slots, 0] = ids
        table = self.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        lens = forward_batch.seq_lens.tolist()
        for i, (row, length) in enumerate(zip(rows, lens, strict=True)):
            seq_slots = table[row, : int(length)].to(torch.long)
            seen = torch.stack([region[seq_slots, 0] for region in regions])
            logits[i, next_token(seen, vocab)] = 0.0
    return ModelRunnerOutput(
        logits_output=LogitsProcessorOutput(next_token_logits=logits), can_run_graph=False
    )


def next_token(seen: torch.Tensor, vocab_size: int) -> int:
    """The token the stub generates after a sequence whose KV read back as ``seen``."""
    digest = hashlib.blake2b(seen.contiguous().numpy().tobytes(), digest_size=8).digest()
    return FIRST_SAMPLED_ID + int.from_bytes(digest, "little") % (vocab_size - FIRST_SAMPLED_ID)


def install_stub_runner() -> None:
    """Replace ``ModelRunner._forward_raw`` in this process (idempotent)."""
    global _original
    import importlib

    module_name, cls_name, attr = _TARGET
    cls = getattr(importlib.import_module(module_name), cls_name)
    with _lock:
        if _original is None:
            _original = cls.__dict__[attr]
            setattr(cls, attr, stub_forward_raw)


def uninstall_stub_runner() -> None:
    """Restore SGLang's ``_forward_raw`` (tests)."""
    global _original
    import importlib

    module_name, cls_name, attr = _TARGET
    with _lock:
        if _original is not None:
            setattr(getattr(importlib.import_module(module_name), cls_name), attr, _original)
            _original = None


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler process with the stub forward, entered through kvsidecar's entry."""
    install_stub_runner()
    from engine_ext.sglang import run_scheduler_process as entry

    return entry(*args, **kwargs)
