"""The tests' kit: one copy of each helper more than one test file needs.

``tests/`` is on ``sys.path`` (it holds the root conftest), so tests write
``from support import wait_until``. The fixtures in :mod:`support.fixtures`
are registered for every test by ``tests/conftest.py``:

* ``sidecar_url`` -- a real sidecar (uvicorn thread) per test, fast push back-off;
* ``module_sidecar_url`` -- one per test module, default settings (for module-scoped
  engines that register with it).
"""

from __future__ import annotations

from .net import free_port
from .sidecar import ThreadedSidecar
from .wait import wait_until

__all__ = ["ThreadedSidecar", "free_port", "wait_until"]
