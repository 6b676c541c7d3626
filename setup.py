"""The one compiled part: memory_pool/_rowhash.c, a plain C function loaded with ctypes
(memory_pool/_native.py). Built with the package (``pip install -e .`` puts it beside its
source). Optional: without a C compiler the install goes on and the NumPy definition runs."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "memory_pool._rowhash", ["memory_pool/_rowhash.c"], optional=True,
    # -ffp-contract=off: no fused multiply-add (bit-identical to NumPy's two float32 roundings)
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"])])
