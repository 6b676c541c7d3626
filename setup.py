"""The compiled parts: plain C functions loaded with ctypes (memory_pool/_native.py), no Python
headers. memory_pool/_rowhash.c: rows' initial values; memory_pool/_rowsets.c: the row sets of a
step (its distinct rows, a recovery window's first touches); memory_pool/_newest.c: a compaction's
newest rows (their plan, their copies). Built with the package (``pip
install -e .`` puts them beside their sources). Optional: without a C compiler the install goes
on and the NumPy or torch definitions run (memory_pool/initializers.py, memory_pool/rowsets.py,
memory_pool/newest.py, memory_pool/records.py)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("memory_pool._rowhash", ["memory_pool/_rowhash.c"], optional=True,
              # -ffp-contract=off: no fused multiply-add (bit-identical to NumPy's two float32 roundings)
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"]),
    # (depends: a change of the shared header rebuilds both)
    Extension("memory_pool._rowsets", ["memory_pool/_rowsets.c"], depends=["memory_pool/_bitmap.h"], optional=True,
              extra_compile_args=["-O3"]),
    Extension("memory_pool._newest", ["memory_pool/_newest.c"], depends=["memory_pool/_bitmap.h"], optional=True,
              extra_compile_args=["-O3"]),
])
