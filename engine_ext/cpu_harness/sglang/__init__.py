"""The SGLang half of the CPU harness (import the public names from ``engine_ext.cpu_harness``).

* ``_loop`` -- ``CpuHarness``: SGLang's real memory classes (tree cache,
  ``ReqToTokenPool``, the adapter's allocator, admission budget, leak checks)
  driven in the scheduler's order by one thread, with no model.

This ``__init__`` imports nothing, so nothing here loads SGLang until used.
"""
