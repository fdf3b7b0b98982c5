"""The entry function of SGLang scheduler processes when kvsidecar is installed.

SGLang starts schedulers with the ``spawn`` method, so a spawned process
imports its target by name and sees none of the parent's patches. The
parent's ``Engine.run_scheduler_process_func`` (and the launcher's
``launch_server`` argument) therefore point here: install in this process
(the settings come from the inherited ``KVSIDECAR_*`` environment), then run
SGLang's own ``run_scheduler_process`` unchanged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_scheduler_process"]


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """Install kvsidecar in this scheduler process, then run SGLang's scheduler."""
    from ._install import install

    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    return sglang_run(*args, **kwargs)
