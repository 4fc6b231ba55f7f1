"""How an exception raised in a worker process reaches the caller whole.

A worker sends an exception as one pickled tuple, each part made on its own so that one
part that cannot be pickled spoils only itself:

    (whole, cls, name, args, state, text, tb)

    whole   pickle of the exception as its type pickles it, or None
    cls     pickle of its class (by reference: module and qualified name), or None
    name    "module.QualName" of its class
    args    pickle of exc.args, or None
    state   pickle of exc.__dict__ (attributes, notes), or None
    text    str(exc)
    tb      the worker's formatted traceback

The caller rebuilds it in the first way that works:

1. unpickle `whole`: what the exception's own pickling gives (its __reduce__);
2. rebuild it without calling __init__: cls.__new__(cls, *args), then args and __dict__
   restored. This is what brings back an exception whose __init__ takes other arguments
   than it passes to Exception.__init__ (unpickling calls cls(*args), which fails then);
3. else a RemoteError naming the original type, with its text.

Either way the worker's traceback becomes the exception's __cause__ (a RemoteTraceback),
so that it is printed with it. A class defined in the caller's main module is looked up
there (a spawned worker knows that module as __mp_main__).
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

from . import errors

__all__ = ["RemoteTraceback", "pack", "unpack", "unreadable_result"]


class RemoteTraceback(Exception):
    """The traceback, as text, of an exception raised in a worker process; set as the
    `__cause__` of the exception a future raises, so that it is printed with it."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def _dumps(obj: object) -> bytes | None:
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception:
        return None


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pack(exc: BaseException, tb: str) -> bytes:
    """Worker side: the bytes that carry `exc` and its traceback text to the caller."""
    cls = type(exc)
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception raised>"
    state = getattr(exc, "__dict__", None)
    return pickle.dumps(
        (
            _dumps(exc),
            _dumps(cls),
            _type_name(cls),
            _dumps(exc.args),
            _dumps(state or {}),
            text,
            tb,
        ),
        protocol=5,
    )


class _Unpickler(pickle.Unpickler):
    """Finds what a spawned worker pickled from __mp_main__ in this process's __main__."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "__mp_main__" and module not in sys.modules:
            module = "__main__"
        return super().find_class(module, name)


def _loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def _rebuild(cls_blob: bytes, args_blob: bytes, state_blob: bytes) -> BaseException:
    cls = _loads(cls_blob)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise TypeError(f"{cls!r} is not an exception class")
    args = _loads(args_blob)
    try:
        exc = cls.__new__(cls, *args)
    except Exception:  # a __new__ of its own, taking other arguments
        exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(_loads(state_blob))
    return exc


def unpack(data: bytes | memoryview) -> BaseException:
    """Caller side: the exception `pack` sent, as its own type when possible (else a
    RemoteError naming it), with the worker's traceback as its __cause__."""
    whole, cls_blob, name, args_blob, state_blob, text, tb = pickle.loads(data)
    exc: BaseException | None = None
    why = ""
    if whole is not None:
        try:
            exc = _loads(whole)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
    if exc is None and None not in (cls_blob, args_blob, state_blob):
        try:
            exc = _rebuild(cls_blob, args_blob, state_blob)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
    if not isinstance(exc, BaseException):
        if not why:
            why = "its arguments or attributes cannot be pickled"
        exc = errors.RemoteError(
            f"{name}: {text} (raised in a worker process; it cannot be rebuilt as a {name} "
            f"here: {why}. Define the exception class at module level, importable where "
            "the result is read, with picklable arguments and attributes)",
            name,
        )
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc


def unreadable_result(fn: object, e: Exception) -> errors.TaskNotPicklable:
    """Caller side: the error for a task's result (or exception) that the worker pickled
    but this process cannot unpickle, `e` being why."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    err = errors.TaskNotPicklable(
        f"the result of the task {name}(...) cannot be unpickled in this process "
        f"({type(e).__name__}: {e}); return objects whose classes this process can "
        "import (defined at module level, in a module the caller has)"
    )
    err.__cause__ = e
    return err
