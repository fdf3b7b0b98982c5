"""Engines name their device themselves (docs/autopilot.md, "Devices").

Without ``KVSIDECAR_DEVICE_ID`` an engine registers on the device its pool's backend
is on: the CUDA device's UUID (the stand-in driver, tests/fakecuda, plays the GPU),
or ``host-<hostname>`` on the host backend. Engines on one device land on one device
in the real sidecar with nothing set; an explicit setting still wins.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import fakecuda
import httpx
import pytest
from engine_pool import BLOCKS_PER_PAGE, Pool, PrefixCache

from allocator import (
    BlockAllocator,
    CudaBackend,
    FencedBackend,
    HostBackend,
    PageAllocator,
    PageLayout,
    ThreadGuard,
    UnmapFence,
)
from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
from engine_ext._device_id import derive_device_id, host_device_id
from engine_ext.protocol import DEVICE_ID_PATTERN

MiB = 1 << 20
UUID_RE = r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
FAKE_UUID0 = "GPU-fa4ec0da-0000-4000-8000-000000000000"  # tests/fakecuda: ordinal 0


@pytest.fixture(autouse=True)
def _no_device_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSIDECAR_DEVICE_ID", raising=False)


def _instance(
    iid: str, blocks: BlockAllocator, url: str, tmp_path: Path, **settings: object
) -> ElasticInstance:
    conf = load_engine_settings(
        instance_id=iid, sidecar_url=url, runtime_dir=tmp_path / "rt", heartbeat_s=0.2, **settings
    )
    return ElasticInstance(conf, EngineBinding("vllm", "0.33.0", blocks, (PrefixCache(blocks),)))


def _device_members(url: str, device: str) -> list[str]:
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.get(f"/devices/{device}")
        assert r.status_code == 200, (r.status_code, r.text, c.get("/devices").text)
        return sorted(m["id"] for m in r.json()["instances"])


def _start_all(instances: list[ElasticInstance]) -> None:
    for inst in instances:
        inst.start()  # registers before it returns


# ------------------------------------------------------------------------- host backend
def test_host_engines_register_on_the_host_device_with_nothing_set(
    tmp_path: Path, sidecar_url: str
) -> None:
    pools = []
    instances = []
    try:
        for iid in ("h1", "h2"):
            layout = PageLayout(page_bytes=64 * 1024, num_pages=4, num_regions=2)
            backend = HostBackend.reserve(layout, name=f"devid-{iid}")
            pages = PageAllocator(backend, guard=ThreadGuard(f"pool-{iid}"))
            pools.append(backend)
            instances.append(
                _instance(iid, BlockAllocator(pages, BLOCKS_PER_PAGE), sidecar_url, tmp_path)
            )
        expected = f"host-{socket.gethostname()}"
        assert [i.device_id for i in instances] == [expected, expected]
        _start_all(instances)
        assert _device_members(sidecar_url, expected) == ["h1", "h2"]
    finally:
        for inst in instances:
            inst.close()
        for backend in pools:
            backend.release()


def test_the_setting_wins_over_the_derived_device(
    pool: Pool, tmp_path: Path, sidecar_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIDECAR_DEVICE_ID", "node1-gpu3")
    inst = _instance("set", pool.blocks, sidecar_url, tmp_path)
    try:
        assert inst.device_id == "node1-gpu3"
        inst.start()
        assert _device_members(sidecar_url, "node1-gpu3") == ["set"]
        with httpx.Client(base_url=sidecar_url, timeout=30) as c:
            assert c.get(f"/devices/{host_device_id()}").status_code == 404  # not derived
    finally:
        inst.close()


def test_the_adapters_device_wins_over_the_derived_one(pool: Pool, tmp_path: Path) -> None:
    conf = load_engine_settings(instance_id="adp", runtime_dir=tmp_path / "rt")
    inst = ElasticInstance(
        conf, EngineBinding("vllm", "0.33.0", pool.blocks, device_id="node2-gpu0")
    )
    try:
        assert inst.device_id == "node2-gpu0"
    finally:
        inst.close()


@pytest.mark.parametrize(
    "hostname", ["gpu-node-7.cluster.local", "wéird host/name", "", "x" * 300, "-leading", "a:b_c"]
)
def test_any_hostname_gives_a_valid_device_id(hostname: str) -> None:
    device = host_device_id(hostname)
    assert re.match(DEVICE_ID_PATTERN, device), device
    assert device.startswith("host-")


def test_an_unknown_backend_is_on_no_device(tmp_path: Path) -> None:
    class Opaque:  # a backend the core does not know and that wraps nothing
        inner = None

    assert derive_device_id(Opaque()) is None
    assert derive_device_id(object()) is None


# ------------------------------------------------------------- CUDA (the GPU-only path)
@pytest.fixture
def cuda_backends(fc: fakecuda.FakeCuda) -> Iterator[list[CudaBackend]]:
    made: list[CudaBackend] = []
    yield made
    for backend in made:
        backend.release()


def test_cuda_uuid_as_nvidia_smi_prints_it(cuda_backends: list[CudaBackend]) -> None:
    backend = CudaBackend.reserve(PageLayout(2 * MiB, 4, 2))
    cuda_backends.append(backend)
    uuid = backend.device_uuid()
    assert re.match(UUID_RE, uuid) and re.match(DEVICE_ID_PATTERN, uuid)
    assert uuid == FAKE_UUID0
    # unwrapped through the fence a GPU pool puts around it
    fenced = FencedBackend(backend, UnmapFence(lambda: None, lambda: None))  # type: ignore[arg-type]
    assert derive_device_id(fenced) == uuid


def test_cuda_engines_on_one_gpu_share_one_device_with_nothing_set(
    cuda_backends: list[CudaBackend], tmp_path: Path, sidecar_url: str
) -> None:
    instances = []
    try:
        for iid in ("g1", "g2"):
            backend = CudaBackend.reserve(PageLayout(2 * MiB, 4, 2))
            cuda_backends.append(backend)
            pages = PageAllocator(backend, guard=ThreadGuard(f"pool-{iid}"))
            instances.append(
                _instance(iid, BlockAllocator(pages, BLOCKS_PER_PAGE), sidecar_url, tmp_path)
            )
        _start_all(instances)
        assert {i.device_id for i in instances} == {FAKE_UUID0}
        assert _device_members(sidecar_url, FAKE_UUID0) == ["g1", "g2"]
    finally:
        for inst in instances:
            inst.close()
