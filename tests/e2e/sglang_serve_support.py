"""Helpers shared by the tests that run SGLang's real server on CPU (``test_sglang_serve*.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support.control import ControlSocket

from engine_ext.cpu_harness import SglangServer, launch_sglang_server

#: KV capacity of the test servers, in tokens (virtual: pages are mapped on demand).
MAX_TOTAL_TOKENS = 32768


@dataclass
class Engine(ControlSocket):
    """One SGLang server and its kvsidecar control socket."""

    state_timeout_s = 30.0  # SGLang's passes run between its (slower) scheduler iterations
    server: SglangServer
    runtime_dir: Path
    name: str

    @property
    def instance_dir(self) -> Path:
        return self.runtime_dir / self.name

    @property
    def socket_path(self) -> Path:
        return self.instance_dir / "control.sock"

    def quiet_state(self) -> dict[str, Any]:
        """The state once the scheduler has settled (no pass for a while): a baseline."""
        state = self.state()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.3)
            again = self.state()
            if (
                again["passes"] == state["passes"]
                and again["mapped_bytes"] == state["mapped_bytes"]
            ):
                return again
            state = again
        raise AssertionError(f"the scheduler never settled: {state}")

    def generate(self, text: str, max_new_tokens: int = 8, timeout_s: float = 120) -> Any:
        """SGLang's native ``/generate``; returns ``(output_ids, meta_info)``."""
        response = httpx.post(
            self.server.base_url + "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
            },
            timeout=timeout_s,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        return body["output_ids"], body["meta_info"]

    def complete(self, prompt: str, max_tokens: int = 8, timeout_s: float = 120) -> Any:
        """The OpenAI ``/v1/completions``."""
        response = httpx.post(
            self.server.base_url + "/v1/completions",
            json={"model": self.name, "prompt": prompt, "max_tokens": max_tokens},
            timeout=timeout_s,
        )
        assert response.status_code == 200, response.text
        return response.json()

    def flush(self) -> None:
        """Unlimited again and an empty prefix cache (SGLang's ``/flush_cache``)."""
        revision = self.set_limit(None)
        self.wait_state(revision, status="applied")
        deadline = time.monotonic() + 30
        while True:  # refused while requests are still finishing
            response = httpx.post(self.server.base_url + "/flush_cache", timeout=30)
            if response.status_code == 200:
                break
            assert time.monotonic() < deadline, response.text
            time.sleep(0.2)

    def halve_while_paused(self, mode: str) -> int:
        """Pause generation (``/pause_generation``, ``mode`` in_place or retract), set a limit
        of half the settled mapped bytes, require it ``applied`` with the memfd at or under
        it while still paused, then continue; returns the limit. Paused, SGLang's loops skip
        ``get_next_batch_to_run`` and ``on_idle``: the limit must not wait for
        ``/continue_generation``."""
        limit = int(self.quiet_state()["mapped_bytes"]) // 2
        self._post("/pause_generation", {"mode": mode})
        try:
            revision = self.set_limit(limit)
            paused = self.wait_state(revision, status="applied")
            assert paused["mapped_bytes"] <= limit and self.server.kv_memfd_bytes() <= limit
        finally:
            self._post("/continue_generation", {})
        return limit

    def _post(self, path: str, body: dict[str, Any]) -> None:
        response = httpx.post(self.server.base_url + path, json=body, timeout=60)
        assert response.status_code == 200, response.text

    def results(self, futures: list[Any], timeout_s: float = 150) -> list[Any]:
        """The ``generate`` futures' output ids; a request still waiting after ``timeout_s``
        fails with the states seen while waiting (what the status said about it).

        Give the requests an HTTP timeout a little above ``timeout_s``: the executor
        that runs them waits for them on its way out, after this has failed."""
        from concurrent.futures import wait

        deadline = time.monotonic() + timeout_s
        seen: list[dict[str, Any]] = []
        while True:
            _done, pending = wait(futures, timeout=2.0)
            if not pending:
                return [f.result()[0] for f in futures]
            state = self.state()
            seen.append({k: v for k, v in state.items() if k != "ranks"})
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(pending)} of {len(futures)} requests still waiting after "
                    f"{timeout_s:.0f} s; states seen meanwhile (last 5): {seen[-5:]}"
                )

    def healthy(self) -> bool:
        return httpx.get(self.server.base_url + "/health", timeout=10).status_code == 200


def start_engine(
    tmp: Path, model_dir: Path, name: str, env: dict[str, str], extra_args: list[str]
) -> Engine:
    runtime_dir = tmp / "run"
    server = launch_sglang_server(
        model_dir,
        env={
            "KVSIDECAR_THREAD_GUARD": "1",
            "KVSIDECAR_INSTANCE_ID": name,
            "KVSIDECAR_RUNTIME_DIR": str(runtime_dir),
            **env,
        },
        extra_args=["--served-model-name", name, *extra_args],
        log_path=tmp / f"{name}.log",
        max_total_tokens=MAX_TOTAL_TOKENS,
        timeout_s=900,
    )
    return Engine(server, runtime_dir, name)


def log_problems(log: str) -> list[str]:
    """Lines of a server log that mean the extension broke SGLang.

    One traceback is SGLang's own and harmless: after its warm-up the HTTP
    server posts ``/freeze_gc`` to itself (a GC tuning), and when that post
    fails it logs ``post-warmup freeze_gc failed`` with the traceback and
    serves on. That block (up to the next timestamped line) is not counted.
    """
    needles = (
        "Prefill out of memory",
        "Traceback",
        "ForeignThreadError",
        "memory leak",
        "Scheduler hit an exception",
        "without a tracked tree event",  # the evictable counts missed an SGLang path
    )
    problems: list[str] = []
    in_freeze_gc_warning = False
    for line in log.splitlines():
        if line.startswith("[20"):  # a timestamped line ends the previous message
            in_freeze_gc_warning = "post-warmup freeze_gc failed" in line
            if in_freeze_gc_warning:
                continue
        if not in_freeze_gc_warning and any(n in line for n in needles):
            problems.append(line)
    return problems
