"""Temporary channels (shmchan/temporary.py): gone when the last process using them is,
whether it exited or was killed, and never while one still uses them."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from procs import CTX, WAIT, run_shmchan, running

import shmchan


def _exists(name: str) -> bool:
    return name in shmchan.list_channels()


def _semaphores(name: str) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if e.startswith(f"sem.shmchan.{name}.")]


def _create_and_receive(name: str, q: Any, go: Any, count: int) -> None:
    """Child: create the temporary channel, receive `count` messages, wait for `go`."""
    ch = shmchan.Channel.create(name, 1 << 20, temporary=True)
    rx = ch.receiver()
    q.put("created")
    for _ in range(count):
        with rx.recv(timeout=WAIT) as h:
            q.put(h.payload)
    go.wait(WAIT)


def _open_and_send(name: str, q: Any, go: Any) -> None:
    """Child: open the channel, send one message, wait for `go`, exit."""
    ch = shmchan.Channel.open(name)
    ch.sender().send(f"from {os.getpid()}")
    q.put("sent")
    go.wait(WAIT)


def _wait_gone(name: str) -> bool:
    deadline = time.monotonic() + WAIT
    while _exists(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_normal_exit_of_every_user_removes_it(chan_name: str) -> None:
    q, go = CTX.Queue(), CTX.Event()
    creator = CTX.Process(target=_create_and_receive, args=(chan_name, q, go, 2))
    with running(creator):
        assert q.get(timeout=WAIT) == "created"
        senders = [CTX.Process(target=_open_and_send, args=(chan_name, q, go)) for _ in range(2)]
        with running(*senders):
            got = sorted(q.get(timeout=WAIT) for _ in range(4))
            assert got[-2:] == ["sent", "sent"] and all(g.startswith("from ") for g in got[:2])
            go.set()
            for p in senders:
                p.join(WAIT)
        creator.join(WAIT)
    assert creator.exitcode == 0
    assert not _exists(chan_name)
    assert _semaphores(chan_name) == []


def test_a_user_still_alive_keeps_it_whoever_exits_or_sweeps(
    chan_name: str, new_chan_name: Any
) -> None:
    q, go, stay = CTX.Queue(), CTX.Event(), CTX.Event()
    creator = CTX.Process(target=_create_and_receive, args=(chan_name, q, stay, 1))
    with running(creator):
        assert q.get(timeout=WAIT) == "created"
        sender = CTX.Process(target=_open_and_send, args=(chan_name, q, go))
        with running(sender):
            assert sorted(q.get(timeout=WAIT) for _ in range(2))[-1] == "sent"
            go.set()
            sender.join(WAIT)
        assert sender.exitcode == 0
        assert _exists(chan_name)  # the sender exited, the creator still uses it
        # (ls exits 1 when some other segment on the machine is unreadable: not ours)
        assert "Traceback" not in run_shmchan("ls", timeout=WAIT).stderr
        shmchan.Channel.create(new_chan_name(), 1 << 16).unlink()  # a create sweeps
        assert _exists(chan_name)
        stay.set()
        creator.join(WAIT)
    assert creator.exitcode == 0
    assert _wait_gone(chan_name)


def _kill_all(*procs: Any) -> None:
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(WAIT)


@pytest.mark.parametrize("sweeper", ["ls", "create", "rm --stale"])
def test_users_all_killed_leave_it_to_the_next_sweep(
    sweeper: str, chan_name: str, new_chan_name: Any
) -> None:
    q, go = CTX.Queue(), CTX.Event()
    creator = CTX.Process(target=_create_and_receive, args=(chan_name, q, go, 1))
    sender = CTX.Process(target=_open_and_send, args=(chan_name, q, go))
    with running(creator):
        assert q.get(timeout=WAIT) == "created"
        with running(sender):
            assert sorted(q.get(timeout=WAIT) for _ in range(2))[-1] == "sent"
            _kill_all(sender, creator)
    assert _exists(chan_name)  # nobody exited normally: nothing removed it yet
    if sweeper == "create":
        shmchan.Channel.create(new_chan_name(), 1 << 16).unlink()
    else:
        result = run_shmchan(*sweeper.split(), timeout=WAIT)
        assert "Traceback" not in result.stderr  # ls: 1 if another segment is unreadable
        assert f"removed temporary channel {chan_name}" in result.stdout + result.stderr
    assert not _exists(chan_name)
    assert _semaphores(chan_name) == []


def test_a_plain_channel_nobody_uses_is_left_to_rm(chan_name: str, new_chan_name: Any) -> None:
    shmchan.Channel.create(chan_name, 1 << 16).close()
    del_later = shmchan.Channel.create(new_chan_name(), 1 << 16, temporary=True)
    shmchan.Channel.create(new_chan_name(), 1 << 16).unlink()  # a sweep
    assert _exists(chan_name)  # not temporary: kept
    assert _exists(del_later.name)  # temporary, but this process maps it
    assert del_later.temporary
    del_later.unlink()


def test_temporary_with_path_is_refused(chan_name: str, tmp_path: Any) -> None:
    with pytest.raises(shmchan.InvalidArgument, match="path="):
        shmchan.Channel.create(chan_name, 1 << 16, temporary=True, path=str(tmp_path / "f"))
    with pytest.raises(shmchan.UnsupportedType):
        shmchan.Channel.create(chan_name, 1 << 16, temporary=1)  # type: ignore[arg-type]
    assert not _exists(chan_name)


def _double(x: int) -> int:
    return 2 * x


def test_an_executors_private_channels_are_temporary() -> None:
    with shmchan.KeyedExecutor(max_workers=1) as ex:
        assert ex.submit(_double, 21, keys="k").result(timeout=WAIT) == 42
        mine = [n for n in shmchan.list_channels() if n.startswith("kx-")]
        flags = []
        for name in mine:
            try:
                ch = shmchan.Channel.open(name)
            except shmchan.Error:
                continue  # another process's executor, just gone
            flags.append(ch.temporary)
            ch.close()
        assert flags and all(flags)


def _spill_and_exit(name: str, spill_dir: str, q: Any, die: bool) -> None:
    """Child: create a temporary channel with an overflow directory, spill to it, then
    exit normally or report and wait to be killed."""
    ch = shmchan.Channel.create(name, 1 << 16, temporary=True, overflow=spill_dir)
    rx = ch.receiver()  # the receiver's process opens the file for its drain
    tx = ch.sender()
    for _ in range(2000):
        tx.send(b"x" * 100, keys=("k",), timeout=0)  # far past the ring: to the file
    q.put(ch.stats().overflow_messages)
    if die:
        time.sleep(WAIT)
    rx.close()


@pytest.mark.parametrize("end", ["exit", "killed"])
def test_a_temporary_channels_overflow_file_goes_with_it(
    end: str, chan_name: str, new_chan_name: Any, tmp_path: Any
) -> None:
    q = CTX.Queue()
    p = CTX.Process(target=_spill_and_exit, args=(chan_name, str(tmp_path), q, end == "killed"))
    with running(p):
        assert q.get(timeout=WAIT) > 0  # it did spill
        assert os.listdir(tmp_path) != []
        if end == "killed":
            _kill_all(p)
        else:
            p.join(WAIT)
    if end == "killed":
        shmchan.Channel.create(new_chan_name(), 1 << 16).unlink()  # a create sweeps
    assert _wait_gone(chan_name)
    assert os.listdir(tmp_path) == []


def test_stat_says_whether_a_channel_is_temporary(chan_name: str, new_chan_name: Any) -> None:
    import json

    temp = shmchan.Channel.create(chan_name, 1 << 16, temporary=True)
    plain = shmchan.Channel.create(new_chan_name(), 1 << 16)
    try:
        for ch, expected in ((temp, True), (plain, False)):
            sample = json.loads(run_shmchan("stat", ch.name, "--json", timeout=WAIT).stdout)
            assert sample["temporary"] is expected
            text = run_shmchan("stat", ch.name, timeout=WAIT).stdout
            assert ("temporary: yes" in text) is expected
    finally:
        for ch in (temp, plain):
            ch.unlink()
            ch.close()
