"""Delays that keep key order: send(..., delay=), Handle.nack(delay=), shmchan.backoff.

A delayed message keeps its place in its keys' lines: nothing behind it on any of its keys
is handed out before it; other keys flow. Timing is checked only with generous bounds:
"not before the delay" and "within the delay + a few seconds".
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any

import pytest
from procs import CTX, WAIT, check_core, running, take_receiver_seat

import shmchan

SLACK = 3.0  # seconds past a due time a message may come on a busy machine


def test_send_delay_holds_its_keys_and_other_keys_flow(ch, tx, rx):
    t0 = time.monotonic()
    late = tx.send(b"late", keys=("a",), delay=0.6)
    behind = tx.send(b"behind", keys=("a", "b"))
    other = tx.send(b"other", keys=("c",))
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == other  # another key flows at once
    assert rx.try_recv() is None  # "late" is not due, and "behind" waits behind it on a
    h = rx.recv(timeout=WAIT)
    assert h.seq == late and time.monotonic() - t0 >= 0.6 - 0.01
    assert time.monotonic() - t0 < 0.6 + SLACK
    assert rx.try_recv() is None  # "behind" waits until "late" is released
    h.release()
    with rx.recv(timeout=WAIT) as h2:
        assert h2.seq == behind


def test_delayed_message_keeps_its_place_against_later_messages_on_other_keys(ch, tx, rx):
    """A message on key b behind the delayed one (via a second key) waits too, while a
    message on b alone sent before the delayed one's second key line flows."""
    first_b = tx.send(b"b first", keys=("b",))
    tx.send(b"late", keys=("a", "b"), delay=0.4)
    later_b = tx.send(b"b later", keys=("b",))
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == first_b
    got = [rx.recv(timeout=WAIT)]
    assert got[0].payload == b"late"
    assert rx.try_recv() is None
    got[0].release()
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == later_b


def test_recv_blocked_with_a_long_timeout_wakes_for_the_due_time(ch, tx, rx):
    t0 = time.monotonic()
    tx.send(b"x", keys=("k",), delay=0.5)
    with rx.recv(timeout=60) as h:
        elapsed = time.monotonic() - t0
        assert h.payload == b"x"
    assert 0.5 - 0.01 <= elapsed < 0.5 + SLACK


def test_recv_times_out_while_the_message_is_still_delayed(ch, tx, rx):
    tx.send(b"x", keys=("k",), delay=30)
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.2)
    assert ch.stats().delayed == 1
    assert ch.stats().queued == 1


def test_nack_delay_redelivers_after_the_delay_and_keeps_the_keys(ch, tx, rx):
    a = tx.send(b"a", keys=("k",))
    h = rx.recv(timeout=WAIT)
    b = tx.send(b"b", keys=("k",))
    free = tx.send(b"free", keys=("z",))
    t0 = time.monotonic()
    h.nack(delay=0.5)
    with rx.recv(timeout=WAIT) as h2:
        assert h2.seq == free  # other keys flow meanwhile
    again = rx.recv(timeout=WAIT)
    assert again.seq == a and again.attempt == 2
    assert 0.5 - 0.01 <= time.monotonic() - t0 < 0.5 + SLACK
    assert rx.try_recv() is None  # b still waits behind a
    again.release()
    with rx.recv(timeout=WAIT) as h3:
        assert h3.seq == b


def test_nack_without_delay_and_with_zero_delay_redeliver_at_once(ch, tx, rx):
    tx.send(b"a", keys=("k",))
    for delay in (None, 0):
        h = rx.recv(timeout=WAIT)
        h.nack(delay=delay)
    with rx.recv(timeout=1) as h:
        assert h.attempt == 3


def test_nack_backoff_grows_with_attempts(ch, tx, rx):
    tx.send(b"a", keys=("k",))
    delays = []
    for _ in range(3):
        h = rx.recv(timeout=WAIT)
        delays.append(h.nack_backoff(base=0.05, factor=2, jitter=0))
    assert delays == [0.05, 0.1, 0.2]
    t0 = time.monotonic()
    with rx.recv(timeout=WAIT) as h:
        assert h.attempt == 4
    assert time.monotonic() - t0 >= 0.2 - 0.05


def test_backoff_schedule():
    assert shmchan.backoff(1, base=1, jitter=0) == 1
    assert shmchan.backoff(4, base=1, factor=3, jitter=0) == 27
    assert shmchan.backoff(100, base=1, cap=30, jitter=0) == 30
    assert shmchan.backoff(10**6, base=1, cap=5, jitter=0) == 5  # no overflow
    for _ in range(200):
        d = shmchan.backoff(3, base=1, jitter=0.5)
        assert 2 <= d <= 4
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(shmchan.Error):
            shmchan.backoff(bad)  # type: ignore[arg-type]
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.backoff(1, jitter=2)
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.backoff(1, factor=0.5)


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, math.inf, 10**30])
def test_bad_send_delay_is_refused_at_once_and_nothing_is_sent(ch, tx, bad):
    with pytest.raises(shmchan.InvalidDelay) as e:
        tx.send(b"x", keys=("k",), delay=bad)
    assert "delay" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert ch.stats().sent == 0


@pytest.mark.parametrize("bad", ["1", b"1", True, [1]])
def test_send_delay_of_the_wrong_type_is_refused(ch, tx, bad):
    with pytest.raises(shmchan.UnsupportedType):
        tx.send(b"x", delay=bad)
    assert ch.stats().sent == 0


def test_delay_and_ttl_are_keyword_only(tx):
    with pytest.raises(TypeError):
        tx.send(b"x", (), None, 1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 60 * 86400.0])
def test_bad_nack_delay_is_refused_and_the_handle_is_still_held(ch, tx, rx, bad):
    tx.send(b"x", keys=("k",))
    h = rx.recv(timeout=WAIT)
    with pytest.raises(shmchan.InvalidDelay):
        h.nack(delay=bad)
    assert ch.stats().inflight == 1  # nothing was given back
    h.release()


def test_pickled_payload_and_no_keys_with_a_delay(ch, tx, rx):
    t0 = time.monotonic()
    tx.send({"a": 1}, delay=0.3)
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == {"a": 1} and h.keys == ()
    assert time.monotonic() - t0 >= 0.3 - 0.01


def test_why_waiting_and_stats_show_a_delayed_message(ch, tx, rx):
    late = tx.send(b"late", keys=("a",), delay=30)
    behind = tx.send(b"behind", keys=("a",))
    assert rx.try_recv() is None
    me = ch.why_waiting(late)
    assert me.state == "delayed" and me.due is not None
    assert 25 < me.due - time.time() <= 30
    chain = ch.why_waiting(behind)
    assert chain.state == "waiting"
    assert [w.seq for w in chain] == [late] and chain[0].state == "delayed"
    assert ch.stats().delayed == 1


def test_stat_command_says_delayed_until(ch, tx, rx):
    from procs import run_shmchan

    late = tx.send(b"late", keys=("a",), delay=30)
    behind = tx.send(b"behind", keys=("a",))
    assert rx.try_recv() is None
    out = run_shmchan("stat", ch.name, "--why", str(behind), timeout=WAIT)
    assert f"behind seq {late}, which is delayed until" in out.stdout, out
    out = run_shmchan("stat", ch.name, timeout=WAIT)
    assert any(line.split() == ["delayed", "1"] for line in out.stdout.splitlines()), out


def test_shutdown_waits_for_delayed_messages(ch, tx, rx):
    tx.send(b"late", keys=("a",), delay=0.4)
    ch.shutdown()
    assert _drain(rx) == [b"late"]


def _drain(rx: Any) -> list[Any]:
    """The payloads of everything `for h in rx` hands out until the channel is drained."""
    out = []
    deadline = time.monotonic() + WAIT
    for h in rx:
        out.append(h.payload)
        h.release()
        assert time.monotonic() < deadline
    return out


# -- through processes ---------------------------------------------------------------------
def _receive_then_hang(
    name: str, path: str | None, nack_delay: float, seated: Any, ready: Any
) -> None:
    """A receiver: nacks the first message with a delay, takes the delayed messages in
    (on its delayed list, keeping their keys), then waits to be killed."""
    ch = shmchan.Channel.open(name, path=path)
    rx = ch.receiver()
    seated.set()
    h = rx.recv(timeout=WAIT)
    assert h.payload == b"nacked"
    h.nack(delay=nack_delay)
    deadline = time.monotonic() + WAIT
    while ch.stats().delayed < 2:  # "late" and the nacked one
        assert rx.try_recv() is None  # nothing behind them on their keys goes
        assert time.monotonic() < deadline
        time.sleep(0.005)
    ready.set()
    time.sleep(WAIT)


def _killed_receiver_then_check(name: str, path: str | None) -> None:
    seated, ready = CTX.Event(), CTX.Event()
    r = CTX.Process(target=_receive_then_hang, args=(name, path, 1.5, seated, ready))
    with running(r):
        assert seated.wait(WAIT), f"the receiver child ended with {r.exitcode}"
        with shmchan.Channel.open(name, path=path) as ch, ch.sender() as tx:
            t0 = time.monotonic()
            tx.send(b"nacked", keys=("n",))
            tx.send(b"late", keys=("a",), delay=2.0)
            tx.send(b"behind", keys=("a",))
            tx.send(b"behind nacked", keys=("n",))
        assert ready.wait(WAIT), f"the receiver child ended with {r.exitcode}"
        t_nack = time.monotonic()  # the nack came before this
        os.kill(r.pid, signal.SIGKILL)
        r.join(WAIT)
    with shmchan.Channel.open(name, path=path) as ch:
        rx = take_receiver_seat(ch)
        try:
            got = []
            while len(got) < 4:
                h = rx.recv(timeout=WAIT)
                got.append((h.payload, time.monotonic()))
                h.release()
        finally:
            rx.close()
    order = [p for p, _ in got]
    when = dict(got)
    # per-key order: each delayed message before what is behind it on its key
    assert order.index(b"late") < order.index(b"behind")
    assert order.index(b"nacked") < order.index(b"behind nacked")
    assert when[b"late"] - t0 >= 2.0 - 0.01  # the send's delay held across the kill
    assert when[b"late"] - t0 < 2.0 + WAIT
    # the nack's delay too: the nack was made after t0, and before t_nack
    assert when[b"nacked"] - t0 >= 1.5 - 0.01
    assert when[b"nacked"] - t_nack < 1.5 + WAIT


def test_a_new_receiver_honours_delays_after_the_receiver_is_killed(chan_name):
    shmchan.Channel.create(chan_name, capacity=1 << 20).close()
    _killed_receiver_then_check(chan_name, None)


def test_a_durable_channel_reopened_keeps_its_delays(chan_name, tmp_path):
    path = str(tmp_path / "delays.chan")
    shmchan.Channel.create(chan_name, capacity=1 << 20, path=path).close()
    try:
        _killed_receiver_then_check(chan_name, path)
    finally:
        with contextlib.suppress(shmchan.ChannelNotFound):
            shmchan.unlink(chan_name, path=path)


def test_a_durable_channel_keeps_a_send_delay_when_closed_by_everyone(chan_name, tmp_path):
    """Every process gone (as after a reboot, which the wall clock survives): the due time
    is in the file."""
    path = str(tmp_path / "delays.chan")
    try:
        with shmchan.Channel.create(chan_name, capacity=1 << 20, path=path) as ch:
            with ch.sender() as tx:
                t0 = time.monotonic()
                late = tx.send(b"late", keys=("a",), delay=1.0)
                tx.send(b"behind", keys=("a",))
        with shmchan.Channel.open(chan_name, path=path) as ch, ch.receiver() as rx:
            h = rx.recv(timeout=WAIT)
            assert h.seq == late and time.monotonic() - t0 >= 1.0 - 0.01
            h.release()
            with rx.recv(timeout=WAIT) as h2:
                assert h2.payload == b"behind"
    finally:
        with contextlib.suppress(shmchan.ChannelNotFound):
            shmchan.unlink(chan_name, path=path)


def test_the_cores_self_check_counts_delayed_messages(ch: shmchan.Channel) -> None:
    # A delayed message is READY but off the ready heap, on the delayed list: the core's
    # cross-check of its tables must count it there, not report a corrupt heap.
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"later", keys=("k",), delay=30)
    tx.send(b"now", keys=("j",))
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == b"now"
    assert ch.stats().delayed == 1
    check_core(rx)
    rx.close()
