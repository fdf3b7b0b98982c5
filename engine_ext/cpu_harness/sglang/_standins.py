"""Stand-ins that let SGLang 0.5.23's HTTP server import on a CPU-only test machine.

Harness only: :mod:`engine_ext.cpu_harness.sglang.serve` registers them at
import, and Python's ``spawn`` start method imports that module (the parent's
``__main__``, as ``__mp_main__``) in every process SGLang starts *before* it
unpickles the process's arguments, so the tokenizer, detokenizer and
scheduler processes get them too. Each stand-in provides only the names
SGLang imports at module level and raises on any use. Reasons (one per
module) are listed in docs/cpu-harness.md:

* ``torchvision``: ``sglang.srt.configs`` imports ``torchvision.transforms``
  for two vision configs; PyPI's wheels need CUDA torch (the adapter's
  :func:`engine_ext.sglang.prepare_cpu_imports` registers it).

(``soundfile``, which the HTTP server's audio modules import at start, is
installed for real: ``mistral_common`` calls it at import when it is found,
so a stand-in would have to imitate it.)
"""

from __future__ import annotations

__all__ = ["install_standins"]


def install_standins() -> list[str]:
    """Register the stand-ins for modules that are not installed; returns their names.

    Idempotent; a module that is installed is left alone.
    """
    from engine_ext.sglang import prepare_cpu_imports

    return ["torchvision"] if prepare_cpu_imports() else []
