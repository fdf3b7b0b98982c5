"""The SGLang half of the CPU harness (import the public names from ``engine_ext.cpu_harness``).

* ``_loop`` -- ``CpuHarness``: SGLang's real memory classes (tree cache,
  ``ReqToTokenPool``, the adapter's allocator, admission budget, leak checks)
  driven in the scheduler's order by one thread, with no model.
* ``serve`` -- ``python -m engine_ext.cpu_harness.sglang.serve <sglang args>``:
  SGLang's real HTTP server, tokenizer manager, detokenizer and scheduler
  with kvsidecar, the stand-ins of ``_standins`` in every SGLang process and
  the stub forward of ``_stub_runner`` in the scheduler process;
  ``_launcher`` starts it on a free port (``launch_sglang_server``).

This ``__init__`` imports nothing, so nothing here loads SGLang until used.
"""
