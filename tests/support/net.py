"""Local TCP ports for servers a test starts as a child process.

One copy, shared with the demo and ``bench/``: the CPU harness's
:func:`engine_ext.cpu_harness.free_port` (a port free on 127.0.0.1 right now; a
server started later may still lose it).
"""

from __future__ import annotations

from engine_ext.cpu_harness import free_port

__all__ = ["free_port"]
