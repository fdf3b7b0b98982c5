"""SGLang's real server with the output reservation and chunked prefill, on CPU.

One server (``KVSIDECAR_RESERVE_OUTPUT=1``, SGLang's default overlap loop,
``--chunked-prefill-size`` of ``CHUNK`` tokens: small, so that a prompt lasts long
enough for states to be read inside it). A limit that fits what a long prompt
holds in the middle of its chunks must not say ``applied`` while the rest of the
prompt and its output are still to come: once ``applied``, the memory measured
from ``/proc`` stays under it (docs/limits.md, "Output reservation").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sglang_serve_support import Engine, log_problems, start_engine

pytest.importorskip("sglang", reason="sglang 0.5.23 is installed by scripts/dev.sh")

from engine_ext.cpu_harness import make_document, make_tiny_model_dir

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1200)]

NAME = "sgl-reserve"
CHUNK = 16  # a prompt of 3900 tokens is 244 chunks


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("sglang-reserve")
    model_dir = make_tiny_model_dir(tmp / "model")
    eng = start_engine(
        tmp,
        model_dir,
        NAME,
        {"KVSIDECAR_RESERVE_OUTPUT": "1"},
        ["--chunked-prefill-size", str(CHUNK)],
    )
    try:
        yield eng
    finally:
        eng.server.stop()


Seen = list[tuple[str, int, int]]  # status, reserved bytes, memfd bytes


def _limit_mid_prompt(engine: Engine, prompt: str) -> tuple[int | None, Seen]:
    """Send ``prompt``; once some of its chunks are in, set a limit of what it holds plus
    one page bundle. Returns the limit and, for every state read at that limit that still
    counts the request as running, its status, reserved bytes and the memfd's bytes from
    ``/proc``. (The HTTP reply comes after the request has ended in the scheduler: a state
    read in between is about an idle engine.)"""
    bundle = engine.quiet_state()["page_bundle_bytes"]
    limit: int | None = None
    seen: Seen = []
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(engine.generate, prompt, 64, 300)
        while not long.done():
            state = engine.state()
            if limit is None and state["num_running_requests"] == 1:
                if state["mapped_bytes"] > 2 * bundle:  # some chunks in: what it holds + 1
                    limit = state["mapped_bytes"] + bundle
                    engine.set_limit(limit)
            elif (
                limit is not None
                and state["limit_bytes"] == limit
                and state["num_running_requests"] == 1  # not the state after it ended
            ):
                seen.append((state["status"], state["reserved_bytes"], 0))
                seen[-1] = (*seen[-1][:2], engine.server.kv_memfd_bytes())
            time.sleep(0.01)
        long.result()
    return limit, seen


def test_a_limit_that_fits_a_prompt_mid_chunk_is_not_applied_before_it_ends(
    engine: Engine,
) -> None:
    engine.generate("warm up", 4)
    # On a loaded host the prompt can end before a state at the new limit is read; then
    # there is nothing to judge, and it is tried again with a prompt not in the cache.
    for attempt in range(4):
        limit, seen = _limit_mid_prompt(engine, make_document(3900, seed=77 + attempt))
        if limit is not None and seen:
            break
        engine.flush()
    assert limit is not None and seen, "no state at the limit was read while the prompt ran"
    # what it may still add was reserved: deferred (was: applied at once, reserved 0)
    assert seen[0][0] == "deferred" and seen[0][1] > 0, seen[:3]
    applied = [i for i, (status, _, _) in enumerate(seen) if status == "applied"]
    if applied:  # applied holds: the memory stays under the limit from then on
        assert all(memfd <= limit for _, _, memfd in seen[applied[0] :]), (limit, seen)
    engine.wait_state(engine.set_limit(limit), status="applied")
    assert engine.server.kv_memfd_bytes() <= limit
    engine.wait_state(engine.set_limit(None), status="applied")
    assert log_problems(engine.server.log_text()) == []
