"""Opt-in soak of the SGLang foreign-thread limit test: many seeds.

``KVSIDECAR_SOAK=<first>:<count>`` reruns
:func:`test_sglang_adversarial.test_random_limits_from_a_foreign_thread` (both
tree caches, every eviction/reserve setting; plain, with the output
reservation, and with chunked prefill) and
:func:`test_sglang_overlap.run_storm` (every case of the overlap-loop storm, on the
simulated device) once per seed; the default run skips this file.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.soak import soak_seeds

from tests.integration.sglang import test_sglang_adversarial as adversarial
from tests.integration.sglang import test_sglang_overlap as overlap

pytestmark = pytest.mark.sglang

SEEDS = soak_seeds()
if SEEDS is None:
    pytest.skip("opt-in soak: KVSIDECAR_SOAK=<first seed>:<count>", allow_module_level=True)


@pytest.mark.parametrize(
    ("max_evict", "reserve"),
    [(1, 0), (None, 0), (1, 3)],
    ids=["evict1", "evict-all", "evict1-reserve3"],
)
@pytest.mark.parametrize(
    "extra",
    [{}, {"reserve_output": True}, {"chunked_prefill_size": 32}],
    ids=["plain", "reserve-output", "chunked"],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_soak_random_limits(
    make_harness: adversarial.Make,
    cache_kind: str,
    max_evict: int | None,
    reserve: int,
    extra: dict[str, Any],
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adversarial, "SEED", seed)

    def make(*args: Any, **kwargs: Any) -> Any:  # both runs (reference and limited) alike
        return make_harness(*args, **{**extra, **kwargs})

    adversarial.test_random_limits_from_a_foreign_thread(make, cache_kind, max_evict, reserve)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("completion", "full_device", "extra"),
    [(c, f, e) for c, f, _, e in overlap.CASES],
    ids=overlap.CASE_IDS,
)
def test_soak_overlap_storm(
    make_harness: overlap.Make,
    cache_kind: str,
    monkeypatch: pytest.MonkeyPatch,
    completion: str,
    full_device: bool,
    extra: dict[str, Any],
    seed: int,
) -> None:
    # the outcome only: what the chaos reached varies with the seed
    overlap.run_storm(make_harness, cache_kind, monkeypatch, completion, full_device, seed, extra)
