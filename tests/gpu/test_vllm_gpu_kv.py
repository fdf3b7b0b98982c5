"""vLLM's real GPU worker with its KV cache on a CudaBackend reservation (GPU machines only).

Run with ``python -m pytest tests/gpu/test_vllm_gpu_kv.py -m gpu`` on a machine
with an NVIDIA GPU, cuda-python and a CUDA build of vLLM 0.33 (do *not* set
``VLLM_TARGET_DEVICE=cpu``). Skipped, with the reason, anywhere else.

One tiny Llama (``load_format="dummy"``: random weights, no download) runs in
a real ``LLM()`` with the plugin registered in-process and the EngineCore in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor), so the
test can look at the published reservation, the worker's KV tensors and the
device's free memory (``cuMemGetInfo``), independently of the backend's own
handle count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

BLOCK_TOKENS = 16
MAX_TOKENS = 8
KV_BYTES = 256 << 20  # --kv-cache-memory-bytes: a few hundred 2 MiB pages at most
PROMPT_TOKENS = 900  # + MAX_TOKENS fits max_model_len 1024
NUM_PROMPTS = 12  # 12 x 57 blocks: with the tiny model's 256 blocks per 2 MiB page, 3+ pages


def _unavailable() -> str | None:
    if os.environ.get("VLLM_TARGET_DEVICE", "cuda") != "cuda":
        return f"VLLM_TARGET_DEVICE={os.environ['VLLM_TARGET_DEVICE']}: not a CUDA vLLM run"
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vllm/torch not importable: {exc}"
    if not torch.cuda.is_available():
        return "torch has no CUDA device here"
    from allocator import CudaBackend

    reason = CudaBackend.unavailable_reason()
    if reason is not None:
        return f"CudaBackend unavailable: {reason}"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "vLLM's platform is not CUDA (a CPU build of vLLM?)"
    return None


@dataclass
class Engine:
    llm: Any  # vllm.LLM
    memory: Any  # engine_ext.vllm._kv_memory.KVMemory
    runtime: Any  # engine_ext.vllm._runtime.VllmRuntime
    prompts: list[Any]  # vllm TokensPrompt: exact lengths, whatever the tokenizer

    def generate(self, prompts: list[Any]) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def apply_limit(self, limit: int | None) -> None:
        """Publish a limit and run the pass the busy loop would run (no busy loop in-process)."""
        self.runtime.instance.set_limit(limit)
        self.runtime.pool.get_num_free_blocks()  # top of an allocation: applies the target


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    from engine_ext.cpu_harness import make_tiny_model_dir

    tmp = tmp_path_factory.mktemp("vllm-gpu-kv")
    model_dir = make_tiny_model_dir(Path(tmp) / "model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSIDECAR_ENABLE", "1")
        mp.setenv("KVSIDECAR_INSTANCE_ID", "gpu-kv-test")
        mp.setenv("KVSIDECAR_RUNTIME_DIR", str(tmp / "run"))
        mp.setenv("KVSIDECAR_THREAD_GUARD", "1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # EngineCore in this process
        from vllm import LLM

        from engine_ext.vllm import plugin
        from engine_ext.vllm._kv_memory import claim_kv_memory
        from engine_ext.vllm._runtime import current_runtime

        plugin.register()  # what the vllm.general_plugins entry point does
        llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            dtype="float16",
            max_model_len=1024,
            block_size=BLOCK_TOKENS,
            kv_cache_memory_bytes=KV_BYTES,
            enable_prefix_caching=True,
            tensor_parallel_size=1,
            distributed_executor_backend="uni",
            enforce_eager=True,
            seed=0,
        )
        memory = claim_kv_memory()
        runtime = current_runtime()
        assert memory is not None and runtime is not None
        yield Engine(llm, memory, runtime, _prompts(llm))
        runtime.close()
        del llm


def _prompts(llm: Any) -> list[Any]:
    """``NUM_PROMPTS`` distinct token-id prompts of exactly ``PROMPT_TOKENS`` tokens."""
    import random

    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)])
        for _ in range(NUM_PROMPTS)
    ]


def _pages_needed(memory: Any) -> int:
    """Pages the prompts' blocks occupy at the least (null block included)."""
    per_request = -(-(PROMPT_TOKENS + MAX_TOKENS) // BLOCK_TOKENS)
    return -(-(1 + NUM_PROMPTS * per_request) // memory.blocks_per_page)


def _worker_kv_caches(worker: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...], str]]:
    runner = getattr(worker, "worker", worker).model_runner
    return [
        (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in runner.kv_caches
    ]


def test_kv_tensors_are_views_over_the_published_reservation(engine: Engine) -> None:
    from allocator import CudaBackend
    from engine_ext.vllm._gpu_kv import PrimedBackend

    memory = engine.memory
    assert isinstance(memory.backend, PrimedBackend)
    assert engine.runtime.instance.binding.blocks.pages.backend is memory.backend  # pool drives it
    cuda = memory.backend.inner
    assert isinstance(cuda, CudaBackend)
    layout = memory.layout
    assert memory.num_blocks % memory.blocks_per_page == 0  # rounded to whole pages
    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.num_gpu_blocks == memory.num_blocks  # the scheduler's count
    (caches,) = engine.llm.collective_rpc(_worker_kv_caches)
    assert len(caches) == layout.num_regions
    for layer, (ptr, shape, _stride, dtype) in enumerate(caches):
        assert ptr == cuda.base_address + layer * layout.region_bytes
        assert shape[0] == memory.num_blocks and dtype == "torch.float16"


def test_pages_map_on_demand_and_a_limit_gives_device_memory_back(engine: Engine) -> None:
    memory = engine.memory
    cuda = memory.backend.inner
    bundle = memory.layout.bundle_bytes
    assert cuda.mapped_bytes() == bundle  # only page 0 (null block) before any request

    needed = _pages_needed(memory)
    assert needed >= 3, (needed, memory.blocks_per_page)  # the test must span several pages
    first = engine.generate(engine.prompts)
    mapped = cuda.mapped_bytes()
    assert mapped >= needed * bundle  # pages were mapped before blocks were handed out
    assert engine.generate(engine.prompts) == first  # prefix hits read back the same KV

    free_before = cuda.device_free_bytes()
    engine.apply_limit(0)  # floor: the null block's page
    state = engine.runtime.instance.state()
    assert cuda.mapped_bytes() == bundle, state
    released = cuda.device_free_bytes() - free_before
    assert released >= (mapped - bundle) * 0.9  # measured by the driver, whole device

    engine.apply_limit(None)  # unlimited again
    assert engine.generate(engine.prompts) == first  # recomputed into freshly mapped pages
    assert cuda.mapped_bytes() > bundle
