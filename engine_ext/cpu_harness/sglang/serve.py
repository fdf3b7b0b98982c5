"""``python -m engine_ext.cpu_harness.sglang.serve <sglang args>``: SGLang's real server on CPU.

The kvsidecar launcher (:mod:`engine_ext.sglang.launch_server`) with two
harness-only additions, never part of the product path:

* stand-ins for modules SGLang imports at start but a CPU test machine lacks
  (:mod:`._standins`), registered at *import* of this module: ``spawn``
  imports the parent's main module in every child before unpickling its
  arguments, so SGLang's tokenizer, detokenizer and scheduler processes get
  them too;
* the stub model runner (:mod:`._stub_runner`), installed in the scheduler
  process by :func:`._stub_runner.run_scheduler_process` before kvsidecar's
  own scheduler entry.

Everything else is SGLang's: HTTP server, tokenizer manager, detokenizer,
``Scheduler`` and its event loop (normal or overlap), with the adapter's
patches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._standins import install_standins

install_standins()  # module level on purpose: runs in every spawned SGLang process


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kvsidecar launcher with the stub model runner in the scheduler process."""
    from engine_ext.sglang.launch_server import main as launch_main

    from ._stub_runner import run_scheduler_process

    return launch_main(argv, scheduler_entry=run_scheduler_process)


if __name__ == "__main__":
    sys.exit(main())
