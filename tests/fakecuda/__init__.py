"""The stand-in CUDA driver (``fakecuda.c``): build it, load it, drive its test knobs.

:func:`preload` runs from ``tests/conftest.py`` before any test: where no real
``libcuda.so.1`` can be loaded it builds the stand-in with the system C
compiler (cached under ``$KVSIDECAR_CACHE``, keyed by the source's hash) and
loads it ``RTLD_GLOBAL``, so ``cuda.bindings`` later finds a driver "already
loaded" and ``CudaBackend`` runs over host memory. Where a real driver loads,
the real one is used and :func:`active` returns ``None`` (tests that need the
stand-in's knobs skip). ``KVSIDECAR_FAKECUDA=0`` turns the stand-in off,
``=1`` forces it even next to a real driver.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakecuda.c"
DEFAULT_TOTAL_BYTES = 4096 << 20  # the driver's device size without FAKECUDA_TOTAL_MB
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_LAUNCH_FAILED = 719  # what a real unmap can return after a kernel fault


@dataclass
class FakeCuda:
    """Handle on the loaded stand-in: call counters, fault injection, device total."""

    lib: ctypes.CDLL
    path: Path

    def __post_init__(self) -> None:
        self.lib.fakecuda_fail.argtypes = [
            ctypes.c_char_p,
            ctypes.c_long,
            ctypes.c_long,
            ctypes.c_int,
        ]
        self.lib.fakecuda_calls.argtypes = [ctypes.c_char_p]
        self.lib.fakecuda_calls.restype = ctypes.c_long
        self.lib.fakecuda_used_bytes.restype = ctypes.c_size_t
        self.lib.fakecuda_set_total_bytes.argtypes = [ctypes.c_size_t]
        self.lib.fakecuda_mapped_at.argtypes = [ctypes.c_ulonglong]
        self.lib.fakecuda_primary_refs.argtypes = [ctypes.c_int]
        self.lib.fakecuda_set_granularity.argtypes = [ctypes.c_size_t]
        self.lib.fakecuda_granularity.restype = ctypes.c_size_t
        self.lib.fakecuda_num_events.restype = ctypes.c_long
        self.lib.fakecuda_set_strict_ctx.argtypes = [ctypes.c_int]

    def fail(
        self, name: str, *, after: int = 0, count: int = 1, err: int = CUDA_ERROR_INVALID_VALUE
    ) -> None:
        """Make calls ``after+1 .. after+count`` of ``name`` fail with ``err`` (count -1: all)."""
        if self.lib.fakecuda_fail(name.encode(), after, count, err) != 0:
            raise ValueError(f"fakecuda has no knob for {name!r}")

    def heal(self) -> None:
        """Stop every injected failure."""
        for name in HOOKED:
            self.lib.fakecuda_fail(name.encode(), 0, 0, 1)

    def calls(self, name: str) -> int:
        return int(self.lib.fakecuda_calls(name.encode()))

    def reset_calls(self) -> None:
        self.lib.fakecuda_reset_calls()

    def used_bytes(self) -> int:
        """Bytes held by live physical allocations (every backend in this process)."""
        return int(self.lib.fakecuda_used_bytes())

    def num_mappings(self) -> int:
        return int(self.lib.fakecuda_num_mappings())

    def mapped_at(self, address: int) -> bool:
        """Whether the driver has a mapping covering ``address`` (its state, not a backend's)."""
        return bool(self.lib.fakecuda_mapped_at(address))

    def num_reservations(self) -> int:
        """Live ``cuMemAddressReserve`` ranges (every backend in this process)."""
        return int(self.lib.fakecuda_num_reservations())

    def primary_refs(self, device: int = 0) -> int:
        """How many times ``device``'s primary context is retained and not yet released."""
        return int(self.lib.fakecuda_primary_refs(device))

    def set_strict_ctx(self, on: bool) -> bool:
        """Whether every ``cuMem*`` call needs a current context from now on; the old value."""
        return bool(self.lib.fakecuda_set_strict_ctx(int(on)))

    def current_context(self) -> int:
        """The calling thread's current context (0: none), through cuda-bindings."""
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        if int(err) != 0:
            raise RuntimeError(f"cuCtxGetCurrent failed: {err!r}")
        return int(ctx)

    def num_events(self) -> int:
        """Live ``cuEventCreate`` events (created and not destroyed)."""
        return int(self.lib.fakecuda_num_events())

    def granularity(self) -> int:
        return int(self.lib.fakecuda_granularity())

    def set_granularity(self, granularity: int) -> None:
        """What ``cuMemGetAllocationGranularity`` reports (and the driver checks) from now on."""
        if self.lib.fakecuda_set_granularity(granularity) != 0:
            raise ValueError(f"granularity {granularity} is not a power of two >= 4096")

    def set_total_bytes(self, total: int) -> None:
        if self.lib.fakecuda_set_total_bytes(total) != 0:
            raise ValueError(f"device total {total} is below the bytes in use")


HOOKED = (
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemGetAccess",
    "cuEventRecord",
    "cuEventSynchronize",
)

_loaded: FakeCuda | None = None
_why_not: str = "not loaded yet"


def build(cache: Path | None = None) -> Path:
    """Compile ``libcuda.so.1`` (once per source version); raise RuntimeError without a compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(
            "no C compiler (cc/gcc) to build the stand-in CUDA driver; install "
            "gcc or run on a machine with an NVIDIA driver"
        )
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    root = cache or Path(os.environ.get("KVSIDECAR_CACHE", Path.home() / ".cache" / "kvsidecar"))
    out = root / f"fakecuda-{digest}" / "libcuda.so.1"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # atomic: parallel runs race
        built = Path(tmp) / "libcuda.so.1"
        subprocess.run(
            [
                compiler,
                "-O2",
                "-Wall",
                "-shared",
                "-fPIC",
                "-Wl,-soname,libcuda.so.1",
                "-o",
                str(built),
                str(SOURCE),
                "-lpthread",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, out)
    return out


def _real_driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def preload() -> FakeCuda | None:
    """Load the stand-in unless a real driver is here (see the module docstring)."""
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    mode = os.environ.get("KVSIDECAR_FAKECUDA", "auto")
    if mode == "0":
        _why_not = "the stand-in CUDA driver is off (KVSIDECAR_FAKECUDA=0)"
        return None
    if mode != "1" and _real_driver_loads():
        _why_not = "a real CUDA driver is loaded (the stand-in's knobs are not available)"
        return None
    try:
        path = build()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        _why_not = f"could not build the stand-in CUDA driver: {detail}"
        return None
    _loaded = FakeCuda(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL), path)
    return _loaded


def active() -> FakeCuda | None:
    """The loaded stand-in, or ``None`` (then :func:`why_not` says why)."""
    return _loaded


def why_not() -> str:
    return _why_not


def host_view(address: int, length: int) -> Any:
    """A CPU ``torch.uint8`` tensor over stand-in device memory (its memory is host memory).

    What a CUDA view is on a GPU; touching an unmapped page is a SIGSEGV here
    (an illegal-address fault there), so view only mapped pages.
    """
    import torch

    buffer = (ctypes.c_uint8 * length).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)
