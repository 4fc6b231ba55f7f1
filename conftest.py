"""Every Python code block of README.md and docs/ runs as a test (Sybil).

Blocks of one page share a namespace and run in order, as a reader would type them. A
block that cannot run here is preceded by `<!-- skip: next "why" -->` (reported as a skip
with that reason); shell commands (`sh`) and output (`text`) blocks are never run.

Each page runs as a module of its own name, registered in sys.modules, so functions it
defines can be pickled by reference into worker processes (the default `fork` start
method), as a reader's script would. After each page, channels and exchanges whose names
end in this process's pid (the examples' names) must be gone: an example cleans up.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

_SHM = "/dev/shm"


class _PageModule(types.ModuleType):
    """A module whose attributes are a page's namespace (looked up when pickle asks)."""

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        super().__init__(name)
        self._namespace = namespace

    def __getattr__(self, attr: str) -> Any:
        try:
            return self._namespace[attr]
        except KeyError:
            raise AttributeError(attr) from None


def _ours() -> set[str]:
    tag = f"-{os.getpid()}"
    try:
        return {e for e in os.listdir(_SHM) if e.endswith(tag)}
    except FileNotFoundError:
        return set()


_before: dict[int, set[str]] = {}


def _setup(namespace: dict[str, Any]) -> None:
    name = f"docs_page_{len(_before)}"
    namespace["__name__"] = name
    sys.modules[name] = _PageModule(name, namespace)
    _before[id(namespace)] = _ours()


def _teardown(namespace: dict[str, Any]) -> None:
    sys.modules.pop(namespace["__name__"], None)
    left = _ours() - _before.pop(id(namespace), set())
    for entry in left:
        os.unlink(os.path.join(_SHM, entry))
    assert not left, f"a code example left shared memory behind: {sorted(left)}"


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "*.md"],
    excludes=["docs/performance/results.md", "docs/changelog.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
