"""cffi build script: exposes `ffi`, compiled by setuptools through `cffi_modules`.

The cdef is csrc/shmchan.h read verbatim; the sources are every csrc/*.c file.
Out-of-line API mode: the C compiler checks our declarations against the real code.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = [  # by layer, lowest first (core.h)
    "pause.c",
    "rxlock.c",
    "hash.c",
    "crc32c.c",
    "hold.c",
    "commit.c",
    "budget.c",
    "ring.c",
    "sched.c",
    "window.c",
    "lookahead.c",
    "batchin.c",
    "islands.c",
    "compact.c",
    "handles.c",
    "timers.c",
    "deadroute.c",
    "recovery.c",
    "rebuild.c",
    "segment.c",
    "inspect.c",
    "exchange.c",
    "overflow.c",
]

ffi = FFI()
ffi.cdef((HERE / "shmchan.h").read_text())
ffi.set_source(
    "_shmchan_core",
    '#include "core.h"',
    sources=[str(Path("csrc") / name) for name in SOURCES],
    include_dirs=["csrc"],
    depends=[
        str(Path("csrc") / name)
        for name in ("core.h", "hash.h", "lane.h", "peek.h", "rxlock.h", "shmchan.h")
    ],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
