"""SGLang's real server with its default ``event_loop_overlap`` and ``--sleep-on-idle``, on CPU.

One server for the module (the same harness as ``test_sglang_serve.py``, which
runs ``event_loop_normal``), with chunked prefill of ``CHUNK`` tokens, so the
long prompts here are prefilled in chunks: every continuation goes through
the budget's ``fit_chunk`` (its pages taken there; above a lowered limit in
the traffic test), in the loop where a chunk may still be in flight. With ``--sleep-on-idle`` the scheduler parks in
SGLang's ``IdleSleeper`` between requests; a limit published over the control
socket wakes it. The module ends with SIGINT to the whole process group (a
Ctrl-C in the terminal), which must leave no control socket and no owner
file behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sglang_serve_support import Engine, log_problems, start_engine
from support import wait_until

pytest.importorskip("sglang", reason="sglang 0.5.23 is installed by scripts/dev.sh")

from engine_ext.cpu_harness import make_document, make_tiny_model_dir

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1200)]

NAME = "sgl-overlap"
DOC = make_document(500, seed=5)
CHUNK = 128  # --chunked-prefill-size: DOC is prefilled in 4 chunks


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("sglang-overlap")
    model_dir = make_tiny_model_dir(tmp / "model")
    started = time.monotonic()
    eng = start_engine(
        tmp, model_dir, NAME, {}, ["--sleep-on-idle", "--chunked-prefill-size", str(CHUNK)]
    )
    print(f"\nSGLang server (overlap loop) healthy after {time.monotonic() - started:.0f} s")
    try:
        yield eng
    finally:
        eng.server.stop()


def test_the_overlap_loop_serves_with_the_extension(engine: Engine) -> None:
    info = httpx.get(engine.server.base_url + "/server_info", timeout=30).json()
    assert info["disable_overlap_schedule"] is False and info["sleep_on_idle"] is True
    assert info["chunked_prefill_size"] == CHUNK
    first, meta = engine.generate(f"{DOC} overlap", max_new_tokens=16)
    again, meta_again = engine.generate(f"{DOC} overlap", max_new_tokens=16)
    assert first == again and len(first) == 16
    assert meta["cached_tokens"] == 0 and meta_again["cached_tokens"] > 0
    assert engine.state()["mapped_bytes"] == engine.server.kv_memfd_bytes() > 0


def test_limit_published_while_sleeping_applies_then_holds_under_traffic(engine: Engine) -> None:
    engine.flush()
    prompts = [f"{DOC} {i}" for i in range(6)] + [make_document(120, seed=50 + i) for i in range(6)]
    reference = [engine.generate(p, max_new_tokens=12)[0] for p in prompts]
    full = engine.quiet_state()  # the scheduler sleeps in IdleSleeper now
    limit = full["mapped_bytes"] // 2
    revision = engine.set_limit(limit)
    applied = engine.wait_state(revision, status="applied")
    assert applied["mapped_bytes"] == engine.server.kv_memfd_bytes() <= limit
    with ThreadPoolExecutor(8) as pool:
        outputs = engine.results([pool.submit(engine.generate, p, 12, 180) for p in prompts])
    assert outputs == reference  # the overlap loop under a limit: same tokens
    after = engine.quiet_state()
    assert after["status"] == "applied" and after["mapped_bytes"] == engine.server.kv_memfd_bytes()
    assert after["mapped_bytes"] <= limit


def test_limit_lowered_under_traffic_defers_then_applies(engine: Engine) -> None:
    """A limit two bundles under the warm cache lands while requests run.

    Admitted requests finish above it if they must; it is ``applied`` once they
    have. A request still waiting then may not fit at all: its whole sequence
    (the cached document it would lock, its tail and its 48 tokens) can need
    more than the limit holds. It must then wait with the state saying so, not
    silently, and start once the limit is raised. Which requests are admitted
    before the limit lands is the machine's timing (on a fresh CI machine
    some were not: that run timed out here), so both outcomes are checked.
    """
    engine.flush()
    prompts = [f"{DOC} running {i}" for i in range(10)]
    reference = [engine.generate(p, max_new_tokens=48)[0] for p in prompts]
    warm = engine.quiet_state()
    bundle = warm["page_bundle_bytes"]
    limit = warm["mapped_bytes"] - 2 * bundle
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(engine.generate, p, 48, 180) for p in prompts]
        # the limit lands while requests run (on a quick machine all ten can finish
        # between two reads of the state: a CI run never saw 4 running at once)
        wait_until(
            lambda: engine.state()["num_running_requests"] >= 1 or all(f.done() for f in futures),
            timeout_s=60,
            period_s=0.005,
            what="requests running in the overlap loop",
        )
        revision = engine.set_limit(limit)

        def settled() -> bool:  # every request done, or only requests the limit keeps out
            state = engine.state()
            return all(f.done() for f in futures) or (
                state["num_running_requests"] == 0
                and state["num_waiting_requests"] > 0
                and state["waiting_reason"] == "waiting_for_memory"
            )

        wait_until(settled, timeout_s=150, what="the running requests to finish")
        applied = engine.wait_state(revision, status="applied")
        assert applied["mapped_bytes"] == engine.server.kv_memfd_bytes() <= limit
        pending = sum(not f.done() for f in futures)
        if pending:  # they wait, the state says so and what they need; raised, they start
            state = engine.state()
            if state["num_waiting_requests"]:
                assert state["waiting_reason"] == "waiting_for_memory", state
                assert state["waiting_bytes"] > limit - state["mapped_bytes"], state
            engine.set_limit(None)
        outputs = engine.results(futures)
    assert outputs == reference
    print(f"\n{pending} of {len(futures)} requests waited for the limit to be raised")


def test_limit_lowered_while_generation_is_paused_applies_in_the_overlap_loop(
    engine: Engine,
) -> None:
    """``/pause_generation`` (in_place) stops ``event_loop_overlap`` before
    ``get_next_batch_to_run`` and ``on_idle`` too: the limit is taken while paused."""
    engine.flush()
    prompts = [f"{DOC} paused {i}" for i in range(4)]
    reference = [engine.generate(p, max_new_tokens=8)[0] for p in prompts]
    engine.halve_while_paused("in_place")
    # (under half the cache a 500-token document no longer fits: unlimited again first)
    engine.wait_state(engine.set_limit(None), status="applied")
    with ThreadPoolExecutor(4) as pool:
        assert engine.results([pool.submit(engine.generate, p, 8, 180) for p in prompts]) == (
            reference
        )


LONG = make_document(3800, seed=9)  # 30 chunks of CHUNK tokens (a few ms each here)
ALONE = [make_document(3900, seed=10 + i) for i in range(8)]  # 31 chunks each


def _left_mid_prefill(engine: Engine, text: str, leave_after_s: float) -> str:
    """A streamed ``/generate`` whose client goes away when no token came within
    ``leave_after_s`` (the prompt is still being prefilled, chunk by chunk, or waits for
    its turn): SGLang aborts it. "streamed" if a token came first."""
    deadline = time.monotonic() + leave_after_s
    try:
        with httpx.stream(
            "POST",
            engine.server.base_url + "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True,
            },
            timeout=leave_after_s,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("output_ids"):
                    return "streamed"  # a token came first: the prefill was over
                if time.monotonic() > deadline:
                    return "left"
    except httpx.TimeoutException:
        return "left"
    return "finished"


def test_long_prompts_left_mid_prefill_while_limits_arrive(engine: Engine) -> None:
    """Long prompts (prefilled in chunks) whose clients leave mid-prefill, some over the
    stashed chunks of the ones left before, while limits 0, one page bundle, just below
    what is mapped and a random one arrive over the control socket (the sidecar's
    path), then a limit the requests kept can run under. The server keeps serving (the
    kept requests' tokens are those of an unlimited run); once the requests ended the
    memory measured from ``/proc`` is at or under each limit set afterwards; while a
    long prompt is prefilled alone the state counts it as running."""
    # how long one such prefill takes here, alone (a text of the same length that none of
    # the storm's prompts shares): the clients leave at fractions of it, so that at least
    # the five with prompts of their own leave before a token however fast the host is
    started = time.monotonic()
    engine.generate(make_document(3800, seed=99), max_new_tokens=1)
    prefill_s = time.monotonic() - started
    engine.flush()
    kept = [f"{DOC} kept {i}" for i in range(4)]
    reference = [engine.generate(p, max_new_tokens=8)[0] for p in kept]
    warm = engine.quiet_state()
    bundle = warm["page_bundle_bytes"]

    rng = random.Random(9)
    limits = [0, bundle, warm["mapped_bytes"] - bundle - 1, rng.randrange(2, 40) * bundle]
    with ThreadPoolExecutor(16) as pool:
        left = [
            pool.submit(_left_mid_prefill, engine, text, prefill_s * (0.05 + 0.09 * i))
            for i, text in enumerate(
                [f"{LONG} {i}" for i in range(5)] + [f"{i} {LONG}" for i in range(5)]
            )
        ]
        futures = [pool.submit(engine.generate, p, 8, 300) for p in kept]
        for limit in limits:
            engine.set_limit(limit)
            time.sleep(0.3)
        engine.set_limit(warm["mapped_bytes"] + 64 * bundle)  # the kept requests fit
        outcomes = [f.result() for f in left]
        assert engine.results(futures, timeout_s=240) == reference
    print(
        f"\nclients that left before a token: {outcomes.count('left')} of {len(outcomes)} "
        f"(one prefill alone: {prefill_s * 1000:.0f} ms)"
    )
    assert outcomes.count("left") >= 5, outcomes  # (one prompt is prefilled at a time)
    assert engine.healthy()
    for limit in (warm["mapped_bytes"] // 2, bundle, 0):
        revision = engine.set_limit(limit)
        applied = engine.wait_state(revision, status="applied")
        measured = engine.server.kv_memfd_bytes()
        assert applied["mapped_bytes"] == measured <= limit, (applied, measured)
    engine.wait_state(engine.set_limit(None), status="applied")
    assert engine.generate(kept[0], max_new_tokens=8)[0] == reference[0]
    # eight at once, one prefilled in chunks at a time: the state counts it as running
    with ThreadPoolExecutor(8) as pool:
        alone = [pool.submit(engine.generate, text, 1, 300) for text in ALONE]
        seen: list[tuple[int, int]] = []
        while not all(f.done() for f in alone):
            state = engine.state()
            seen.append((state["num_running_requests"], state["num_waiting_requests"]))
            time.sleep(0.005)
        engine.results(alone, timeout_s=240)
    queued = [s for s in seen if s[1] >= 1]  # one chunked (or just done), the others wait
    counted = [s for s in queued if s[0] == 1]
    print(
        f"states with requests queued behind a chunked one: {len(queued)}, counted {len(counted)}"
    )
    assert len(counted) >= 3 and 2 * len(counted) >= len(queued), seen  # was (0, 2), (0, 1)
    assert [p for p in log_problems(engine.server.log_text()) if "Traceback" not in p] == []


def test_zz_sigint_to_the_process_group_removes_socket_and_owner_file(engine: Engine) -> None:
    """Last in the module: Ctrl-C (SIGINT to every process of the group)."""
    assert engine.socket_path.exists() and (engine.instance_dir / ".owner").exists()
    pids = engine.server.pids()
    os.killpg(engine.server.proc.pid, signal.SIGINT)
    engine.server.proc.wait(timeout=120)
    wait_until(
        lambda: not any(os.path.exists(f"/proc/{p}/fd") for p in pids),
        timeout_s=60,
        what="every SGLang process exited",
    )
    assert not engine.instance_dir.exists(), sorted(p.name for p in engine.instance_dir.iterdir())
    assert [p for p in log_problems(engine.server.log_text()) if "Traceback" not in p] == []
