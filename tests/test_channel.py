"""Channel / Sender / Receiver lifecycle, payloads, blocking calls, shutdown and stats."""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import stat
import threading
import time
from typing import Any

import pytest
from procs import CTX, WAIT, running

import shmchan

# --- create / open / unlink -------------------------------------------------


def test_create_reports_name_and_capacity(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20) as ch:
        assert ch.name == chan_name
        assert ch.capacity >= 1 << 20


def test_open_sees_the_created_channel(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20) as ch:
        with shmchan.Channel.open(chan_name) as other:
            assert other.name == chan_name
            assert other.capacity == ch.capacity


def test_message_sent_through_opened_channel_reaches_creator(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20) as ch, ch.receiver() as rx:
        with shmchan.Channel.open(chan_name) as other, other.sender() as tx:
            tx.send(b"hello")
        assert rx.recv(timeout=5).payload == b"hello"


def test_create_makes_a_segment_in_dev_shm(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20):
        assert any(chan_name in entry for entry in os.listdir("/dev/shm"))


def test_unlink_removes_the_segment_from_dev_shm(chan_name):
    shmchan.Channel.create(chan_name, capacity=1 << 20).close()
    shmchan.unlink(chan_name)
    assert not any(chan_name in entry for entry in os.listdir("/dev/shm"))


def test_open_after_module_unlink_raises_channel_not_found(chan_name):
    shmchan.Channel.create(chan_name, capacity=1 << 20).close()
    shmchan.unlink(chan_name)
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name)


def test_open_after_channel_unlink_raises_channel_not_found(chan_name):
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20)
    ch.unlink()
    ch.close()
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name)


def test_segment_is_created_mode_0600_by_default(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20):
        entries = [e for e in os.listdir("/dev/shm") if chan_name in e]
        assert entries
        for entry in entries:
            mode = stat.S_IMODE(os.stat(os.path.join("/dev/shm", entry)).st_mode)
            assert mode == 0o600, (entry, oct(mode))


def test_segment_is_created_with_the_given_mode(chan_name):
    with shmchan.Channel.create(chan_name, capacity=1 << 20, mode=0o640):
        entries = [e for e in os.listdir("/dev/shm") if chan_name in e]
        assert entries
        for entry in entries:
            mode = stat.S_IMODE(os.stat(os.path.join("/dev/shm", entry)).st_mode)
            assert mode == 0o640, (entry, oct(mode))


def test_sender_open_by_name_sends_into_the_channel(ch, rx):
    with shmchan.Sender.open(ch.name) as tx:
        tx.send(b"via name")
    assert rx.recv(timeout=5).payload == b"via name"


# --- close / context managers -----------------------------------------------


def test_channel_close_is_idempotent(make_channel):
    ch = make_channel()
    ch.close()
    ch.close()
    with pytest.raises(shmchan.Closed):  # closed for good, whatever the number of closes
        ch.sender()


def test_sender_close_is_idempotent_and_send_after_close_raises_closed(ch):
    tx = ch.sender()
    tx.close()
    tx.close()
    with pytest.raises(shmchan.Closed):
        tx.send(b"x")


def test_receiver_close_is_idempotent_and_recv_after_close_raises_closed(ch):
    rx = ch.receiver()
    rx.close()
    rx.close()
    with pytest.raises(shmchan.Closed):
        rx.recv(timeout=0.1)


def test_receiver_context_manager_frees_the_receiver_slot(ch):
    with ch.receiver():
        pass
    with ch.receiver() as again:  # no ReceiverBusy: the first one was closed on exit
        assert again.try_recv() is None


def test_sender_context_manager_closes_it(ch):
    with ch.sender() as tx:
        tx.send(b"a")
    with pytest.raises(shmchan.Closed):
        tx.send(b"b")


def test_second_live_receiver_raises_receiver_busy(ch, rx):
    with pytest.raises(shmchan.ReceiverBusy):
        ch.receiver()


def test_receiver_busy_also_through_another_channel_object(ch, rx):
    with shmchan.Channel.open(ch.name) as other:
        with pytest.raises(shmchan.ReceiverBusy):
            other.receiver()


# --- payloads ----------------------------------------------------------------


def test_bytes_payload_round_trips(tx, rx):
    tx.send(b"\x00\x01binary\xff")
    assert rx.recv(timeout=5).payload == b"\x00\x01binary\xff"


def test_empty_bytes_payload_round_trips(tx, rx):
    tx.send(b"")
    assert rx.recv(timeout=5).payload == b""


@pytest.mark.parametrize(
    "payload", [bytearray(b"abc"), memoryview(b"abc")], ids=["bytearray", "memoryview"]
)
def test_bytes_like_payload_comes_back_as_bytes(tx, rx, payload):
    tx.send(payload)
    got = rx.recv(timeout=5).payload
    assert type(got) is bytes
    assert got == b"abc"


@pytest.mark.parametrize(
    "obj",
    [{"a": [1, 2.5, None]}, ("tuple", 1), 12345, "text", None, [b"x", {"y"}]],
    ids=["dict", "tuple", "int", "str", "none", "list"],
)
def test_python_object_payload_round_trips(tx, rx, obj):
    tx.send(obj)
    assert rx.recv(timeout=5).payload == obj


def test_large_payload_round_trips(tx, rx):
    payload = os.urandom(300_000)
    tx.send(payload)
    assert rx.recv(timeout=5).payload == payload


def test_raw_serializer_accepts_bytes(make_channel):
    ch = make_channel(serializer="raw")
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"raw")
        assert rx.recv(timeout=5).payload == b"raw"


@pytest.mark.parametrize("obj", ["text", {"a": 1}, 7], ids=["str", "dict", "int"])
def test_raw_serializer_refuses_non_bytes_with_type_error(make_channel, obj):
    ch = make_channel(serializer="raw")
    with ch.sender() as tx:
        with pytest.raises(TypeError):
            tx.send(obj)
    assert ch.stats().sent == 0


# --- seq ---------------------------------------------------------------------


def test_send_returns_int_seq(tx):
    assert isinstance(tx.send(b"x"), int)


def test_send_seqs_strictly_increase(tx):
    seqs = [tx.send(b"x") for _ in range(20)]
    assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False))


def test_seqs_strictly_increase_across_senders(ch):
    with ch.sender() as a, shmchan.Sender.open(ch.name) as b:
        seqs = [s.send(b"x") for _ in range(10) for s in (a, b)]
    assert all(x < y for x, y in zip(seqs, seqs[1:], strict=False))


def test_handle_seq_is_the_seq_send_returned(tx, rx):
    seq = tx.send(b"x", keys="k")
    assert rx.recv(timeout=5).seq == seq


def test_send_many_returns_one_increasing_seq_per_message(tx):
    seqs = tx.send_many([(b"a", ("k",)), (b"b", ()), ({"c": 3}, "other")])
    assert len(seqs) == 3
    assert all(isinstance(s, int) for s in seqs)
    assert seqs[0] < seqs[1] < seqs[2]


def test_send_many_messages_arrive_in_order_with_their_keys(tx, rx):
    seqs = tx.send_many([(b"a", ("k1",)), (b"b", ("k2", "k3"))])
    first, second = rx.recv(timeout=5), rx.recv(timeout=5)
    assert (first.seq, first.payload, first.keys) == (seqs[0], b"a", ("k1",))
    assert (second.seq, second.payload, second.keys) == (seqs[1], b"b", ("k2", "k3"))


@pytest.mark.timeout(60)
def test_send_many_larger_than_the_free_space_waits_and_goes_on_in_order(make_channel):
    """A batch the channel cannot take whole is sent in part at once, then the rest as
    the receiver frees space (the C fast path hands over to Sender._send_packed)."""
    ch = make_channel(capacity=64 << 10)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"registered")  # the fast path needs a registered producer
        rx.recv(timeout=5).release()
        items = [(i.to_bytes(4, "little") * 1024, ("k", i % 3)) for i in range(60)]  # 4 KiB
        result: dict[str, object] = {}

        def send() -> None:
            try:
                result["seqs"] = tx.send_many(items, timeout=20)
            except BaseException as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = []
        while len(got) < len(items):
            h = rx.recv(timeout=10)
            got.append((h.seq, h.payload))
            h.release()
        sender.join(10)
        assert "seqs" in result, result
        assert [seq for seq, _ in got] == result["seqs"]
        assert [payload for _, payload in got] == [payload for payload, _ in items]


def test_seq_after_send_many_is_larger(tx):
    seqs = tx.send_many([(b"a", ()), (b"b", ())])
    assert tx.send(b"c") > seqs[-1]


# --- recv / try_recv / recv_many -------------------------------------------------


def test_try_recv_on_empty_channel_returns_none(rx):
    assert rx.try_recv() is None


def test_try_recv_returns_a_handle(tx, rx):
    tx.send(b"x")
    h = rx.try_recv()
    assert isinstance(h, shmchan.Handle)
    assert h.payload == b"x"


def test_recv_timeout_on_empty_channel_raises_empty(rx):
    start = time.monotonic()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 5


def test_empty_is_a_queue_empty(rx):
    with pytest.raises(queue.Empty):
        rx.recv(timeout=0.05)


def test_recv_timeout_zero_on_empty_raises_empty(rx):
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0)


@pytest.mark.timeout(30)
def test_blocked_recv_wakes_up_on_send_from_another_thread(tx, rx):
    timer = threading.Timer(0.2, tx.send, args=(b"late",))
    timer.start()
    try:
        h = rx.recv(timeout=10)
    finally:
        timer.cancel()
        timer.join(5)
    assert h.payload == b"late"


def test_recv_many_returns_up_to_n_handles(tx, rx):
    for i in range(5):
        tx.send(i)
    hs = rx.recv_many(3, timeout=1)
    assert [h.payload for h in hs] == [0, 1, 2]


def test_recv_many_returns_what_is_ready_when_fewer_than_n(tx, rx):
    tx.send(b"a")
    tx.send(b"b")
    hs = rx.recv_many(256, timeout=1)
    assert [h.payload for h in hs] == [b"a", b"b"]


def test_recv_many_on_empty_channel_raises_empty(rx):
    with pytest.raises(shmchan.Empty):
        rx.recv_many(10, timeout=0.1)


def test_recv_many_never_returns_two_handles_sharing_a_key(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    tx.send(b"3", keys="other")
    hs = rx.recv_many(10, timeout=1)
    assert sorted(h.payload for h in hs) == [b"1", b"3"]


# --- full / backpressure ------------------------------------------------------


def _fill(tx, chunk: bytes, limit: int = 200) -> int:
    """Send `chunk` until the channel refuses with Full; return how many were accepted."""
    for sent in range(limit):
        try:
            tx.send(chunk, timeout=0.2)
        except shmchan.Full:
            return sent
    raise AssertionError(f"channel accepted {limit} chunks of {len(chunk)} bytes without Full")


@pytest.mark.timeout(60)
def test_send_on_full_channel_with_timeout_raises_full(tx):
    accepted = _fill(tx, bytes(64 << 10))
    assert accepted >= 1
    start = time.monotonic()
    with pytest.raises(shmchan.Full):
        tx.send(bytes(64 << 10), timeout=0.2)
    assert 0.15 <= time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_full_is_a_queue_full(tx):
    _fill(tx, bytes(64 << 10))
    with pytest.raises(queue.Full):
        tx.send(bytes(64 << 10), timeout=0)


@pytest.mark.timeout(60)
def test_blocked_send_completes_once_the_consumer_releases(tx, rx):
    _fill(tx, bytes(64 << 10))
    result: dict[str, object] = {}

    def late_send() -> None:
        try:
            result["seq"] = tx.send(b"after", timeout=10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    sender = threading.Thread(target=late_send, daemon=True)
    sender.start()
    time.sleep(0.2)
    while (h := rx.try_recv()) is not None and h.payload != b"after":
        h.release()
    sender.join(10)
    assert not sender.is_alive()
    assert "seq" in result, result


@pytest.mark.timeout(60)
def test_full_channel_accepts_again_after_everything_is_released(tx, rx):
    accepted = _fill(tx, bytes(64 << 10))
    for _ in range(accepted):
        rx.recv(timeout=5).release()
    # Whole ring free again: at most one chunk lost to where the ring wraps.
    assert _fill(tx, bytes(64 << 10)) >= accepted - 1


@pytest.mark.timeout(60)
def test_one_held_message_does_not_stop_the_channel_accepting(tx, rx):
    """No head-of-line blocking of space: a long-held record must not pin the ring."""
    chunk = bytes(64 << 10)
    accepted = _fill(tx, chunk)
    held = rx.recv(timeout=5)  # the oldest record, kept live
    for _ in range(accepted - 1):
        rx.recv(timeout=5).release()
    # All but one chunk's worth of space is free in aggregate: most of it must be usable.
    assert _fill(tx, chunk) >= (accepted - 1) // 2
    held.release()


def test_free_message_behind_more_blocked_messages_than_max_messages_is_handed_out(make_channel):
    """max_messages sizes the receiver's table; it must not cap what a free key can pass."""
    ch = make_channel(max_messages=16)  # the smallest table the implementation allows
    with ch.sender() as tx, ch.receiver() as rx:
        for i in range(40):
            tx.send(i, keys="hot")
        tx.send(b"free", keys="cold")
        hot = rx.recv(timeout=5)
        assert rx.recv(timeout=2).payload == b"free"
        assert hot.payload == 0


def test_backlog_many_times_the_window_drains_exactly_once_in_key_order(make_channel):
    """A backlog far longer than the window goes through it in batches (window.c: skipped
    records return, a low window is refilled), with holds and releases out of order."""
    from shmchan._lib import ffi, lib

    ch = make_channel(max_messages=16)
    rng = random.Random(7)
    with ch.sender() as tx, ch.receiver() as rx:
        keys_of = {}
        for i in range(600):
            keys = (i % 3,) if i % 7 else (i % 3, (i + 1) % 3)  # some span two keys
            keys_of[i] = set(keys)
            tx.send(i.to_bytes(4, "little"), keys=keys)
        seen_by_key: dict[int, list[int]] = {0: [], 1: [], 2: []}
        held: list[shmchan.Handle] = []
        got = 0
        what = ffi.new("uint32_t *")
        while got < 600:
            h = rx.try_recv() if held else None
            hs = [] if h is None else [h]
            if not hs:  # what is held may block everything: let it all go first
                while held:
                    held.pop().release()
                hs = rx.recv_many(rng.randint(1, 4), timeout=5)
            for h in hs:
                i = int.from_bytes(h.payload, "little")
                assert set(h.keys) == keys_of[i]
                for k in h.keys:
                    seen_by_key[k].append(i)
                held.append(h)
                got += 1
            rng.shuffle(held)
            for _ in range(rng.randint(1, len(held))):
                held.pop().release()
            assert lib.shm_check_scheduler(rx._seg.ptr, what) == 0, f"check {what[0]}"
        for h in held:
            h.release()
        for k, order in seen_by_key.items():
            assert order == sorted(i for i in range(600) if k in keys_of[i])
        assert ch.stats().queued == 0 and ch.stats().inflight == 0


def test_free_message_behind_thousands_blocked_on_a_hot_key_is_handed_out(ch, tx, rx):
    tx.send_many([(i, "hot") for i in range(6000)])
    tx.send(b"free", keys="cold")
    hot = rx.recv(timeout=5)
    assert rx.recv(timeout=2).payload == b"free"
    assert hot.payload == 0


# --- shutdown / iteration ------------------------------------------------------


def test_send_after_shutdown_raises_closed(ch, tx):
    ch.shutdown()
    with pytest.raises(shmchan.Closed):
        tx.send(b"x")


def test_new_sender_after_shutdown_cannot_send(ch):
    ch.shutdown()
    with pytest.raises(shmchan.Closed):
        with shmchan.Sender.open(ch.name) as tx:
            tx.send(b"x")


def test_queued_messages_are_still_received_after_shutdown(ch, tx, rx):
    tx.send(b"1")
    tx.send(b"2")
    ch.shutdown()
    assert rx.recv(timeout=5).payload == b"1"
    assert rx.recv(timeout=5).payload == b"2"


def test_recv_after_shutdown_and_drain_raises_closed(ch, tx, rx):
    tx.send(b"1")
    ch.shutdown()
    rx.recv(timeout=5).release()
    with pytest.raises(shmchan.Closed):
        rx.recv(timeout=1)


@pytest.mark.timeout(30)
def test_blocked_recv_raises_closed_when_the_channel_is_shut_down(ch, rx, bounded):
    timer = threading.Timer(0.2, ch.shutdown)
    timer.start()
    try:
        with pytest.raises(shmchan.Closed):
            bounded(rx.recv, limit=10)
    finally:
        timer.cancel()
        timer.join(5)


@pytest.mark.timeout(30)
def test_iteration_ends_after_shutdown_once_drained(ch, tx, rx, bounded):
    for i in range(3):
        tx.send(i, keys="same")
    ch.shutdown()

    def drain() -> list[int]:
        seen = []
        for h in rx:
            with h:
                seen.append(h.payload)
        return seen

    assert bounded(drain, limit=10) == [0, 1, 2]


@pytest.mark.timeout(30)
def test_iteration_blocks_until_messages_arrive(ch, tx, rx, bounded):
    def produce() -> None:
        time.sleep(0.2)
        tx.send(b"late")
        ch.shutdown()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()

    def drain() -> list[bytes]:
        return [h.payload for h in rx]

    try:
        assert bounded(drain, limit=10) == [b"late"]
    finally:
        producer.join(5)


# --- stats ---------------------------------------------------------------------


def test_stats_is_a_frozen_dataclass(ch):
    st = ch.stats()
    assert isinstance(st, shmchan.Stats)
    assert dataclasses.is_dataclass(st)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.sent = 5  # type: ignore[misc]


def test_stats_has_every_documented_field(ch):
    fields = {f.name for f in dataclasses.fields(ch.stats())}
    assert fields >= {
        "capacity",
        "used_bytes",
        "queued",
        "inflight",
        "held_keys",
        "producers",
        "dead_letters",
        "sent",
        "delivered",
        "released",
        "redelivered",
        "discarded",
    }


def test_stats_of_a_new_channel_are_zero(ch):
    st = ch.stats()
    assert st.capacity == ch.capacity
    assert (st.queued, st.inflight, st.held_keys, st.sent, st.delivered, st.released) == (0,) * 6
    assert (st.redelivered, st.discarded, st.dead_letters) == (0, 0, 0)


def test_stats_count_sent_and_queued(ch, tx):
    tx.send(b"a", keys="k")
    tx.send(b"b", keys="k")
    st = ch.stats()
    assert (st.sent, st.queued, st.delivered) == (2, 2, 0)


def test_stats_count_delivered_inflight_and_held_keys(ch, tx, rx):
    tx.send(b"a", keys=("k1", "k2"))
    tx.send(b"b", keys="k1")
    h = rx.recv(timeout=5)
    st = ch.stats()
    assert (st.delivered, st.queued, st.inflight, st.held_keys) == (1, 1, 1, 2)
    h.release()


def test_stats_count_released(ch, tx, rx):
    tx.send(b"a", keys="k")
    rx.recv(timeout=5).release()
    st = ch.stats()
    assert (st.released, st.inflight, st.held_keys, st.queued) == (1, 0, 0, 0)


def test_stats_count_redelivered_after_nack(ch, tx, rx):
    tx.send(b"a", keys="k")
    rx.recv(timeout=5).nack()
    st = ch.stats()
    assert (st.inflight, st.held_keys, st.queued) == (0, 0, 1)
    rx.recv(timeout=5).release()
    st = ch.stats()
    assert (st.redelivered, st.delivered, st.released) == (1, 2, 1)


def test_stats_used_bytes_grows_with_queued_messages(ch, tx):
    before = ch.stats().used_bytes
    tx.send(bytes(10_000))
    assert ch.stats().used_bytes >= before + 10_000


def test_stats_used_bytes_shrinks_after_release(ch, tx, rx):
    tx.send(bytes(10_000))
    full = ch.stats().used_bytes
    rx.recv(timeout=5).release()
    assert ch.stats().used_bytes <= full - 10_000


def test_backlog_beyond_the_window_keeps_per_key_order(make_channel):
    """Messages evicted from a full window come back in order on every key they carry."""
    ch = make_channel(max_messages=16)
    with ch.sender() as tx, ch.receiver() as rx:
        for i in range(40):
            tx.send(("hot", i), keys=("hot", f"k{i % 3}"))
        tx.send(("cold", 0), keys="cold")
        tx.send(("k1-only", 0), keys="k1")  # behind hot messages on k1: must wait
        first = rx.recv(timeout=5)
        assert first.payload == ("hot", 0)
        assert rx.recv(timeout=2).payload == ("cold", 0)
        assert rx.try_recv() is None
        got = [first.payload]
        first.release()
        while len(got) < 41:
            h = rx.recv(timeout=5)
            got.append(h.payload)
            h.release()
        assert [p for p in got if p[0] == "hot"] == [("hot", i) for i in range(40)]
        # k1-only shares k1 with hot 1, 4, ..., 37: it comes after the last of them
        assert got.index(("k1-only", 0)) > got.index(("hot", 37))
        assert ch.stats().queued == 0


def test_window_full_of_handles_out_still_accepts_and_delivers_later(make_channel):
    ch = make_channel(max_messages=16)
    with ch.sender() as tx, ch.receiver() as rx:
        for i in range(16):
            tx.send(i, keys=f"k{i}")
        held = [rx.recv(timeout=5) for _ in range(16)]
        tx.send("later", keys="free")
        assert rx.try_recv() is None  # every slot of the window is a live handle
        held.pop().release()
        assert rx.recv(timeout=5).payload == "later"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("view", [False, True], ids=["payload", "data-of-others"])
def test_held_and_waiting_messages_do_not_stop_20_mib_of_other_traffic(make_channel, view):
    """Issue #3's case: one handle held for good at the oldest position and a message waiting
    behind it on the same key; a 1 MiB channel still carries 20 MiB on other keys, no Full."""
    ch = make_channel(capacity=1 << 20)
    chunk = bytes(range(256)) * 64  # 16 KiB
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"held", keys="pinned")
        tx.send(b"waits", keys="pinned")
        held = rx.recv(timeout=5)
        assert held.payload == b"held"
        carried = 0
        for i in range((20 << 20) // len(chunk)):
            tx.send(chunk, keys=f"k{i % 7}", timeout=5)  # Full here fails the test
            h = rx.recv(timeout=5)
            data = bytes(h.data) if view else h.payload
            assert data == chunk
            h.release()
            carried += len(chunk)
        assert carried >= 20 << 20
        assert rx.try_recv() is None  # "waits" still waits behind the held one
        assert held.payload == b"held"  # the held record is still readable after moves
        held.release()
        assert rx.recv(timeout=5).payload == b"waits"


@pytest.mark.timeout(30)
def test_a_handled_signal_does_not_cut_a_blocking_recv_short(ch, rx):
    import signal

    old = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=1.0)
        assert time.monotonic() - start >= 0.9  # it kept waiting after the signal
    finally:
        signal.signal(signal.SIGUSR1, old)


def _recreate_in_a_loop(name: str, ready: Any, stop: Any) -> None:
    """A consumer restarting over and over: create the channel, remove it, again."""
    made = 0
    while not stop.is_set():
        try:
            ch = shmchan.Channel.create(name, capacity=1 << 16)
        except shmchan.ChannelExists:
            continue
        made += 1
        if made == 10:
            ready.set()
        ch.unlink()
        ch.close()


@pytest.mark.timeout(60)
def test_opening_a_name_being_recreated_says_not_found_or_opens(chan_name):
    """While another process creates and unlinks the name in a loop, open() either opens
    the channel or says ChannelNotFound: it waits for a creation in progress instead of
    calling a half-made channel a LayoutMismatch, and an unlink between mapping the
    segment and opening its semaphores is ChannelNotFound, not a raw FileNotFoundError."""
    ready, stop = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_recreate_in_a_loop, args=(chan_name, ready, stop))
    seen: dict[str, int] = {}
    with running(p):
        assert ready.wait(WAIT)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            try:
                shmchan.Channel.open(chan_name).close()
                kind = "opened"
            except Exception as e:  # noqa: BLE001 - counting every kind is the point
                kind = type(e).__name__
            seen[kind] = seen.get(kind, 0) + 1
        stop.set()
        p.join(WAIT)
    assert seen.get("opened", 0) > 0 and seen.get("ChannelNotFound", 0) > 0, seen
    assert set(seen) == {"opened", "ChannelNotFound"}, seen


def test_lease_reads_back_from_every_attachment(make_channel, new_chan_name):
    leased = make_channel(lease=2.5)
    assert leased.lease == 2.5
    other = shmchan.Channel.open(leased.name)
    try:
        assert other.lease == 2.5
    finally:
        other.close()
    assert make_channel().lease is None
