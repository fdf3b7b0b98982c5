"""Opt-in soak of the SGLang foreign-thread limit test: many seeds.

``KVSIDECAR_SOAK=<first>:<count>`` reruns
:func:`test_sglang_adversarial.test_random_limits_from_a_foreign_thread` (both
tree caches, every eviction/reserve setting; plain, with the output
reservation, and with chunked prefill) once per seed; the default run skips
this file.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.soak import soak_seeds

from tests.integration.sglang import test_sglang_adversarial as adversarial

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
