"""CPython's own concurrent.futures tests (test/test_concurrent_futures.py of the running
minor version), loaded from where the interpreter's test suite is installed, as a module
of its own: its task functions then pickle by this module's name, which worker
processes of every start method can import (tests/ is on their sys.path), while the
test package of this interpreter may lack the file. Used by test_executor_cpython.py.

FOUND is the file loaded, or None (then WHY says where it was looked for)."""

from __future__ import annotations

import os
import sys
import sysconfig

_NAME = "test_concurrent_futures.py"
_PLACES = [
    os.path.join(sysconfig.get_path("stdlib"), "test", _NAME),
    # Debian's libpython3.X-testsuite (the Python may be another build of that version)
    f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/test/{_NAME}",
]

FOUND = next((p for p in _PLACES if os.path.isfile(p)), None)
WHY = "" if FOUND else f"CPython's {_NAME} is not installed (looked in {', '.join(_PLACES)})"

if FOUND is not None:
    with open(FOUND, encoding="utf-8") as _f:
        exec(compile(_f.read(), FOUND, "exec"), globals())
