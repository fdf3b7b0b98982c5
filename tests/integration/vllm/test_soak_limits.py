"""Opt-in soak of the foreign-thread limit test: many seeds, several settings.

``KVSIDECAR_SOAK=<first>:<count>`` runs seeds first .. first+count-1 of
:func:`test_engine_core_limits.drive` under each setting below (the default
run skips this file). Same assertions as the default-suite test: no exception,
every request completes or was aborted, tokens identical to the run without
limit changes, ``applied`` only with ``/proc`` under the effective limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.soak import soak_seeds

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from tests.integration.vllm.test_engine_core_limits import (
    assert_same_outcomes,
    build_core,
    drive,
    plugin_env,  # noqa: F401  (the fixture)
)

pytestmark = pytest.mark.vllm

SEEDS = soak_seeds()
if SEEDS is None:
    pytest.skip("opt-in soak: KVSIDECAR_SOAK=<first seed>:<count>", allow_module_level=True)

SETTINGS: dict[str, tuple[dict[str, str], dict[str, int]]] = {  # (environment, build_core)
    "default": ({}, {}),
    "reserve-2": ({"KVSIDECAR_RESERVE_PAGES": "2"}, {}),
    "evict-1": ({"KVSIDECAR_MAX_EVICT_PAGES_PER_STEP": "1"}, {}),
    "reserve-output": ({"KVSIDECAR_RESERVE_OUTPUT": "1"}, {}),
    # prompts in chunks of at most 64 tokens (running requests allocate prefill), and a
    # pool of 16 pages (preemptions under memory pressure, with and without a limit)
    "chunked-small": ({}, {"max_num_batched_tokens": 64, "num_pages": 16, "max_model_len": 512}),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("seed", SEEDS)
def test_soak_limits_from_a_foreign_thread(
    plugin_env: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    setting: str,
) -> None:
    environment, shape = SETTINGS[setting]
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    core = build_core(plugin_env, **shape)
    try:
        baseline = drive(core, seed, num_steps=1500, limits=False, monkeypatch=monkeypatch)
        core.reset_prefix_cache()
        stressed = drive(core, seed, num_steps=1500, limits=True, monkeypatch=monkeypatch)
    finally:
        core.shutdown()
    assert stressed.publishes > 300
    assert_same_outcomes(baseline, stressed, min_compared=100)
