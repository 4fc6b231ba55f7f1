# Only what pyproject.toml cannot say: the cffi extension (see csrc/build_ffi.py).
from setuptools import setup

setup(cffi_modules=["csrc/build_ffi.py:ffi"])
