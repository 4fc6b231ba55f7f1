# Only what pyproject.toml cannot say: the three compiled modules.
#   _shmchan_core    the C core, through cffi (csrc/build_ffi.py)
#   _shmchan_hot     the per-message calls as CPython types (csrc/hot/); it calls the
#                    core through function pointers taken from _shmchan_core at import
#   _shmchan_chunks  KeyedExecutor.map's per-item chunk bookkeeping (csrc/pool/chunks.c)
from setuptools import Extension, setup

# _shmchan_hot: one file per type, csrc/hot/hot.h shared by all
HOT_SOURCES = [
    "module", "segment", "wake", "handle", "batch", "receiver", "sender", "handover", "keys",
    "publish", "subclass",
]

setup(
    cffi_modules=["csrc/build_ffi.py:ffi"],
    ext_modules=[
        Extension(
            "_shmchan_hot",
            sources=[f"csrc/hot/{name}.c" for name in HOT_SOURCES],
            include_dirs=["csrc", "csrc/hot"],
            depends=["csrc/shmchan.h", "csrc/core.h", "csrc/rxlock.h", "csrc/hot/hot.h",
                     "csrc/hot/wake.h"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type",
                                "-fvisibility=hidden"],
        ),
        Extension(
            "_shmchan_chunks",
            sources=["csrc/pool/chunks.c"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ],
)
