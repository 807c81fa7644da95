"""The three optional C loops; everything else about the package is in pyproject.toml.

``components/_claim.c``: the insert's slot claim (checks, held marks and the node's copy in one
pass). ``radix/_match.c``: the walk's loop (one memcmp and one child lookup per node).
``allocators/_release.c``: frees of slots (checks, ring and free-mask writes in one pass), and
the memory arena's search for its lowest free KV pages. All are ``optional``: without a
compiler the install still succeeds and the numpy / pure-Python code they are tested against
(``tests/radix/test_compiled.py``, ``tests/allocators/test_allocators_release.py``,
``tests/allocators/test_arena_release.py``) runs instead, with the same results, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("components._claim", ["components/_claim.c"], optional=True,
                  extra_compile_args=["-O2"]),
        Extension("radix._match", ["radix/_match.c"], optional=True,
                  extra_compile_args=["-O2"]),
        Extension("allocators._release", ["allocators/_release.c"], optional=True,
                  extra_compile_args=["-O2"]),
    ]
)
