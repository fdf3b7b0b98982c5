"""JSON bodies with a key twice: refused on both sides of the wire, never "last one wins"."""

from __future__ import annotations

import json

__all__ = ["duplicate_json_key", "duplicate_key_message"]


class _Repeated(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Repeated(key)
        seen.add(key)
    return dict(pairs)


def duplicate_json_key(body: bytes | str) -> str | None:
    """The first key that appears twice in one JSON object of ``body``; None when there is
    none, or when the body is not JSON at all (the caller's parser says what is wrong)."""
    text = body.lstrip()
    if not text or text[:1] not in ("{", "[", b"{", b"["):
        return None
    try:
        json.loads(body, object_pairs_hook=_pairs)
    except _Repeated as repeated:
        return repeated.key
    except (ValueError, RecursionError):
        return None
    return None


def duplicate_key_message(key: str) -> str:
    """What a client is told (field ``body``) when a key appears twice."""
    return f"the key {key!r} appears twice in one JSON object; send each field once"
