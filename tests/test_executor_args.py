"""KeyedExecutor's arguments: keys of the wrong form say which form submit and map take;
progress=True works on a plain install."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from test_pool import WAIT, no_leftovers, square  # noqa: F401 - no_leftovers is autouse

import shmchan


@pytest.fixture
def ex() -> Iterator[shmchan.KeyedExecutor]:
    with shmchan.KeyedExecutor(2) as executor:
        yield executor


def tag(x: int, *, keys: str) -> str:
    """A task function with a parameter of its own named `keys`."""
    return f"{keys}:{x}"


@pytest.mark.parametrize("keys", [("a",), ["a", "b"], "a", 5])
def test_map_with_keys_that_are_not_a_function_says_which_forms_are_taken(
    ex: shmchan.KeyedExecutor, keys: Any
) -> None:
    with pytest.raises(shmchan.UnsupportedType) as info:
        ex.map(square, range(3), keys=keys)
    err = info.value
    assert isinstance(err, TypeError) and isinstance(err, shmchan.Error)
    text = str(err)
    assert "function of one item" in text and "keys=lambda item: " in text
    assert "submit(fn, *args, keys=...) is the one that takes the keys themselves" in text
    assert list(ex.map(square, range(3), keys=lambda item: keys)) == [0, 1, 4]  # as advised


def test_submit_with_a_key_function_says_which_forms_are_taken(
    ex: shmchan.KeyedExecutor,
) -> None:
    with pytest.raises(shmchan.UnsupportedType) as info:
        ex.submit(square, 3, keys=lambda x: x)
    assert isinstance(info.value, TypeError)
    assert "takes the task's keys themselves" in str(info.value)
    assert "map(fn, items, keys=...)" in str(info.value)


def test_a_key_function_returning_a_non_key_is_a_shmchan_error(
    ex: shmchan.KeyedExecutor,
) -> None:
    with pytest.raises(shmchan.UnsupportedType, match="float"):
        ex.map(square, range(3), keys=lambda item: 1.5)
    with pytest.raises(shmchan.UnsupportedType, match="float"):
        ex.map(square, range(3), keys=lambda item: (1.5,))
    with pytest.raises(shmchan.UnsupportedType, match="float"):
        ex.submit(square, 3, keys=1.5)


def test_a_function_with_its_own_keys_parameter_gets_it_through_partial(
    ex: shmchan.KeyedExecutor,
) -> None:
    assert "functools.partial" in (shmchan.KeyedExecutor.submit.__doc__ or "")
    fut = ex.submit(functools.partial(tag, keys="mine"), 7, keys=("task-key",))
    assert fut.result(timeout=WAIT) == "mine:7"


def test_progress_works_without_tqdm(
    ex: shmchan.KeyedExecutor,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing tqdm fails, as uninstalled
    assert list(ex.map(square, range(40), progress=True)) == [x * x for x in range(40)]
    assert "40/40" in capsys.readouterr().err
