"""Raw HTTP/1.1 for the tests that attack a server below any client library: split what a
server sent into framed replies, and mutate valid requests into broken ones."""

from __future__ import annotations

import random

__all__ = ["framed_replies", "mutated_request"]

Reply = tuple[int, dict[str, str], bytes]

# header lines a mutation may insert: a length that lies, a framing the body does not
# follow, a value that is not text
_HEADER_LINES = [b"Content-Length: 3\r\n", b"Transfer-Encoding: chunked\r\n", b"X: \xff\r\n"]


def framed_replies(data: bytes) -> list[Reply]:
    """What a server sent on one connection, split into (status, lower-cased headers,
    body) replies framed by their Content-Length. Raises ``AssertionError`` on anything
    else: a missing end of headers, another version than HTTP/1.1, a body cut short."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a reply without the end of its headers: {data[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, code, _phrase = status_line.split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        size = int(headers["content-length"])
        assert len(rest) >= size, (status_line, headers, rest)
        out.append((int(code), headers, rest[:size]))
        data = rest[size:]
    return out


def mutated_request(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One of ``seeds`` with 1 to 4 mutations: a byte flipped, the rest cut off, a piece of
    another seed spliced in, a header line inserted, another seed appended (pipelined)."""
    request = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        at = rng.randrange(len(request) + 1)
        if op < 0.3 and request:
            request[min(at, len(request) - 1)] = rng.randrange(256)
        elif op < 0.5:
            del request[at:]
        elif op < 0.7:
            other = rng.choice(seeds)
            i = rng.randrange(len(other))
            request[at:at] = other[i : i + rng.randint(1, 40)]
        elif op < 0.85:
            request[at:at] = rng.choice(_HEADER_LINES)
        else:
            request += rng.choice(seeds)
    return bytes(request)
