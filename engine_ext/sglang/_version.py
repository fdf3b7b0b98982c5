"""Which SGLang this adapter supports, and the check that refuses any other.

Every patch names the version range it was written for (``_patches.PATCHES``);
:data:`SUPPORTED` is the range all of them cover. A version outside it, or
SGLang missing, stops start-up with the range in the message: an
unsupported engine never boots half-patched.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .._errors import EngineExtConfigError

__all__ = ["SUPPORTED", "check_version", "installed_sglang_version"]

#: SGLang versions this adapter was written and tested against.
SUPPORTED = SpecifierSet("==0.5.23")


def installed_sglang_version() -> str:
    """The installed ``sglang`` distribution's version; a config error if it is missing."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise EngineExtConfigError(
            f"kvsidecar's SGLang adapter needs sglang{SUPPORTED} installed; it is not"
        ) from None


def check_version(version: str, supported: SpecifierSet = SUPPORTED) -> Version:
    """Parse ``version`` and refuse it unless it is in ``supported``."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise EngineExtConfigError(
            f"cannot read SGLang version {version!r}; kvsidecar supports sglang{supported}"
        ) from None
    if not supported.contains(parsed, prereleases=True):
        raise EngineExtConfigError(
            f"SGLang {version} is not supported by this kvsidecar; supported: sglang{supported}. "
            "Install a supported SGLang or a kvsidecar release that supports yours "
            "(KVSIDECAR_ENABLE=0 starts SGLang without kvsidecar)"
        )
    return parsed
