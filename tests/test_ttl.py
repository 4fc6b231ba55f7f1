"""Message time-to-live: send(..., ttl=) and dead letters routed to an exchange.

A message not handed out within its ttl becomes a dead letter with reason "expired",
never handed out, and its keys go to the next in line. Dead letters can be published to
an exchange instead of kept; whatever the exchange cannot take stays listed.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from procs import CTX, WAIT, running, take_receiver_seat

import shmchan


def _dead(ch: Any) -> list[tuple[Any, str, int]]:
    return [(d.payload, d.reason, d.attempts) for d in ch.dead_letters()]


def test_an_expired_message_is_a_dead_letter_and_its_keys_go_to_the_next(ch, tx, rx):
    tx.send(b"old", keys=("k",), ttl=0.2)
    nxt = tx.send(b"next", keys=("k",))
    time.sleep(0.3)
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == nxt
    assert _dead(ch) == [(b"old", "expired", 0)]
    st = ch.stats()
    assert st.expired == 1 and st.dead_letters == 1 and st.delivered == 1


def test_a_message_handed_out_in_time_does_not_expire(ch, tx, rx):
    tx.send(b"x", keys=("k",), ttl=30)
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == b"x"
        time.sleep(0.1)
    assert ch.dead_letters() == [] and ch.stats().expired == 0


def test_a_nacked_message_is_not_subject_to_its_ttl_again(ch, tx, rx):
    """The ttl is about being handed out: once delivered, a nack redelivers it."""
    tx.send(b"x", keys=("k",), ttl=0.2)
    h = rx.recv(timeout=WAIT)
    time.sleep(0.3)
    h.nack()
    with rx.recv(timeout=WAIT) as h2:
        assert h2.payload == b"x" and h2.attempt == 2


def test_a_message_waiting_behind_a_held_key_expires_when_the_key_frees(ch, tx, rx):
    first = tx.send(b"first", keys=("k",))
    h = rx.recv(timeout=WAIT)
    assert h.seq == first
    tx.send(b"short", keys=("k",), ttl=0.2)
    last = tx.send(b"last", keys=("k",))
    time.sleep(0.3)
    h.release()
    with rx.recv(timeout=WAIT) as h2:
        assert h2.seq == last  # "short" died without being handed out
    assert _dead(ch) == [(b"short", "expired", 0)]


def test_a_delay_longer_than_the_ttl_expires_the_message_at_its_expiry(ch, tx, rx):
    t0 = time.monotonic()
    tx.send(b"never", keys=("k",), delay=0.5, ttl=0.2)
    behind = tx.send(b"behind", keys=("k",))
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == behind
    assert time.monotonic() - t0 >= 0.2 - 0.01
    assert _dead(ch) == [(b"never", "expired", 0)]


def test_recv_blocked_wakes_to_expire_a_delayed_message(ch, tx, rx):
    """The expiry of a delayed message is a time the receiver wakes for, too."""
    tx.send(b"never", keys=("k",), delay=60, ttl=0.3)
    behind = tx.send(b"behind", keys=("k",))
    t0 = time.monotonic()
    with rx.recv(timeout=60) as h:
        assert h.seq == behind
    assert time.monotonic() - t0 < 0.3 + WAIT / 2


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf])
def test_bad_ttl_is_refused_at_once_and_nothing_is_sent(ch, tx, bad):
    with pytest.raises(shmchan.InvalidDelay) as e:
        tx.send(b"x", keys=("k",), ttl=bad)
    assert "ttl" in str(e.value) and "None" in str(e.value)
    assert ch.stats().sent == 0


def test_expired_counts_in_metrics(ch, tx, rx):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from shmchan.metrics import ChannelCollector

    tx.send(b"x", keys=("k",), ttl=0.05)
    tx.send(b"y", keys=("k",), delay=30)
    time.sleep(0.1)
    assert rx.try_recv() is None
    reg = CollectorRegistry()
    reg.register(ChannelCollector([ch.name]))
    text = generate_latest(reg).decode()
    assert "shmchan_expired_messages_total" in text
    assert any(
        line.startswith("shmchan_delayed_messages") and line.endswith(" 1.0")
        for line in text.splitlines()
    ), text


def test_a_dead_letter_can_still_be_resent(ch, tx, rx):
    tx.send(b"x", keys=("k",), ttl=0.05)
    time.sleep(0.1)
    assert rx.try_recv() is None
    (d,) = ch.dead_letters()
    assert d.reason == "expired"
    d.resend(tx)
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == b"x"


# -- through processes ---------------------------------------------------------------------
def _take_in_then_hang(name: str, ready: Any) -> None:
    rx = shmchan.Channel.open(name).receiver()
    h = rx.recv(timeout=WAIT)  # holds key k: the ttl message waits behind it
    assert h.payload == b"holder"
    ready.set()
    time.sleep(WAIT)


def test_messages_expire_after_the_receiver_is_killed(chan_name):
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, max_attempts=1)
    try:
        with ch.sender() as tx:
            tx.send(b"holder", keys=("k",))
            tx.send(b"short", keys=("k",), ttl=0.3)
            last = tx.send(b"last", keys=("k",))
        ready = CTX.Event()
        r = CTX.Process(target=_take_in_then_hang, args=(chan_name, ready))
        with running(r):
            assert ready.wait(WAIT), f"the receiver child ended with {r.exitcode}"
            time.sleep(0.4)
            os.kill(r.pid, signal.SIGKILL)
            r.join(WAIT)
        rx = take_receiver_seat(ch)
        try:
            with rx.recv(timeout=WAIT) as h:  # the holder died: out of attempts
                assert h.seq == last
        finally:
            rx.close()
        assert sorted(_dead(ch)) == [(b"holder", "attempts", 1), (b"short", "expired", 0)]
    finally:
        ch.close()


# -- dead letters routed to an exchange ----------------------------------------------------
@pytest.fixture
def exchange_name() -> Iterator[str]:
    name = f"t{os.getpid()}_dlx{os.urandom(3).hex()}"
    yield name
    with contextlib.suppress(shmchan.Error):
        shmchan.unlink_exchange(name)


def test_expired_messages_are_published_to_the_dead_letter_exchange(make_channel, exchange_name):
    ex = shmchan.Exchange.create(exchange_name, kind="direct")
    dlq = make_channel()
    ex.bind(dlq.name, "expired")
    ch = make_channel(dead_letter_exchange=exchange_name)
    assert ch.dead_letter_exchange() == exchange_name
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"old", keys=("k", 7), ttl=0.1)
        time.sleep(0.2)
        assert rx.try_recv() is None  # expires it
        rx.maintain()  # the upkeep routes it (recv runs it on its own)
    with dlq.receiver() as drx, drx.recv(timeout=WAIT) as h:
        assert (h.payload, h.keys) == (b"old", ("k", 7))
    assert ch.dead_letters() == []


def test_a_dead_letter_no_binding_takes_stays_listed(make_channel, exchange_name):
    ex = shmchan.Exchange.create(exchange_name, kind="direct")
    dlq = make_channel()
    ex.bind(dlq.name, "expired")  # "attempts" is bound nowhere
    ch = make_channel(max_attempts=1)
    ch.route_dead_letters(ex)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"poison", keys=("k",))
        rx.recv(timeout=WAIT).nack()
        assert rx.try_recv() is None
        rx.maintain()
    assert _dead(ch) == [(b"poison", "attempts", 1)]
    assert dlq.stats().sent == 0


def test_dead_letters_stay_listed_while_the_exchange_is_missing(make_channel, exchange_name):
    ch = make_channel(dead_letter_exchange=exchange_name)  # not created yet
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"old", ttl=0.05)
        time.sleep(0.1)
        assert rx.try_recv() is None
        rx.maintain()
        assert _dead(ch) == [(b"old", "expired", 0)]
        ex = shmchan.Exchange.create(exchange_name, kind="fanout")
        dlq = make_channel()
        ex.bind(dlq.name)
        rx.maintain()
    assert ch.dead_letters() == []
    with dlq.receiver() as drx, drx.recv(timeout=WAIT) as h:
        assert h.payload == b"old"


def test_a_full_dead_letter_channel_keeps_the_letter_listed(make_channel, exchange_name):
    ex = shmchan.Exchange.create(exchange_name, kind="fanout")
    dlq = make_channel(capacity=4096)
    ex.bind(dlq.name)
    with dlq.sender() as filler:
        with contextlib.suppress(shmchan.Full):
            while True:
                filler.send(b"x" * 512, timeout=0)
    ch = make_channel(dead_letter_exchange=ex)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"old" * 100, ttl=0.05)
        time.sleep(0.1)
        assert rx.try_recv() is None
        rx.maintain()
    assert [d.reason for d in ch.dead_letters()] == ["expired"]


def test_route_dead_letters_is_kept_in_the_channel_and_can_be_cleared(make_channel, exchange_name):
    ch = make_channel()
    assert ch.dead_letter_exchange() is None
    ch.route_dead_letters(exchange_name)
    with shmchan.Channel.open(ch.name) as other:
        assert other.dead_letter_exchange() == exchange_name
        other.route_dead_letters(None)
    assert ch.dead_letter_exchange() is None


@pytest.mark.parametrize("bad", ["", "no/slash", "x" * 300])
def test_a_bad_dead_letter_exchange_name_is_refused(make_channel, chan_name, bad):
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.Channel.create(chan_name, capacity=1 << 20, dead_letter_exchange=bad)
    with pytest.raises(shmchan.ChannelNotFound):  # refused before anything was made
        shmchan.Channel.open(chan_name)
    with pytest.raises(shmchan.UnsupportedType):
        make_channel().route_dead_letters(3)
