"""The C hot path (csrc/hot/) against the Python definitions it replaces.

`_shmchan_hot` re-implements send, send_many's packing, recv, recv_many, release,
release_many, payload and release-on-collection in C, and hands everything else to the
Python methods of shmchan/channel.py and shmchan/codec.py. Each test here pins one
behaviour where the two could drift apart: the key encoding (byte for byte), which
messages conflict, payload copies, argument errors, handle lifecycle, closed objects,
and exactly-once delivery through both send paths.
"""

from __future__ import annotations

import array
import gc
import os
import pickle
import signal
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import _shmchan_hot as _hot
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmchan
from shmchan import codec
from shmchan._lib import ffi, lib

# --- helpers -------------------------------------------------------------------------

INT64_EDGES = [
    0,
    1,
    -1,
    2**7,
    -(2**7),
    2**7 - 1,
    -(2**7) - 1,
    2**8,
    -(2**8),
    2**8 - 1,
    2**15,
    -(2**15),
    2**15 - 1,
    -(2**15) - 1,
    2**16,
    2**31,
    -(2**31),
    2**31 - 1,
    -(2**31) - 1,
    2**32,
    2**63 - 1,
    -(2**63),
    2**62,
    -(2**62),
]
BEYOND_INT64 = [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30, -(10**30)]


class StrKey(str):
    pass


class BytesKey(bytes):
    pass


class IntKey(int):
    pass


def normalized(keys: Any) -> tuple[Any, ...]:
    """What codec.encode_keys means by `keys`: one key, or distinct keys in order of
    first occurrence (values compare equal only within a type for the keys used here)."""
    if keys is None:
        return ()
    if isinstance(keys, (str, bytes, int)):
        return (keys,)
    return tuple(dict.fromkeys(keys))


def u32s(b: bytes) -> list[int]:
    return [v for (v,) in struct.iter_unpack("=I", b)]


def u64s(b: bytes) -> list[int]:
    return [v for (v,) in struct.iter_unpack("=Q", b)]


def packed_keys(tx: shmchan.Sender, keys: Any) -> tuple[bytes, int]:
    """The key blob and count Sender._pack (the C encoder) produces for one message."""
    n, _kinds, _data, _lens, keyblob, klens, nkeys = tx._pack([(b"x", keys)])
    assert n == 1
    assert u32s(klens) == [len(keyblob)]
    (count,) = u32s(nkeys)
    return keyblob, count


def outcome(fn: Any, *args: Any) -> Any:
    """fn(*args), or the type of the exception it raised."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - compared by type below
        return type(e)


def _bind_hot(encode_keys: Any) -> None:
    """Re-wire _shmchan_hot exactly as shmchan.channel does, with another encode_keys."""
    _hot.bind(
        # every core function: bind() takes the ones it calls
        {
            name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
            for name in dir(lib)
            if name.startswith("shm_")
        },
        shmchan.Handle,
        codec.encode_payload,
        encode_keys,
        shmchan.Batch,  # as shmchan.handle binds it: later tests get Batch objects
    )


@pytest.fixture
def python_key_encodings() -> Iterator[list[Any]]:
    """The keys Sender._pack hands to codec.encode_keys (i.e. not encoded in C)."""
    calls: list[Any] = []

    def spy(keys: Any, max_keys: int) -> tuple[bytes, int]:
        calls.append(keys)
        return codec.encode_keys(keys, max_keys)

    _bind_hot(spy)
    try:
        yield calls
    finally:
        _bind_hot(codec.encode_keys)


@pytest.fixture
def slow_sends(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The payloads Sender.send hands to the Python `_send_slow` (C looks it up by name)."""
    calls: list[Any] = []
    original = shmchan.Sender._send_slow

    def spy(self: shmchan.Sender, obj: object, keys: Any, timeout: Any) -> int:
        calls.append(obj)
        return original(self, obj, keys, timeout)

    monkeypatch.setattr(shmchan.Sender, "_send_slow", spy)
    return calls


def warm_up(tx: shmchan.Sender, rx: shmchan.Receiver) -> None:
    """One message through, so the sender is registered and the next send may be C's."""
    tx.send(b"warm-up", keys="warm-up")
    rx.recv(timeout=5).release()


# --- 1. key encoding: C == codec.encode_keys, byte for byte ---------------------------

surrogates = st.text(alphabet=st.sampled_from(["a", "\u00e9", "\ud800", "\udfff", "\U0001f600"]))
str_keys = st.one_of(
    st.just(""),
    st.text(max_size=16),
    st.text(alphabet=st.characters(min_codepoint=0x80), max_size=8),
    surrogates,
    st.text(max_size=8).map(StrKey),
)
bytes_keys = st.one_of(st.just(b""), st.binary(max_size=16), st.binary(max_size=4).map(BytesKey))
int_keys = st.one_of(
    st.sampled_from(INT64_EDGES),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from(BEYOND_INT64),
    st.integers(-(2**100), 2**100),
    st.integers(-1000, 1000).map(IntKey),
)
one_key = st.one_of(str_keys, bytes_keys, int_keys)
key_lists = st.one_of(
    st.lists(one_key, max_size=8),
    # few distinct values, many repeats: duplicates to merge
    st.lists(one_key, min_size=1, max_size=3).flatmap(
        lambda pool: st.lists(st.sampled_from(pool), max_size=8)
    ),
)
any_keys = st.one_of(st.none(), one_key, key_lists, key_lists.map(tuple))


@pytest.fixture
def senders(make_channel) -> dict[int, shmchan.Sender]:
    """Senders of channels with max_keys 8, 3 and 0 (made once per test, not per example)."""
    return {m: make_channel(max_keys=m).sender() for m in (8, 3, 0)}


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keys=any_keys)
def test_c_key_encoder_matches_codec_encode_keys(senders, keys):
    for max_keys, tx in senders.items():
        expected = outcome(codec.encode_keys, keys, max_keys)
        assert outcome(packed_keys, tx, keys) == expected, (keys, max_keys)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(st.one_of(st.none(), one_key, key_lists.map(tuple)), max_size=6))
def test_packed_batch_concatenates_each_messages_key_blob(tx, batch):
    n, kinds, data, lens, keyblob, klens, nkeys = tx._pack(
        [(b"p%d" % i, k) for i, k in enumerate(batch)]
    )
    encoded = [codec.encode_keys(k, 8) for k in batch]
    assert n == len(batch)
    assert keyblob == b"".join(blob for blob, _ in encoded)
    assert u32s(klens) == [len(blob) for blob, _ in encoded]
    assert u32s(nkeys) == [count for _, count in encoded]
    assert u32s(kinds) == [codec.RAW] * n
    assert data == b"".join(b"p%d" % i for i in range(n))
    assert u64s(lens) == [len(b"p%d" % i) for i in range(n)]


@pytest.mark.parametrize(
    "keys",
    [
        None,
        (),
        [],
        "",
        "k",
        "\u043a\u043b\u044e\u0447",
        b"",
        b"\x00\xff",
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**63,  # ints of any size and lone surrogates: the one key codec is C's
        -(2**63) - 1,
        "\ud800",
    ]
    + [(1, "1", b"1", 1, "1"), ["a", "a", "a"], tuple(range(8)), ("x" * 300,) * 3, (1, 2**64)],
    ids=lambda k: repr(k)[:40],
)
def test_c_key_encoder_takes_plain_keys_without_python(tx, python_key_encodings, keys):
    assert packed_keys(tx, keys) == codec.encode_keys(keys, 8)
    assert python_key_encodings == []


UNUSUAL_KEYS = {
    "str-subclass": lambda: StrKey("k"),
    "bytes-subclass": lambda: BytesKey(b"k"),
    "int-subclass": lambda: IntKey(3),
    "tuple-with-big-int-subclass": lambda: (1, IntKey(2**64)),
    "iterator": lambda: iter(["a", "b"]),
    "dict": lambda: {"a": 1},
    "3000-byte-key": lambda: ("y" * 3000,),
}


@pytest.mark.parametrize("make_keys", UNUSUAL_KEYS.values(), ids=UNUSUAL_KEYS.keys())
def test_c_key_encoder_leaves_unusual_keys_to_codec(tx, python_key_encodings, make_keys):
    assert packed_keys(tx, make_keys()) == codec.encode_keys(make_keys(), 8)
    assert len(python_key_encodings) == 1


# --- 2. end to end: keys as sent, and which messages conflict -----------------------


@pytest.mark.parametrize(
    "keys",
    [
        None,
        (),
        7,
        -(2**63),
        2**64,
        "",
        "\u00e9t\u00e9",
        "\udc80",
        b"",
        b"\x00raw",
        (3, "a", 3, b"a", "a"),
        ["x", "x"],
        (0, -1, 255, -256, 2**31, "0", b"0"),
        tuple(range(8)) + tuple(range(8)),
    ],
    ids=lambda k: repr(k)[:40],
)
@pytest.mark.parametrize("payload", [b"bytes", bytearray(b"bytearray"), {"pickled": [1]}])
def test_received_keys_and_payload_equal_what_was_sent(tx, rx, keys, payload):
    seq = tx.send(payload, keys)
    with rx.recv(timeout=5) as h:
        assert h.seq == seq
        assert h.keys == normalized(keys)
        assert h.payload == (bytes(payload) if isinstance(payload, bytearray) else payload)
        # the blob stored in the segment is codec's encoding, whichever path sent it
        assert h._copy(keys=True) == codec.encode_keys(keys, 8)[0]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keys=any_keys)
def test_send_stores_codecs_key_blob(tx, rx, keys):
    tx.send(b"p", keys)
    h = rx.recv(timeout=5)
    try:
        blob, count = codec.encode_keys(keys, 8)
        assert h._copy(keys=True) == blob
        assert h._nkeys == count
        assert h.keys == codec.decode_keys(blob, count)
    finally:
        h.release()
    assert rx.try_recv() is None


@pytest.mark.parametrize(
    "key",
    [5, 0, -(2**63), 2**63 - 1, "k", "", "\u043a", b"k", b"", ("a", 1), ["b", b"b", 2]],
    ids=lambda k: repr(k)[:40],
)
@pytest.mark.parametrize("fast_first", [True, False], ids=["fast-then-slow", "slow-then-fast"])
@pytest.mark.parametrize("fast", [b"fast", bytearray(b"fast")], ids=["bytes", "bytearray"])
def test_same_key_through_fast_and_slow_send_conflicts(tx, rx, slow_sends, key, fast_first, fast):
    warm_up(tx, rx)
    slow_sends.clear()
    slow = {"pickled": 1}  # a non-bytes payload takes Python's _send_slow
    first, second = (fast, slow) if fast_first else (slow, fast)
    tx.send(first, key)
    tx.send(second, key)
    assert slow_sends == [slow]  # exactly one of the two went through Python
    h = rx.recv(timeout=5)
    assert (h.payload, h.keys) == (first, normalized(key))
    assert rx.try_recv() is None  # same keys: waits for the first handle
    h.release()
    h2 = rx.recv(timeout=5)
    assert (h2.payload, h2.keys) == (second, normalized(key))
    h2.release()


@pytest.mark.parametrize(
    "fast_key, make_slow_key",
    [
        ("k", lambda: StrKey("k")),
        (b"k", lambda: BytesKey(b"k")),
        (7, lambda: IntKey(7)),
        (2**62, lambda: (k for k in [2**62])),
        (("a", "b"), lambda: iter(["b", "a"])),
        (2**70, lambda: IntKey(2**70)),
    ],
    ids=["str-subclass", "bytes-subclass", "int-subclass", "generator", "iterator", "bigint"],
)
def test_key_taking_the_python_path_conflicts_with_the_same_key_in_c(
    tx, rx, slow_sends, fast_key, make_slow_key
):
    warm_up(tx, rx)
    slow_sends.clear()
    tx.send(b"1", fast_key)
    tx.send(b"2", make_slow_key())  # bytes payload, but a key C leaves to codec.py
    assert slow_sends == [b"2"]
    h = rx.recv(timeout=5)
    assert h.payload == b"1"
    assert rx.try_recv() is None
    h.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_int_str_and_bytes_keys_of_the_same_text_are_different_keys(tx, rx):
    tx.send(b"int", 1)
    tx.send(b"tuple", (1,))  # the same key as 1
    tx.send(b"str", "1")
    tx.send(b"bytes", b"1")
    h = rx.recv(timeout=5)
    assert (h.payload, h.keys) == (b"int", (1,))
    others = [rx.recv(timeout=5), rx.recv(timeout=5)]
    assert sorted((o.payload, o.keys) for o in others) == [(b"bytes", (b"1",)), (b"str", ("1",))]
    assert rx.try_recv() is None  # (1,) waits for 1
    h.release()
    h2 = rx.recv(timeout=5)
    assert (h2.payload, h2.keys) == (b"tuple", (1,))
    rx.release_many(others + [h2])


def test_duplicate_keys_lock_once(tx, rx):
    tx.send(b"1", ("k", "k", "k"))
    tx.send(b"2", ["j", "j"])
    a, b = rx.recv(timeout=5), rx.recv(timeout=5)
    assert (a.keys, b.keys) == (("k",), ("j",))
    rx.release_many([a, b])


# --- 3. payload copies ----------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00" * 100,
        bytearray(b""),
        bytearray(b"bytearray"),
        memoryview(b"memoryview"),
        memoryview(b"__slice__")[2:7],
        memoryview(array.array("H", [1, 2, 65535])),
        BytesKey(b"bytes subclass"),
    ],
    ids=[
        "empty",
        "zeros",
        "empty-bytearray",
        "bytearray",
        "memoryview",
        "slice",
        "u16",
        "subclass",
    ],
)
@pytest.mark.parametrize("how", ["send", "send_many"])
def test_bytes_like_payload_arrives_as_equal_bytes(tx, rx, payload, how):
    if how == "send":
        tx.send(payload, "k")
    else:
        tx.send_many([(payload, "k")])
    h = rx.recv(timeout=5)
    assert type(h.payload) is bytes
    assert h.payload == bytes(payload)
    assert h._kind == codec.RAW
    assert bytes(h.data) == bytes(payload)
    h.release()


@pytest.mark.parametrize("how", ["send", "send_many"])
def test_bytearray_mutated_after_send_does_not_change_the_message(tx, rx, how):
    buf = bytearray(b"original")
    if how == "send":
        tx.send(buf)
    else:
        tx.send_many([(buf, None)])
    buf[:] = b"MUTATED!"
    buf.extend(b" and longer")
    with rx.recv(timeout=5) as h:
        assert h.payload == b"original"


def test_non_contiguous_memoryview_is_refused_by_both_send_paths(ch, tx):
    view = memoryview(b"abcdef")[::2]
    with pytest.raises(BufferError):
        tx.send(view)
    with pytest.raises(BufferError):
        tx.send_many([(view, None)])
    assert ch.stats().sent == 0


def test_raw_channel_refuses_objects_in_send_and_send_many(make_channel):
    ch = make_channel(serializer="raw")
    tx, rx = ch.sender(), ch.receiver()
    try:
        with pytest.raises(TypeError):
            tx.send({"a": 1})
        with pytest.raises(TypeError):
            tx.send_many([(b"ok", None), ({"a": 1}, None)])
        assert ch.stats().sent == 0
        tx.send(b"1")
        tx.send(bytearray(b"2"))
        tx.send_many([(memoryview(b"3"), None)])
        got = rx.recv_many(8, timeout=5)
        assert [h.payload for h in got] == [b"1", b"2", b"3"]
        rx.release_many(got)
    finally:
        rx.close()


# --- 4. wrong arguments raise at once, nothing is sent --------------------------------

BAD_SENDS = {
    "no-args": (lambda tx: tx.send(), TypeError),
    "unknown-keyword": (lambda tx: tx.send(b"x", keys=1, bogus=2), TypeError),
    "too-many-positional": (lambda tx: tx.send(b"x", 1, None, 4), TypeError),
    "keys-twice": (lambda tx: tx.send(b"x", 1, keys=2), TypeError),
    "negative-timeout": (lambda tx: tx.send(b"x", timeout=-1), ValueError),
    "negative-float-timeout": (lambda tx: tx.send(b"x", "k", -0.5), ValueError),
    "negative-timeout-pickled": (lambda tx: tx.send({"a": 1}, timeout=-1), ValueError),
    "str-timeout": (lambda tx: tx.send(b"x", timeout="1"), TypeError),
    "float-key": (lambda tx: tx.send(b"x", 1.5), TypeError),
    "float-in-keys": (lambda tx: tx.send(b"x", ("a", 1.5)), TypeError),
    "bool-key": (lambda tx: tx.send(b"x", True), TypeError),
    "bool-in-keys": (lambda tx: tx.send(b"x", (1, False)), TypeError),
    "none-in-keys": (lambda tx: tx.send(b"x", ("a", None)), TypeError),
    "object-key": (lambda tx: tx.send(b"x", object()), TypeError),
    "too-many-keys": (lambda tx: tx.send(b"x", tuple(range(9))), shmchan.TooManyKeys),
    "too-many-str-keys": (
        lambda tx: tx.send(b"x", [str(i) for i in range(9)]),
        shmchan.TooManyKeys,
    ),
    "key-too-long": (lambda tx: tx.send(b"x", "a" * 70000), ValueError),
    "send_many-bool-key": (lambda tx: tx.send_many([(b"ok", 1), (b"x", True)]), TypeError),
    "send_many-too-many-keys": (
        lambda tx: tx.send_many([(b"ok", 1), (b"x", list(range(9)))]),
        shmchan.TooManyKeys,
    ),
    "send_many-not-a-pair": (lambda tx: tx.send_many([(b"ok", 1), (b"x",)]), TypeError),
    "send_many-triple": (lambda tx: tx.send_many([(b"x", 1, 2)]), TypeError),
    "send_many-negative-timeout": (lambda tx: tx.send_many([(b"x", 1)], timeout=-1), ValueError),
}


@pytest.mark.parametrize("call, exc", BAD_SENDS.values(), ids=BAD_SENDS.keys())
def test_bad_send_raises_its_exception_and_sends_nothing(ch, tx, rx, call, exc):
    warm_up(tx, rx)  # registered: the next send would be C's fast path if it took it
    with pytest.raises(exc):
        call(tx)
    assert ch.stats().sent == 1  # the warm-up only
    assert rx.try_recv() is None


def test_too_many_keys_is_a_value_error(tx):
    with pytest.raises(ValueError):
        tx.send(b"x", list(range(9)))


def test_duplicates_do_not_count_towards_max_keys(tx, rx):
    keys = [*range(8), *range(8), 7, 0]
    tx.send(b"x", keys)
    with rx.recv(timeout=5) as h:
        assert h.keys == tuple(range(8))


def test_max_keys_zero_refuses_any_key_and_accepts_none(make_channel):
    ch = make_channel(max_keys=0)
    tx = ch.sender()
    for keys in ("k", 1, b"k", ("k",)):
        with pytest.raises(shmchan.TooManyKeys):
            tx.send(b"x", keys)
    tx.send(b"x")
    tx.send(b"x", ())
    tx.send(b"x", None)
    assert ch.stats().sent == 3


def test_64_distinct_keys_is_the_limit(make_channel):
    ch = make_channel(max_keys=64)
    tx, rx = ch.sender(), ch.receiver()
    try:
        keys = [f"k{i}" for i in range(64)]
        tx.send(b"x", keys + keys[::-1])
        with rx.recv(timeout=5) as h:
            assert h.keys == tuple(keys)
        with pytest.raises(shmchan.TooManyKeys):
            tx.send(b"x", [*keys, "one more"])
        with pytest.raises(shmchan.TooManyKeys):
            tx.send_many([(b"x", [*keys, "one more"])])
    finally:
        rx.close()


def test_recv_with_negative_timeout_raises_even_with_a_message_ready(tx, rx):
    tx.send(b"ready")
    with pytest.raises(ValueError):
        rx.recv(timeout=-1)
    with pytest.raises(ValueError):
        rx.recv(-0.001)
    with pytest.raises(ValueError):
        rx.recv_many(4, timeout=-1)
    with rx.recv(timeout=5) as h:  # still there
        assert h.payload == b"ready"


@pytest.mark.parametrize("timeout", [-(2**40), -(10**30)], ids=repr)
def test_recv_and_send_with_a_large_negative_int_timeout_raise(tx, rx, timeout):
    """The sign of an int timeout of any size decides, not its low digits."""
    tx.send(b"ready")
    with pytest.raises(ValueError):
        rx.recv(timeout)
    with pytest.raises(ValueError):
        tx.send(b"x", timeout=timeout)
    with rx.recv(timeout=5) as h:  # still there, and alone
        assert h.payload == b"ready"


def test_recv_and_send_accept_a_huge_int_timeout(tx, rx):
    tx.send(b"x", timeout=10**30)
    with rx.recv(10**30) as h:
        assert h.payload == b"x"


@pytest.mark.parametrize("max_items", [0, -1, "3", 3.0, None, True], ids=repr)
def test_recv_many_with_a_bad_count_raises_value_error(tx, rx, max_items):
    tx.send(b"ready")
    with pytest.raises(ValueError):
        rx.recv_many(max_items)
    with rx.recv(timeout=5) as h:  # nothing was handed out
        assert h.payload == b"ready"


def test_recv_many_with_a_huge_count_takes_what_there_is(tx, rx):
    for i in range(3):
        tx.send(b"%d" % i)
    got = rx.recv_many(2**70, timeout=5)
    assert [h.payload for h in got] == [b"0", b"1", b"2"]
    rx.release_many(got)


@pytest.mark.parametrize(
    "call",
    [lambda rx: rx.recv(1, 2), lambda rx: rx.recv(bogus=1), lambda rx: rx.recv_many(1, 1, 1)],
    ids=["recv-two-args", "recv-bogus-keyword", "recv_many-three-args"],
)
def test_recv_with_wrong_arguments_raises_type_error(tx, rx, call):
    tx.send(b"ready")
    with pytest.raises(TypeError):
        call(rx)
    with rx.recv(timeout=5) as h:
        assert h.payload == b"ready"


def test_release_many_of_a_non_handle_raises_type_error_and_releases_nothing(tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    with pytest.raises(TypeError):
        rx.release_many([object()])
    with pytest.raises(TypeError):
        rx.release_many([h, object()])
    with pytest.raises(TypeError):
        rx.release_many(5)
    assert rx.try_recv() is None  # h still holds "k"
    h.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_release_many_with_a_handle_of_another_channel_raises_value_error(make_channel, tx, rx):
    other = make_channel()
    otx, orx = other.sender(), other.receiver()
    try:
        otx.send(b"other", "k")
        tx.send(b"1", "k")
        tx.send(b"2", "k")
        foreign, mine = orx.recv(timeout=5), rx.recv(timeout=5)
        with pytest.raises(ValueError):
            rx.release_many([mine, foreign])
        assert rx.try_recv() is None  # not even `mine` was released
        assert other.stats().released == 0
        rx.release_many([mine])
        orx.release_many([foreign])
        assert rx.recv(timeout=5).payload == b"2"
        assert other.stats().released == 1
    finally:
        orx.close()


def test_release_many_takes_handles_of_another_attachment_of_the_same_channel(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    adopted = pickle.loads(pickle.dumps(h))  # re-attaches by name: another _Segment
    assert adopted._seg is not h._seg
    rx.release_many([adopted])
    assert adopted._done
    assert rx.recv(timeout=5).payload == b"2"


# --- 5. handle lifecycle --------------------------------------------------------------


def test_dropped_handle_releases_its_key(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    assert rx.try_recv() is None
    del h
    gc.collect()
    assert ch.stats().released == 1
    with rx.recv(timeout=5) as h2:
        assert h2.payload == b"2"


def test_dropped_handles_of_recv_many_release_their_keys(ch, tx, rx):
    for i in range(4):
        tx.send(b"%d" % i, f"k{i % 2}")
    got = rx.recv_many(8, timeout=5)
    assert [h.payload for h in got] == [b"0", b"1"]
    del got
    gc.collect()
    rest = rx.recv_many(8, timeout=5)
    assert [h.payload for h in rest] == [b"2", b"3"]
    rx.release_many(rest)
    assert ch.stats().released == 4


def test_pickled_away_handle_is_not_released_when_dropped(tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    blob = pickle.dumps(h)
    assert h._pid == -1
    del h
    gc.collect()
    assert rx.try_recv() is None  # whoever unpickles `blob` holds it now
    pickle.loads(blob).release()
    assert rx.recv(timeout=5).payload == b"2"


def test_handle_dropped_in_a_forked_child_stays_held_by_the_parent(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            del h
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rx.try_recv() is None  # the child's copy did not release the parent's handle
    assert ch.stats().released == 0
    h.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_with_releases_on_exit(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    with rx.recv(1) as h:
        assert h.payload == b"1"
        assert rx.try_recv() is None
    assert h._done
    assert ch.stats().released == 1
    assert rx.recv(timeout=5).payload == b"2"


def test_with_releases_and_propagates_when_the_body_raises(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    with pytest.raises(KeyError):
        with rx.recv(timeout=5):
            raise KeyError("handler failed")
    assert ch.stats().released == 1
    with rx.recv(timeout=5) as h:
        assert h.payload == b"2"


def test_with_returns_the_handle_itself(tx, rx):
    tx.send(b"1")
    h = rx.recv(timeout=5)
    with h as entered:
        assert entered is h


def test_release_is_idempotent(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    tx.send(b"3", "k")
    h = rx.recv(timeout=5)
    h.release()
    h2 = rx.recv(timeout=5)
    h.release()  # must not free "k" from h2
    h.ack()
    assert h._finish(0) is False
    with h:
        pass
    assert rx.try_recv() is None
    assert ch.stats().released == 1
    h2.release()
    assert rx.recv(timeout=5).payload == b"3"


def test_finish_reports_whether_it_released(tx, rx):
    tx.send(b"1")
    h = rx.recv(timeout=5)
    assert h._finish(0) is True
    assert h._finish(0) is False
    assert h._finish(1) is False


def test_nack_redelivers_with_the_next_attempt(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    assert h.attempt == 1
    assert h._finish(1) is True
    again = rx.recv(timeout=5)
    assert (again.seq, again.attempt, again.payload, again.keys) == (h.seq, 2, b"1", ("k",))
    assert rx.try_recv() is None  # still ahead of b"2" on "k"
    h.release()  # the nacked handle is done: a no-op
    assert rx.try_recv() is None
    again.release()
    assert rx.recv(timeout=5).payload == b"2"
    assert ch.stats().redelivered == 1


def test_release_many_with_a_handle_twice_releases_it_once(ch, tx, rx):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    tx.send(b"3", "j")
    a = rx.recv(timeout=5)
    b = rx.recv(timeout=5)
    assert (a.payload, b.payload) == (b"1", b"3")
    rx.release_many([a, b, a, b, a])
    assert ch.stats().released == 2
    assert a._done and b._done
    c = rx.recv(timeout=5)
    rx.release_many([a])  # already released: no-op, must not touch c's key
    assert rx.try_recv() is None
    assert ch.stats().released == 2
    assert c.payload == b"2"
    c.release()


def test_release_many_of_an_empty_list_is_a_no_op(ch, rx):
    rx.release_many([])
    rx.release_many(())
    assert ch.stats().released == 0


@pytest.mark.parametrize("payload", [b"raw", {"pickled": [1, 2]}], ids=["raw", "pickled"])
def test_payload_after_release_raises_closed_unless_read_before(tx, rx, payload):
    tx.send(payload)
    tx.send(payload)
    unread, read = rx.recv(timeout=5), rx.recv(timeout=5)
    first = read.payload
    assert first == payload
    rx.release_many([unread, read])
    with pytest.raises(shmchan.Closed):
        unread.payload  # noqa: B018 - the property read is the test
    with pytest.raises(shmchan.Closed):
        unread.keys  # noqa: B018
    assert read.payload is first  # read while held: a cached copy, still the same object


def test_payload_is_read_once_and_cached(tx, rx):
    tx.send(b"abc")
    with rx.recv(timeout=5) as h:
        assert h.payload is h.payload


def test_nacked_handle_payload_raises_closed(tx, rx):
    tx.send(b"abc")
    h = rx.recv(timeout=5)
    h.nack()
    with pytest.raises(shmchan.Closed):
        h.payload  # noqa: B018
    rx.recv(timeout=5).release()


# --- 6. closed objects ---------------------------------------------------------------


def test_send_after_channel_close_raises_closed(ch, tx, rx):
    warm_up(tx, rx)  # registered: C would take a plain send
    ch.close()
    with pytest.raises(shmchan.Closed):
        tx.send(b"x")
    with pytest.raises(shmchan.Closed):
        tx.send(b"x", "k")
    with pytest.raises(shmchan.Closed):
        tx.send({"a": 1})
    with pytest.raises(shmchan.Closed):
        tx.send_many([(b"x", None)])
    with pytest.raises(shmchan.Closed):  # its receiver was closed with it
        rx.try_recv()
    with shmchan.Channel.open(tx._seg.name) as again:
        assert again.stats().sent == 1  # the warm-up only


def test_send_after_sender_close_raises_closed(ch, tx, rx):
    warm_up(tx, rx)
    tx.close()
    with pytest.raises(shmchan.Closed):
        tx.send(b"x")
    with pytest.raises(shmchan.Closed):
        tx.send_many([(b"x", None)])
    assert ch.stats().sent == 1


def test_send_after_shutdown_raises_closed(ch, tx, rx):
    warm_up(tx, rx)
    ch.shutdown()
    with pytest.raises(shmchan.Closed):
        tx.send(b"x")
    with pytest.raises(shmchan.Closed):
        tx.send({"a": 1})
    assert ch.stats().sent == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda rx: rx.recv(0),
        lambda rx: rx.recv(),
        lambda rx: rx.recv(timeout=5),
        lambda rx: rx.try_recv(),
        lambda rx: rx.recv_many(),
        lambda rx: rx.recv_many(4, 0),
    ],
    ids=["recv-0", "recv", "recv-5", "try_recv", "recv_many", "recv_many-0"],
)  # release_many after close releases as release() does (test_handles.py)
def test_receiver_after_close_raises_closed_even_with_messages_ready(ch, tx, rx, bounded, call):
    tx.send(b"ready")
    rx.close()
    with pytest.raises(shmchan.Closed):
        bounded(call, rx)
    assert ch.stats().delivered == 0


def test_recv_after_shutdown_drains_then_raises_closed(ch, tx, rx, bounded):
    tx.send(b"1")
    ch.shutdown()
    with rx.recv(timeout=5) as h:
        assert h.payload == b"1"
    with pytest.raises(shmchan.Closed):
        bounded(rx.recv)
    with pytest.raises(shmchan.Closed):
        bounded(rx.recv_many, 4)


def test_handle_released_after_receiver_close_frees_its_key(make_channel):
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    rx.close()
    h.release()
    rx2 = ch.receiver()
    try:
        assert rx2.recv(timeout=5).payload == b"2"
    finally:
        rx2.close()


# --- 6b. recv's blocking wait (in C for plain timeouts) -----------------------------


def _signal_main_thread() -> None:
    """SIGUSR1 to the main thread itself, so that it interrupts the wait in progress there."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)


def _later(delay: float, fn: Any, *args: Any) -> threading.Timer:
    t = threading.Timer(delay, fn, args)
    t.start()
    return t


@pytest.mark.parametrize("due", ["while-waiting", "at-the-call"])
@pytest.mark.parametrize("how", ["recv", "recv_many"])
def test_upkeep_during_a_wait_leaves_the_wait_in_c(tx, rx, monkeypatch, how, due):
    """Maintenance falls due while recv() sleeps, or is already due when it is called (a
    receiver that was busy elsewhere for longer than the upkeep period): it runs in place
    and the wait goes on in C, so the message that comes later is still handed out by
    the fast path. (Both used to hand the wait over to Receiver._poll, whose wake-up
    took 2-3x as long: one idle ping in a hundred at 1 ms apart, which is the p99; and
    the first ping after a pause took about 10 us longer)"""
    warm_up(tx, rx)
    upkeep: list[float] = []
    slow: list[str] = []
    maintain, recv_slow, many_slow = (
        shmchan.Receiver.maintain,
        shmchan.Receiver._recv_slow,
        shmchan.Receiver._recv_many_slow,
    )

    def spy_maintain(self: shmchan.Receiver) -> int:
        upkeep.append(time.monotonic())
        return maintain(self)

    def spy_slow(self: shmchan.Receiver, timeout: Any) -> Any:
        slow.append("recv")
        return recv_slow(self, timeout)

    def spy_many_slow(self: shmchan.Receiver, n: Any, timeout: Any) -> Any:
        slow.append("recv_many")
        return many_slow(self, n, timeout)

    monkeypatch.setattr(shmchan.Receiver, "maintain", spy_maintain)
    monkeypatch.setattr(shmchan.Receiver, "_recv_slow", spy_slow)
    monkeypatch.setattr(shmchan.Receiver, "_recv_many_slow", spy_many_slow)
    rx._next_maintenance = time.monotonic() + (0.05 if due == "while-waiting" else -1.0)
    sender = _later(0.3, tx.send, b"after upkeep", "k")
    try:
        h = _recv_one(rx, how, 10.0)
    finally:
        sender.join()
    assert h.payload == b"after upkeep"
    h.release()
    assert upkeep, "maintenance did not run during the wait"
    assert slow == [], "the wait was handed to the Python slow path"


def _recv_one(rx: shmchan.Receiver, how: str, timeout: Any) -> shmchan.Handle:
    if how == "recv":
        return rx.recv(timeout)
    got = rx.recv_many(4, timeout)
    assert len(got) == 1
    return got[0]


@pytest.mark.parametrize("timeout", [None, 5, 5.0], ids=["none", "int", "float"])
@pytest.mark.parametrize("delay", [0.05, 0.35], ids=["early", "late"])
@pytest.mark.parametrize("how", ["recv", "recv_many"])
def test_blocked_recv_wakes_for_a_message_sent_meanwhile(tx, rx, bounded, timeout, delay, how):
    warm_up(tx, rx)
    start = time.monotonic()  # before the timer starts: its delay counts from here on
    t = _later(delay, tx.send, b"late", "k")
    h = bounded(_recv_one, rx, how, timeout)
    elapsed = time.monotonic() - start
    t.join()
    assert h.payload == b"late"
    assert delay - 0.01 <= elapsed < delay + 2
    h.release()


@pytest.mark.parametrize("how", ["recv", "recv_many"])
def test_blocked_recv_wakes_when_a_held_key_is_released(tx, rx, how):
    tx.send(b"1", "k")
    tx.send(b"2", "k")
    h = rx.recv(timeout=5)
    t = _later(0.05, h.release)
    start = time.monotonic()
    h2 = _recv_one(rx, how, 5)
    elapsed = time.monotonic() - start
    t.join()
    assert h2.payload == b"2"
    assert elapsed < 2
    h2.release()


@pytest.mark.parametrize("timeout", [0, 0.0, 0.2, 1], ids=repr)
@pytest.mark.parametrize("how", ["recv", "recv_many"])
def test_recv_on_an_empty_channel_raises_empty_after_its_timeout(rx, timeout, how):
    start = time.monotonic()
    with pytest.raises(shmchan.Empty):
        _recv_one(rx, how, timeout)
    elapsed = time.monotonic() - start
    assert timeout - 0.01 <= elapsed < timeout + 1.0


@pytest.mark.parametrize("how", ["recv", "recv_many"])
def test_time_waited_in_c_counts_towards_the_timeout(rx, how):
    """The wait runs across maintenance and ends at the timeout, not later."""
    rx._next_maintenance = time.monotonic() + 0.5
    start = time.monotonic()
    with pytest.raises(shmchan.Empty):
        _recv_one(rx, how, 1.0)
    assert 0.99 <= time.monotonic() - start < 1.3


def test_blocked_recv_raises_closed_on_shutdown(ch, rx, bounded):
    t = _later(0.05, ch.shutdown)
    with pytest.raises(shmchan.Closed):
        bounded(rx.recv)
    t.join()


class Interrupted(Exception):
    pass


@pytest.fixture
def raising_sigusr1() -> Iterator[None]:
    """SIGUSR1's handler raises Interrupted."""

    def handler(*_: Any) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    yield
    signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "wait_in",
    [
        "c",
        "c-recv_many",
        "python",
        "c-then-python",
    ],
)
def test_signal_handler_exception_interrupts_a_blocked_recv(tx, rx, raising_sigusr1, wait_in):
    """A handler that raises ends the wait with its exception (PEP 475), in C's wait
    entered from C or from the Python slow path alike. Bounded: a message ends the wait
    after 2 s anyway."""
    if wait_in == "c":
        rx._next_maintenance = time.monotonic() + 60  # C waits until maintenance is due
        recv, delay = rx.recv, 0.05
    elif wait_in == "c-recv_many":
        rx._next_maintenance = time.monotonic() + 60
        recv, delay = (lambda t: rx.recv_many(4, t)), 0.05
    elif wait_in == "python":
        recv, delay = rx._recv_slow, 0.05  # what recv() falls back to
    else:
        recv, delay = rx.recv, 0.35  # C's wait, across a maintenance (<= 0.1 s in)
    signaller = _later(delay, _signal_main_thread)
    sender = _later(2.0, tx.send, b"ends the wait")
    start = time.monotonic()
    try:
        got = recv(5.0)
    except Interrupted:
        got = None
    elapsed = time.monotonic() - start
    signaller.join()
    sender.join()
    if got is not None:
        rx.release_many(got if isinstance(got, list) else [got])
    assert got is None, f"the handler's exception was lost; recv returned after {elapsed:.2f} s"
    assert elapsed < 1.5


@pytest.mark.timeout(30)
def test_signal_handler_exception_interrupts_a_send_blocked_on_a_full_channel(
    ch, tx, raising_sigusr1
):
    big = b"x" * (ch.capacity * 2 // 3)
    tx.send(big)  # nobody receives: the next one waits for space
    signaller = _later(0.25, _signal_main_thread)  # mid-wait, not at a 0.1 s boundary
    start = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            try:
                tx.send(big, timeout=2.0)
            except shmchan.Full as e:
                raise AssertionError("the handler's exception was lost; send timed out") from e
    finally:
        signaller.join()
    assert time.monotonic() - start < 1.5


@pytest.mark.timeout(30)
def test_handled_signal_does_not_end_a_blocked_recv(tx, rx):
    calls: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: calls.append(1))
    try:
        t1 = _later(0.05, _signal_main_thread)
        t2 = _later(0.3, tx.send, b"after the signal")
        h = rx.recv()
        t1.join()
        t2.join()
        assert calls == [1]
        assert h.payload == b"after the signal"
        h.release()
    finally:
        signal.signal(signal.SIGUSR1, old)


# --- 7. exactly once, both send paths, mixed payloads and keys --------------------------

N = 10_000


def _message(i: int) -> tuple[Any, Any]:
    """Payload and keys of message i: bytes / bytearray / pickled dict, assorted keys."""
    body = b"m%d" % i
    payload: Any = (body, bytearray(body), {"i": i})[i % 3]
    keys: Any = (
        None,
        i % 17,
        f"s{i % 13}",
        b"b%d" % (i % 11),
        (i % 7, f"s{i % 5}", i % 7),
        [b"b%d" % (i % 3), -(i % 19), 2**70 + i % 2],  # a key beyond int64: Python path
    )[i % 6]
    return payload, keys


def _index(payload: Any) -> int:
    if isinstance(payload, dict):
        return int(payload["i"])
    assert type(payload) is bytes and payload[:1] == b"m"
    return int(payload[1:])


def test_every_message_arrives_exactly_once_with_its_payload_and_keys(make_channel):
    ch = make_channel(capacity=32 << 20)
    tx, rx = ch.sender(), ch.receiver()
    try:
        sent = [tx.send(*_message(i)) for i in range(N)]
        batch = 250
        for start in range(N, 2 * N, batch):
            sent += tx.send_many([_message(i) for i in range(start, start + batch)])
        assert sent == sorted(set(sent))  # distinct, increasing
        seen: dict[int, int] = {}
        order_per_key: dict[Any, list[int]] = defaultdict(list)
        while len(seen) < 2 * N:
            got = rx.recv_many(256, timeout=5)
            for h in got:
                i = _index(h.payload)
                payload, keys = _message(i)
                assert i not in seen, f"message {i} delivered twice"
                seen[i] = h.seq
                assert h.seq == sent[i]
                assert h.payload == (bytes(payload) if isinstance(payload, bytearray) else payload)
                assert h.keys == normalized(keys)
                assert h.attempt == 1
                for k in h.keys:
                    order_per_key[(type(k), k)].append(i)
            rx.release_many(got)
        assert sorted(seen) == list(range(2 * N))
        assert rx.try_recv() is None
        # each key's messages came out in send order (fifo)
        for k, idx in order_per_key.items():
            assert idx == sorted(idx), f"key {k!r} delivered out of order"
        st = ch.stats()
        assert (st.sent, st.delivered, st.released, st.inflight) == (2 * N, 2 * N, 2 * N, 0)
    finally:
        rx.close()


# --- found in review: lifetimes across Python code and released GIL ---------------------


@pytest.mark.timeout(30)
def test_recv_blocked_in_c_raises_closed_when_another_thread_closes_the_receiver(ch, rx):
    """The wait releases the GIL; a close from another thread meanwhile must end it with
    Closed, not leave it using the receiver's segment (it used to crash)."""
    out: list[object] = []

    def wait() -> None:
        try:
            out.append(rx.recv())
        except BaseException as exc:  # noqa: BLE001 - checked below
            out.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.05)  # asleep in C, GIL released
    rx.close()
    ch.shutdown()  # posts the receiver's semaphore: the waiter wakes at once
    t.join(10)
    assert not t.is_alive()
    assert len(out) == 1 and isinstance(out[0], shmchan.Closed), out


def test_send_many_survives_a_payload_whose_pickling_empties_its_own_pair(ch, tx, rx):
    """Packing runs Python code (pickle); it must not read items that code changed."""
    pair: list[object] = []

    class Emptier:
        def __reduce__(self):
            pair.clear()
            return (int, (1,))

    pair.extend([Emptier(), "k"])
    (seq,) = tx.send_many([pair])
    h = rx.recv(timeout=5)
    assert (h.seq, h.payload, h.keys) == (seq, 1, ("k",))
    h.release()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_recv_many_of_one_that_waits_returns_a_list(tx, rx, timeout):
    """recv_many(1) that has to wait (in C) still returns a list, like every recv_many."""
    rx._next_maintenance = time.monotonic() + 60  # C waits until maintenance is due
    sender = threading.Timer(0.05, tx.send, args=(b"late",))
    sender.start()
    try:
        got = rx.recv_many(1) if timeout is None else rx.recv_many(1, timeout=timeout)
    finally:
        sender.join()
    assert isinstance(got, list) and [h.payload for h in got] == [b"late"]
    rx.release_many(got)


def test_a_handle_made_in_a_dropped_handles_memory_starts_fresh(tx, rx):
    """Dropped Handles' memory is kept for the next ones: each must still come with its
    own message, payload and keys, not yet done, and (like a fresh one) not tracked by
    the collector."""
    n = 600  # more than the kept memory holds, so some come fresh and some reused
    for i in range(n):
        tx.send(b"p%d" % i, keys=(f"k{i}",))
    held = []
    for i in range(n):
        h = rx.recv(timeout=5)
        assert (h.seq, h.payload, h.keys, h._done) == (i + 1, b"p%d" % i, (f"k{i}",), False)
        assert not gc.is_tracked(h)
        if i % 3 == 0:
            held.append(h)  # some stay alive across others' reuse
        elif i % 3 == 1:
            h.release()
        del h  # i % 3 == 2: released by being dropped
    assert [h.seq for h in held] == list(range(1, n + 1, 3))
    assert all(h.payload == b"p%d" % (h.seq - 1) for h in held)
    rx.release_many(held)
    assert rx.try_recv() is None
    assert shmchan.Channel.open(tx._seg.name).stats().inflight == 0


def test_dropping_a_held_handle_still_frees_its_key(tx, rx):
    tx.send(b"a", keys=("k",))
    tx.send(b"b", keys=("k",))
    h = rx.recv(timeout=5)
    assert rx.try_recv() is None  # "k" is held
    del h
    assert rx.recv(timeout=5).payload == b"b"


def test_a_woken_message_goes_before_later_ready_ones(tx, rx):
    """New records are looked at in batches while enough messages are ready; a message
    woken meanwhile (its key freed) still goes before every later message."""
    tx.send(b"first", keys=("a",))
    h0 = rx.recv(timeout=5)
    tx.send(b"second", keys=("a",))  # waits for "a"
    tx.send_many([(b"x", f"b{i}") for i in range(300)])
    first_free = rx.recv(timeout=5)
    assert first_free.seq == 3  # the message behind "a" (seq 2) waits
    h0.release()
    assert rx.recv(timeout=5).seq == 2  # woken: before seqs 4.. already ready
    tx.send_many([(b"y", f"c{i}") for i in range(50)])
    seqs = [rx.recv(timeout=5).seq for _ in range(349)]
    assert seqs == list(range(4, 353))
