"""Exceptions raised in a worker reach the caller whole: their own type, arguments and
attributes, the worker's traceback as __cause__; a RemoteError naming the type otherwise."""

from __future__ import annotations

import sys
import threading
import types

import pytest
from test_pool import WAIT, no_leftovers  # noqa: F401 - no_leftovers is autouse

import shmchan
from shmchan import remote


class CustomError(Exception):
    """An exception whose __init__ takes other arguments than it passes on: unpickling
    it the usual way calls CustomError("code=42") and fails."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code={code}")
        self.code = code
        self.detail = detail


class KeywordOnlyError(ValueError):
    def __init__(self, *, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LockedError(Exception):
    """An exception with an attribute that cannot be pickled."""

    def __init__(self, x: int) -> None:
        super().__init__(x)
        self.lock = threading.Lock()


def raise_custom(code: int) -> int:
    raise CustomError(code, f"detail of {code}")


def raise_custom_on_three(x: int) -> int:
    if x == 3:
        raise CustomError(x, "three")
    return x


def raise_keyword_only() -> None:
    raise KeywordOnlyError(reason="no")


def raise_locked() -> None:
    raise LockedError(1)


def raise_ghost() -> None:
    """Raise an exception whose class exists only in the worker process."""
    ghost = types.new_class("Ghost", (Exception,))
    ghost.__module__ = "module_only_the_worker_has"
    raise ghost("boo")


def _raised(fn: object, *args: object) -> tuple[BaseException, str]:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as e:
        import traceback

        return e, traceback.format_exc()
    raise AssertionError("did not raise")


# ---------------------------------------------------------------- in one process


def test_an_exception_with_its_own_init_is_rebuilt_without_calling_it() -> None:
    exc, tb = _raised(raise_custom, 42)
    back = remote.unpack(remote.pack(exc, tb))
    assert type(back) is CustomError
    assert (back.args, back.code, back.detail) == (("code=42",), 42, "detail of 42")
    assert isinstance(back.__cause__, shmchan.RemoteTraceback)
    assert "raise CustomError" in str(back.__cause__)


def test_an_exception_that_pickles_keeps_what_its_pickling_gives() -> None:
    exc, tb = _raised(open, "/nonexistent/file")
    back = remote.unpack(remote.pack(exc, tb))
    assert type(back) is FileNotFoundError
    assert back.errno == exc.errno and back.filename == "/nonexistent/file"  # type: ignore[attr-defined]


def test_an_exception_with_keyword_only_init_keeps_its_type() -> None:
    exc, tb = _raised(raise_keyword_only)
    back = remote.unpack(remote.pack(exc, tb))
    assert type(back) is KeywordOnlyError and back.reason == "no" and str(back) == "no"


def test_an_exception_with_an_unpicklable_attribute_is_a_remote_error() -> None:
    exc, tb = _raised(raise_locked)
    back = remote.unpack(remote.pack(exc, tb))
    assert isinstance(back, shmchan.RemoteError) and isinstance(back, shmchan.Error)
    assert back.type_name == f"{__name__}.LockedError"
    assert f"{__name__}.LockedError: 1" in str(back) and "picklable" in str(back)
    assert "raise LockedError" in str(back.__cause__)


def test_a_remote_error_pickles() -> None:
    import pickle

    err = shmchan.RemoteError("m.T: text", "m.T")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is shmchan.RemoteError and again.type_name == "m.T"
    assert str(again) == "m.T: text"


# ---------------------------------------------------------------- through workers


def test_a_tasks_exception_with_its_own_init_reaches_the_future_as_its_type() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        fut = ex.submit(raise_custom, 42, keys=("k",))
        with pytest.raises(CustomError) as info:
            fut.result(timeout=WAIT)
        assert (info.value.code, info.value.detail, str(info.value)) == (
            42,
            "detail of 42",
            "code=42",
        )
        cause = info.value.__cause__
        assert isinstance(cause, shmchan.RemoteTraceback) and "in raise_custom" in str(cause)


@pytest.mark.parametrize("chunksize", [1, 4])
def test_a_map_items_exception_with_its_own_init_keeps_its_type(chunksize: int) -> None:
    with shmchan.KeyedExecutor(2) as ex:
        results = ex.map(raise_custom_on_three, range(8), keys=lambda x: "k", chunksize=chunksize)
        assert [next(results) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(CustomError) as info:
            next(results)
        assert info.value.code == 3 and info.value.detail == "three"
        assert isinstance(info.value.__cause__, shmchan.RemoteTraceback)


def test_an_exception_whose_class_the_caller_lacks_is_a_remote_error_naming_it() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        fut = ex.submit(raise_ghost)
        with pytest.raises(shmchan.RemoteError) as info:
            fut.result(timeout=WAIT)
        err = info.value
        assert isinstance(err, shmchan.Error)
        assert err.type_name == "module_only_the_worker_has.Ghost"
        assert "module_only_the_worker_has.Ghost: boo" in str(err)
        assert "in raise_ghost" in str(err.__cause__)
        assert ex.submit(int, "5").result(timeout=WAIT) == 5  # the executor goes on


def return_a_worker_only_object() -> object:
    """An object whose class lives in a module only the worker process has."""
    module = types.ModuleType("module_only_the_worker_has")
    sys.modules[module.__name__] = module
    cls = types.new_class("Thing", (object,))
    cls.__module__ = module.__name__
    module.Thing = cls  # type: ignore[attr-defined]
    return cls()


def test_a_result_the_caller_cannot_unpickle_is_a_shmchan_error_saying_why() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        fut = ex.submit(return_a_worker_only_object)
        with pytest.raises(shmchan.TaskNotPicklable) as info:
            fut.result(timeout=WAIT)
        assert "return_a_worker_only_object" in str(info.value)
        assert "module_only_the_worker_has" in str(info.value)
        assert isinstance(info.value.__cause__, ModuleNotFoundError)
