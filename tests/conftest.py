"""Shared fixtures: unique channel names, channels that clean up, a /dev/shm leak check.

Every channel a test makes is named ``t<pid>_<hex>``, so the leak check can tell
this test run's segments (and semaphores) from anyone else's in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shmchan

DEV_SHM = "/dev/shm"

# A test run started in the background by a non-interactive shell (`cmd &`, nohup, some CI
# runners) inherits SIGINT ignored, and so would every child it starts: the tests that
# press Ctrl-C on `stat --watch` or the demo would wait for an exit that never comes.
# A handler here (not inherited across exec) gives children the default disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _tag() -> str:
    """The part every channel name made by this test process starts with."""
    return f"t{os.getpid()}_"


def _our_shm_entries() -> set[str]:
    """Entries in /dev/shm (segments, `sem.*` semaphores) belonging to this process's channels."""
    try:
        names = os.listdir(DEV_SHM)
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()
    tag = _tag()
    return {n for n in names if tag in n}


def _unlink_quietly(name: str) -> None:
    try:
        shmchan.unlink(name)
    except shmchan.ChannelNotFound:
        pass


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Fail the test if it leaves /dev/shm entries of channels it created.

    Autouse fixtures are set up first and so torn down last: this runs after
    `chan_name` / `make_channel` have unlinked their channels. Leftovers are
    removed after being reported so one leak does not fail the next tests.
    """
    before = _our_shm_entries()
    yield
    leaked = _our_shm_entries() - before
    for entry in leaked:
        try:
            os.unlink(os.path.join(DEV_SHM, entry))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared-memory entries behind: {sorted(leaked)}"


@pytest.fixture
def new_chan_name() -> Iterator[Callable[[], str]]:
    """A factory of unique channel names; every name it gave is unlinked at teardown."""
    given: list[str] = []

    def make() -> str:
        name = f"{_tag()}{uuid.uuid4().hex[:8]}"
        given.append(name)
        return name

    yield make
    for name in given:
        _unlink_quietly(name)


@pytest.fixture
def chan_name(new_chan_name: Callable[[], str]) -> str:
    """One unique channel name, unlinked at teardown (ChannelNotFound ignored)."""
    return new_chan_name()


@pytest.fixture
def make_channel(new_chan_name: Callable[[], str]) -> Iterator[Callable[..., Any]]:
    """``make_channel(**create_kwargs)``: a fresh 1 MiB channel; closed and unlinked at teardown."""
    made: list[Any] = []

    def make(name: str | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("capacity", 1 << 20)
        ch = shmchan.Channel.create(name or new_chan_name(), **kwargs)
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.close()


@pytest.fixture
def ch(make_channel: Callable[..., Any]) -> Any:
    """A default (fifo, pickle) 1 MiB channel."""
    return make_channel()


@pytest.fixture
def tx(ch: Any) -> Iterator[Any]:
    sender = ch.sender()
    yield sender
    sender.close()


@pytest.fixture
def rx(ch: Any) -> Iterator[Any]:
    receiver = ch.receiver()
    yield receiver
    receiver.close()


@pytest.fixture
def bounded() -> Callable[..., Any]:
    """``bounded(fn, *args, limit=5.0, **kw)``: run fn in a thread; fail if it blocks past `limit`.

    For calls whose contract is "returns / raises at once": a hang becomes a test
    failure instead of a stuck suite. Exceptions raised by fn are re-raised here.
    """

    def call(fn: Callable[..., Any], *args: Any, limit: float = 5.0, **kwargs: Any) -> Any:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            pytest.fail(f"{getattr(fn, '__qualname__', fn)} still blocked after {limit} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return call
