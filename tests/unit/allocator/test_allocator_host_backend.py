"""HostBackend against the OS: what it maps is what /proc and fstat see."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from allocator import AllocatorConfigError, AllocatorContractError, HostBackend, PageLayout

MakeHost = Callable[..., HostBackend]
OS_PAGE = mmap.PAGESIZE
REPO = Path(__file__).resolve().parents[3]


def memfd_blocks_bytes(backend: HostBackend) -> int:
    """Committed bytes of the memfd as the kernel reports them (independent of the backend)."""
    return os.stat(f"/proc/self/fd/{backend.fd}").st_blocks * 512


def rss_shmem_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def touch(backend: HostBackend, page: int) -> None:
    """Write one byte into every OS page of ``page`` in every region (faults them in)."""
    layout = backend.layout
    for region in range(layout.num_regions):
        start = backend.base_address + layout.page_offset(region, page)
        for offset in range(0, layout.page_bytes, OS_PAGE):
            ctypes.c_uint8.from_address(start + offset).value = 1


def test_mapping_n_pages_commits_n_pages_and_unmapping_returns_them(make_host: MakeHost) -> None:
    backend = make_host(page_os_pages=4, num_pages=16, num_regions=3)
    bundle = backend.layout.bundle_bytes
    assert memfd_blocks_bytes(backend) == 0
    backend.map_many([0, 1, 2, 7, 9])
    backend.map(12)
    assert memfd_blocks_bytes(backend) == 6 * bundle
    assert backend.mapped_bytes() == memfd_blocks_bytes(backend)
    backend.unmap_many([1, 9])
    backend.unmap(12)
    assert memfd_blocks_bytes(backend) == 3 * bundle
    backend.unmap_many([0, 2, 7])
    assert memfd_blocks_bytes(backend) == 0


def test_process_rss_shmem_follows_map_and_unmap(make_host: MakeHost) -> None:
    pages = 64  # 64 x 64 KiB = 4 MiB: far above the noise of the interpreter
    backend = make_host(page_os_pages=16, num_pages=pages)
    before = rss_shmem_bytes()
    backend.map_many(range(pages))
    for page in range(pages):
        touch(backend, page)
    grown = rss_shmem_bytes() - before
    assert grown >= pages * backend.layout.page_bytes * 0.95
    backend.unmap_many(list(range(pages)))
    assert rss_shmem_bytes() - before <= pages * backend.layout.page_bytes * 0.05


def test_data_survives_while_mapped_and_a_remapped_page_reads_zeros(make_host: MakeHost) -> None:
    backend = make_host(page_os_pages=2, num_pages=4, num_regions=2)
    layout = backend.layout
    backend.map_many([1, 2])
    addr = backend.base_address + layout.page_offset(1, 2)
    ctypes.memset(addr, 0xAB, layout.page_bytes)
    backend.map(3)
    backend.unmap(1)  # neighbours change; page 2 keeps its bytes
    assert ctypes.string_at(addr, layout.page_bytes) == b"\xab" * layout.page_bytes
    backend.unmap(2)
    backend.map(2)
    assert ctypes.string_at(addr, layout.page_bytes) == bytes(layout.page_bytes)


def test_tensor_view_writes_land_in_the_page(make_host: MakeHost) -> None:
    torch = pytest.importorskip("torch")
    backend = make_host(page_os_pages=1, num_pages=4, num_regions=2)
    layout = backend.layout
    backend.map(3)
    whole = backend.tensor()
    region1 = backend.tensor(1)
    assert whole.dtype == torch.uint8 and whole.numel() == layout.total_bytes
    assert region1.numel() == layout.region_bytes
    region1[3 * layout.page_bytes : 4 * layout.page_bytes] = 42
    addr = backend.base_address + layout.page_offset(1, 3)
    assert ctypes.string_at(addr, layout.page_bytes) == b"\x2a" * layout.page_bytes
    offset = layout.page_offset(0, 3)
    whole[offset] = 7
    assert ctypes.c_uint8.from_address(backend.base_address + offset).value == 7
    assert memfd_blocks_bytes(backend) == layout.bundle_bytes
    with pytest.raises(AllocatorContractError, match="region 2"):
        backend.tensor(2)


def test_second_process_attaches_and_shares_the_pages(make_host: MakeHost) -> None:
    backend = make_host(page_os_pages=1, num_pages=4, num_regions=2)
    layout = backend.layout
    backend.map(2)
    ctypes.memset(backend.base_address + layout.page_offset(1, 2), 0x5A, 16)
    child = textwrap.dedent(f"""
        import ctypes, sys
        from allocator import HostBackend, PageLayout
        layout = PageLayout({layout.page_bytes}, {layout.num_pages}, {layout.num_regions})
        peer = HostBackend.attach(layout, sys.argv[1])
        peer.map(2)
        seen = ctypes.string_at(peer.base_address + layout.page_offset(1, 2), 16)
        ctypes.memset(peer.base_address + layout.page_offset(0, 2), 0x33, 8)
        peer.unmap(2)
        peer.release()
        print(seen.hex())
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", child, backend.fd_path],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5a" * 16
    # The child's write is in our page, and its unmap did not free our memory.
    assert ctypes.string_at(backend.base_address + layout.page_offset(0, 2), 8) == b"\x33" * 8
    assert memfd_blocks_bytes(backend) == layout.bundle_bytes


def test_attach_with_a_different_layout_is_refused(make_host: MakeHost) -> None:
    backend = make_host(page_os_pages=1, num_pages=4)
    wrong = PageLayout(OS_PAGE, 8)
    with pytest.raises(AllocatorConfigError, match="exact PageLayout"):
        HostBackend.attach(wrong, backend.fd_path)


def test_page_size_must_be_a_multiple_of_the_os_page() -> None:
    with pytest.raises(AllocatorConfigError, match=f"multiple of {OS_PAGE}") as info:
        HostBackend.reserve(PageLayout(OS_PAGE + 100, 4))
    assert f"{OS_PAGE} or {2 * OS_PAGE}" in str(info.value)


def test_release_returns_everything_and_is_idempotent() -> None:
    backend = HostBackend.reserve(PageLayout(OS_PAGE, 8, 2))
    backend.map_many([0, 1, 5])
    fd = backend.fd
    backend.release()
    backend.release()
    assert backend.mapped_bytes() == 0
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (nothing else opened an fd in between)
    with pytest.raises(AllocatorContractError, match="released"):
        backend.map(0)


def test_a_dropped_backend_gives_everything_back_but_not_under_a_live_tensor() -> None:
    pytest.importorskip("torch")
    backend = HostBackend.reserve(PageLayout(OS_PAGE, 4))
    fd = os.dup(backend.fd)  # our own handle on the memfd, to measure it afterwards
    try:
        backend.map(1)
        view = backend.tensor()[OS_PAGE : 2 * OS_PAGE]
        view.fill_(3)
        del backend
        gc.collect()
        assert int(view.sum()) == 3 * OS_PAGE  # the tensor kept the backend alive
        assert os.fstat(fd).st_blocks * 512 == OS_PAGE
        del view
        gc.collect()
        assert os.fstat(fd).st_blocks == 0  # memory punched out, range and fd released
    finally:
        os.close(fd)


def test_a_memfd_the_os_will_not_size_is_a_backend_error() -> None:
    """Under a file size limit (RLIMIT_FSIZE) the memfd cannot be sized: a BackendError
    that names the limit, not a raw OSError (in a child: the limit is per process)."""
    code = (
        "import mmap, resource\n"
        "from allocator import BackendError, HostBackend, PageLayout\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    HostBackend.reserve(PageLayout(mmap.PAGESIZE, 1024))\n"
        "except BackendError as exc:\n"
        "    print('BackendError', exc)\n"
    )
    out = _in_a_child(code)
    assert out.startswith("BackendError") and "ulimit -f" in out


def test_a_reservation_over_the_address_space_limit_says_which_limit() -> None:
    """Under an address-space limit (ulimit -v, RLIMIT_AS: batch schedulers set it) the
    reservation's mmap fails with ENOMEM, which read as "Cannot allocate memory" for a
    reservation that takes no memory at all. The error names the limit, its value and
    what to do (in a child: the limit is per process)."""
    code = (
        "import resource\n"
        "from allocator import BackendError, HostBackend, PageLayout\n"
        "with open('/proc/self/status') as status:\n"
        "    vm = [int(l.split()[1]) for l in status if l.startswith('VmSize:')][0] << 10\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    HostBackend.reserve(PageLayout(1 << 21, 4096))  # 8 GiB of address space\n"
        "except BackendError as exc:\n"
        "    print('BackendError', exc.errno, exc)\n"
    )
    out = _in_a_child(code)
    assert out.startswith("BackendError 12 "), out
    assert "ulimit -v" in out and "KVSIDECAR_VIRTUAL_KV_BYTES" in out


def _in_a_child(code: str) -> str:
    """Run ``code`` in a child interpreter at the repository root (a resource limit set
    there is the child's alone); its stdout, once it exited 0."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout
