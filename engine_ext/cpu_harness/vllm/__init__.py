"""The vLLM half of the CPU harness (import the public names from ``engine_ext.cpu_harness``).

* ``executor.StubExecutor`` -- the ``--distributed-executor-backend`` vLLM
  imports by dotted path (``engine_ext.cpu_harness.STUB_EXECUTOR``); its
  ``StubWorker`` (``_worker``) writes and reads tokens in real KV memory,
  ``_multirank`` adds TP/PP rank processes;
* ``_launcher`` -- starts ``vllm serve`` with that executor.

This ``__init__`` imports nothing, so the launcher stays importable without vLLM.
"""
