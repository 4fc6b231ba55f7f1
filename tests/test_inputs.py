"""Wrong inputs get a clear shmchan.Error at once; batches are all-or-nothing."""

from __future__ import annotations

import copy
import math
import os
import pickle

import pytest

import shmchan

NAN = float("nan")


def _drain(rx: shmchan.Receiver) -> list[int]:
    """The seqs of everything ready, each released once received."""
    out = []
    while (h := rx.try_recv()) is not None:
        out.append(h.seq)
        h.release()
    return out


# --------------------------------------------------------------------------- send_many


@pytest.fixture(params=["fast", "slow"])
def sender(request, ch):
    """A sender whose send_many takes the C fast path (registered) or the Python one."""
    tx = ch.sender()
    if request.param == "fast":
        tx.send(b"registers the producer")
        ch.receiver().recv(timeout=5).release()
    return tx


BAD_THIRD_ITEMS = {
    "oversize": (b"x" * (2 << 20), ()),
    "key type": (b"ok", (1.5,)),
    "too many keys": (b"ok", tuple(range(9))),
    "not a pair": (b"ok",),
}


@pytest.mark.parametrize("bad", BAD_THIRD_ITEMS)
def test_send_many_with_a_bad_item_sends_nothing(ch, sender, bad):
    sent_before = ch.stats().sent
    items = [(b"1", "k"), (b"2", "k"), BAD_THIRD_ITEMS[bad], (b"4", "k")]
    with pytest.raises(shmchan.Error):
        sender.send_many(items)
    assert ch.stats().sent == sent_before


def test_send_many_with_an_object_in_a_raw_channel_sends_nothing(make_channel):
    ch = make_channel(serializer="raw")
    tx = ch.sender()
    with pytest.raises(shmchan.UnsupportedType, match="raw"):
        tx.send_many([(b"1", ()), (b"2", ()), ({"an": "object"}, ())])
    assert ch.stats().sent == 0


def test_send_many_too_large_names_the_item_and_the_figures(ch, sender):
    with pytest.raises(shmchan.MessageTooLarge) as e:
        sender.send_many([(b"1", ()), (b"2", ()), (b"x" * (2 << 20), ())])
    text = str(e.value)
    assert "item 2" in text and "nothing was sent" in text
    assert str(2 << 20) in text and str(ch.capacity) in text


def test_full_part_way_carries_the_seqs_that_went_in(make_channel):
    ch = make_channel(capacity=4096)
    tx, rx = ch.sender(), ch.receiver()
    with pytest.raises(shmchan.Full) as e:
        tx.send_many([(b"y" * 200, "k")] * 40, timeout=0.05)
    seqs = e.value.seqs
    assert 0 < len(seqs) < 40
    assert _drain(rx) == seqs


def test_full_from_send_has_no_seqs(make_channel):
    ch = make_channel(capacity=4096)
    tx = ch.sender()
    with pytest.raises(shmchan.Full) as e:
        while True:
            tx.send(b"y" * 500, timeout=0)
    assert e.value.seqs == []


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("make", [bytearray, memoryview, lambda b: memoryview(bytearray(b))])
def test_a_bytes_like_key_is_one_bytes_key(ch, tx, rx, make):
    tx.send(b"a", keys=make(b"user-1"))
    tx.send(b"b", keys=b"user-1")
    tx.send(b"c", keys=(make(b"user-2"), "x"))
    h = rx.recv(timeout=5)
    assert h.keys == (b"user-1",)
    # the same key as bytes: the second message waits for the first
    h3 = rx.recv(timeout=5)
    assert h3.payload == b"c" and h3.keys == (b"user-2", "x")
    assert rx.try_recv() is None
    h.release()
    assert rx.recv(timeout=5).keys == (b"user-1",)


def test_a_bytes_like_key_does_not_become_one_int_key_per_byte(ch, tx, rx):
    tx.send(b"a", keys=bytearray(b"\x01\x02"))
    tx.send(b"b", keys=1)  # an unrelated key
    h1, h2 = rx.recv(timeout=5), rx.recv(timeout=5)
    assert h1.keys == (b"\x01\x02",) and h2.keys == (1,)


# --------------------------------------------------------------------------- timeouts


def test_nan_timeouts_are_refused_at_once(make_channel, bounded):
    ch = make_channel(capacity=4096)
    tx, rx = ch.sender(), ch.receiver()
    calls = {
        "recv": lambda: rx.recv(timeout=NAN),
        "recv_many": lambda: rx.recv_many(4, timeout=NAN),
        "send": lambda: tx.send(b"x", timeout=NAN),
        "send_many": lambda: tx.send_many([(b"x", ())], timeout=NAN),
    }
    for what, call in calls.items():
        with pytest.raises(shmchan.InvalidArgument, match="NaN") as e:
            bounded(call, limit=5)
        assert isinstance(e.value, ValueError), what
    # the same on a full channel, where send would wait
    with pytest.raises(shmchan.Full):
        while True:
            tx.send(b"y" * 500, timeout=0)
    for call in (lambda: tx.send(b"x", timeout=NAN), lambda: tx.send({"o": 1}, timeout=NAN)):
        with pytest.raises(shmchan.InvalidArgument):
            bounded(call, limit=5)
    assert ch.stats().sent == len(_drain(rx))


@pytest.mark.parametrize("timeout", ["1", b"1", [1], True])
def test_a_timeout_that_is_not_a_number_names_the_argument(ch, tx, rx, timeout):
    for call in (
        lambda: rx.recv(timeout=timeout),
        lambda: rx.recv_many(2, timeout=timeout),
        lambda: tx.send(b"x", timeout=timeout),
        lambda: tx.send_many([(b"x", ())], timeout=timeout),
    ):
        with pytest.raises(shmchan.UnsupportedType, match="timeout must be a number") as e:
            call()
        assert type(timeout).__name__ in str(e.value)
        assert isinstance(e.value, TypeError)
    assert ch.stats().sent == 0


def test_an_infinite_timeout_means_no_timeout(ch, tx, rx):
    tx.send(b"x", timeout=math.inf)
    tx.send_many([(b"y", ())], timeout=math.inf)
    assert rx.recv(timeout=math.inf).payload == b"x"
    assert [h.payload for h in rx.recv_many(2, timeout=math.inf)] == [b"y"]


def test_negative_timeout_is_an_invalid_argument(ch, tx, rx):
    with pytest.raises(shmchan.InvalidArgument):
        rx.recv(timeout=-1)
    with pytest.raises(shmchan.InvalidArgument):
        tx.send(b"x", timeout=-0.5)


def test_lease_inf_means_no_lease_and_nan_is_refused(make_channel, chan_name):
    ch = make_channel(lease=math.inf)
    ch.sender().send(b"x")
    h = ch.receiver().recv(timeout=5)
    h.extend(math.inf)
    h.release()
    for lease in (NAN, -1.0, 0):
        with pytest.raises(shmchan.InvalidArgument, match="lease"):
            shmchan.Channel.create(chan_name, lease=lease)
    with pytest.raises(shmchan.UnsupportedType, match="lease"):
        shmchan.Channel.create(chan_name, lease="10")


def test_extend_refuses_nan(ch, tx, rx):
    tx.send(b"x")
    h = rx.recv(timeout=5)
    with pytest.raises(shmchan.InvalidArgument):
        h.extend(NAN)
    h.release()


# --------------------------------------------------------------------------- errors


def test_message_too_large_gives_the_size_and_the_limit(make_channel):
    ch = make_channel(capacity=4096)
    with pytest.raises(shmchan.MessageTooLarge) as e:
        ch.sender().send(b"x" * 5000)
    text = str(e.value)
    assert "5000" in text and "4096" in text


def test_a_non_contiguous_memoryview_payload_says_what_to_do(ch, tx):
    view = memoryview(b"abcdefgh")[::2]
    with pytest.raises(shmchan.PayloadNotContiguous, match="tobytes"):
        tx.send(view)
    with pytest.raises(shmchan.InvalidArgument, match="tobytes"):
        tx.send_many([(b"ok", ()), (view, ())])
    with pytest.raises(BufferError):  # its builtin
        tx.send(view)
    assert ch.stats().sent == 0


def test_a_receiver_used_in_a_forked_child_says_so(ch, tx, rx):
    tx.send(b"x")
    pid = os.fork()
    if pid == 0:  # the child: exit code says what it saw
        code = 3
        try:
            rx.recv(timeout=0)
        except shmchan.WrongProcess as e:
            code = 0 if "forked child" in str(e) else 4
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rx.recv(timeout=5).payload == b"x"  # the parent still receives


@pytest.mark.parametrize(
    "call",
    [
        lambda: shmchan.Channel.create("bad/name"),
        lambda: shmchan.Channel.open(42),
        lambda: shmchan.Channel.create("ok-name", capacity="big"),
        lambda: shmchan.Channel.create("ok-name", capacity=1),
        lambda: shmchan.Channel.create("ok-name", order="lifo"),
        lambda: shmchan.Channel.create("ok-name", max_keys=100),
        lambda: shmchan.Channel.create("ok-name", serializer="json"),
        lambda: shmchan.Channel.create("ok-name", max_messages=1 << 25),
    ],
)
def test_bad_arguments_raise_shmchan_errors(call):
    with pytest.raises(shmchan.Error):
        call()


def test_bad_keys_and_batches_raise_shmchan_errors(ch, tx, rx):
    for call in (
        lambda: tx.send(b"x", keys=1.5),
        lambda: tx.send(b"x", keys=object()),
        lambda: tx.send(b"x", keys="k" * 70000),
        lambda: tx.send(b"x", keys=tuple(range(9))),
        lambda: tx.send_many([(b"x", 1.5)]),
        lambda: tx.send_many([(b"x", ()), (b"y",)]),
        lambda: tx.send_many(42),
        lambda: rx.recv_many(0),
        lambda: rx.recv_many("2"),
        lambda: rx.release_many([1, 2]),
    ):
        with pytest.raises(shmchan.Error):
            call()


# --------------------------------------------------------------------------- item 9


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_a_handle_cannot_be_copied(ch, tx, rx, how):
    tx.send(b"x", keys="k")
    tx.send(b"y", keys="k")
    h = rx.recv(timeout=5)
    with pytest.raises(shmchan.UnsupportedType, match="cannot be copied"):
        how(h)
    assert rx.try_recv() is None  # still held: "k" is locked
    h.release()
    assert rx.recv(timeout=5).payload == b"y"


def test_pickling_still_hands_a_handle_over(ch, tx, rx):
    tx.send(b"x")
    h = pickle.loads(pickle.dumps(rx.recv(timeout=5)))
    assert h.payload == b"x"
    h.release()


def test_a_receiver_whose_channel_was_closed_raises_closed(make_channel):
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"x")
    ch.close()
    for call in (
        lambda: rx.recv(timeout=0),
        lambda: rx.recv(),
        rx.try_recv,
        lambda: rx.recv_many(4, timeout=0),
    ):
        with pytest.raises(shmchan.Closed, match="Channel it came from was closed"):
            call()
    with pytest.raises(shmchan.Closed):
        tx.send(b"y")  # as a sender does


def test_try_recv_on_a_shut_down_drained_channel_raises_closed_every_time(ch, tx, rx):
    tx.send(b"x")
    ch.shutdown()
    h = rx.try_recv()
    assert h is not None and h.payload == b"x"
    h.release()
    for _ in range(3):
        with pytest.raises(shmchan.Closed, match="drained"):
            rx.try_recv()
        with pytest.raises(shmchan.Closed, match="drained"):
            rx.recv(timeout=0)


def test_try_recv_right_after_shutdown_of_an_empty_channel_raises_closed(ch, rx):
    ch.shutdown()
    with pytest.raises(shmchan.Closed):
        rx.try_recv()


# --------------------------------------------------------------------------- pickling


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("no pickling here")


@pytest.mark.parametrize("payload", [_Unpicklable(), {"lock": __import__("threading").Lock()}])
def test_an_unpicklable_payload_is_a_shmchan_error_naming_its_type(ch, sender, payload):
    sent_before = ch.stats().sent
    with pytest.raises(shmchan.PayloadNotPicklable) as info:
        sender.send(payload, keys=("k",))
    err = info.value
    assert isinstance(err, shmchan.Error) and isinstance(err, TypeError)
    assert type(payload).__qualname__ in str(err) and "bytes you encode" in str(err)
    with pytest.raises(shmchan.PayloadNotPicklable, match=type(payload).__qualname__):
        sender.send_many([(b"first", ("k",)), (payload, ("k",))])
    assert ch.stats().sent == sent_before  # nothing of either went in
