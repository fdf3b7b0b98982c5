"""The one thing pyproject.toml cannot say: the allocator's optional C module.

``allocator/_speedups.c`` holds BlockAllocator's hot paths. ``optional=True``:
where no C compiler is available the install still succeeds and the
pure-Python paths run (``allocator.SPEEDUPS`` is then False).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("allocator._speedups", ["allocator/_speedups.c"], optional=True)])
