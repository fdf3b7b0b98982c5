"""The one thing pyproject.toml cannot say: the optional C modules.

``allocator/_speedups.c`` holds BlockAllocator's hot paths,
``engine_ext/vllm/_block_speedups.c`` ElasticBlockPool's per-block loops.
``optional=True``: where no C compiler is available the install still
succeeds and the pure-Python paths run (``allocator.SPEEDUPS`` and
``engine_ext.vllm._block_pool.SPEEDUPS`` are then False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("allocator._speedups", ["allocator/_speedups.c"], optional=True),
        Extension(
            "engine_ext.vllm._block_speedups", ["engine_ext/vllm/_block_speedups.c"], optional=True
        ),
    ]
)
