"""Keys: accepted forms and types, merging, identity across types, limits."""

from __future__ import annotations

import hashlib

import pytest

import shmchan
from shmchan.hold import key_hash

# --- accepted forms --------------------------------------------------------------


def test_message_without_keys_has_empty_keys(tx, rx):
    tx.send(b"x")
    assert rx.recv(timeout=5).keys == ()


def test_keys_are_a_tuple(tx, rx):
    tx.send(b"x", keys=["a", "b"])
    assert type(rx.recv(timeout=5).keys) is tuple


@pytest.mark.parametrize("key", ["acct:1", b"\x00raw", 42], ids=["str", "bytes", "int"])
def test_single_key_value_means_one_key(tx, rx, key):
    tx.send(b"x", keys=key)
    assert rx.recv(timeout=5).keys == (key,)


def test_single_str_key_is_not_split_into_characters(tx, rx):
    tx.send(b"x", keys="abc")
    assert rx.recv(timeout=5).keys == ("abc",)


def test_single_bytes_key_is_not_split_into_ints(tx, rx):
    tx.send(b"x", keys=b"abc")
    assert rx.recv(timeout=5).keys == (b"abc",)


@pytest.mark.parametrize(
    "make_keys",
    [lambda: ("a", "b"), lambda: ["a", "b"], lambda: iter(["a", "b"]), lambda: (k for k in "ab")],
    ids=["tuple", "list", "iterator", "generator"],
)
def test_keys_accept_any_iterable(tx, rx, make_keys):
    tx.send(b"x", keys=make_keys())
    assert rx.recv(timeout=5).keys == ("a", "b")


def test_keys_keep_their_original_values_and_types(tx, rx):
    tx.send(b"x", keys=("s", b"b", 7))
    keys = rx.recv(timeout=5).keys
    assert keys == ("s", b"b", 7)
    assert [type(k) for k in keys] == [str, bytes, int]


def test_keys_keep_first_occurrence_order(tx, rx):
    tx.send(b"x", keys=("z", "a", "m"))
    assert rx.recv(timeout=5).keys == ("z", "a", "m")


@pytest.mark.parametrize("key", ["", b"", 0], ids=["empty-str", "empty-bytes", "zero"])
def test_empty_and_zero_keys_are_valid(tx, rx, key):
    tx.send(b"x", keys=(key,))
    assert rx.recv(timeout=5).keys == (key,)


@pytest.mark.parametrize(
    "key", [-7, 2**63, 2**64 + 5, -(2**70)], ids=["neg", "2^63", "2^64+5", "-2^70"]
)
def test_int_keys_of_any_size_round_trip(tx, rx, key):
    tx.send(b"x", keys=key)
    assert rx.recv(timeout=5).keys == (key,)


def test_unicode_key_round_trips(tx, rx):
    tx.send(b"x", keys="счёт:№1 🍣")
    assert rx.recv(timeout=5).keys == ("счёт:№1 🍣",)


def test_long_key_round_trips(tx, rx):
    key = "k" * 10_000
    tx.send(b"x", keys=key)
    assert rx.recv(timeout=5).keys == (key,)


# --- duplicates ---------------------------------------------------------------------


def test_duplicate_key_in_one_message_is_merged(tx, rx):
    tx.send(b"x", keys=("b", "a", "b", "a"))
    assert rx.recv(timeout=5).keys == ("b", "a")


def test_merged_duplicates_hold_the_key_once(ch, tx, rx):
    tx.send(b"x", keys=("k", "k"))
    h = rx.recv(timeout=5)
    assert ch.stats().held_keys == 1
    h.release()
    tx.send(b"y", keys="k")
    assert rx.recv(timeout=5).payload == b"y"


def test_duplicates_do_not_count_against_max_keys(make_channel):
    ch = make_channel(max_keys=2)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"x", keys=("a", "a", "b", "b", "a"))
        assert rx.recv(timeout=5).keys == ("a", "b")


# --- identity ----------------------------------------------------------------------


def test_str_bytes_and_int_keys_are_different_keys(tx, rx):
    tx.send(b"s", keys="1")
    tx.send(b"b", keys=b"1")
    tx.send(b"i", keys=1)
    live = [rx.try_recv() for _ in range(3)]
    assert sorted(h.payload for h in live if h is not None) == [b"b", b"i", b"s"]


def test_equal_str_keys_conflict(tx, rx):
    tx.send(b"1", keys="acct")
    tx.send(b"2", keys="acct")
    first = rx.recv(timeout=5)
    assert rx.try_recv() is None
    first.release()


def test_equal_bytes_keys_conflict(tx, rx):
    tx.send(b"1", keys=b"acct")
    tx.send(b"2", keys=bytes(bytearray(b"acct")))
    first = rx.recv(timeout=5)
    assert rx.try_recv() is None
    first.release()


def test_equal_large_int_keys_conflict(tx, rx):
    tx.send(b"1", keys=2**80)
    tx.send(b"2", keys=2**80)
    first = rx.recv(timeout=5)
    assert rx.try_recv() is None
    first.release()


def test_nearby_int_keys_do_not_conflict(tx, rx):
    tx.send(b"1", keys=2**64)
    tx.send(b"2", keys=0)
    tx.send(b"3", keys=2**64 + 1)
    live = [rx.try_recv() for _ in range(3)]
    assert all(h is not None for h in live)


def test_key_is_free_again_after_release(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    rx.recv(timeout=5).release()
    assert rx.recv(timeout=5).payload == b"2"


# --- refused keys ----------------------------------------------------------------


BAD_KEYS = [1.5, None, True, False, ("nested",), object()]
BAD_IDS = ["float", "none", "true", "false", "tuple", "object"]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=BAD_IDS)
def test_unsupported_key_type_in_a_sequence_raises_type_error(ch, tx, bad):
    with pytest.raises(TypeError):
        tx.send(b"x", keys=("ok", bad))
    assert ch.stats().sent == 0


@pytest.mark.parametrize("bad", [1.5, True, object()], ids=["float", "bool", "object"])
def test_unsupported_single_key_raises_type_error(ch, tx, bad):
    with pytest.raises(TypeError):
        tx.send(b"x", keys=bad)
    assert ch.stats().sent == 0


def test_unsupported_key_type_in_send_many_raises_type_error(ch, tx):
    with pytest.raises(TypeError):
        tx.send_many([(b"a", ("ok",)), (b"b", (2.5,))])


def test_too_many_keys_raises_too_many_keys(make_channel):
    ch = make_channel(max_keys=3)
    with ch.sender() as tx:
        with pytest.raises(shmchan.TooManyKeys):
            tx.send(b"x", keys=("a", "b", "c", "d"))
    assert ch.stats().sent == 0


def test_too_many_keys_is_a_value_error(make_channel):
    ch = make_channel(max_keys=1)
    with ch.sender() as tx:
        with pytest.raises(ValueError):
            tx.send(b"x", keys=("a", "b"))


def test_default_max_keys_is_eight(ch, tx, rx):
    tx.send(b"x", keys=[f"k{i}" for i in range(8)])
    assert len(rx.recv(timeout=5).keys) == 8
    with pytest.raises(shmchan.TooManyKeys):
        tx.send(b"x", keys=[f"k{i}" for i in range(9)])


def test_exactly_max_keys_is_accepted(make_channel):
    ch = make_channel(max_keys=3)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"x", keys=("a", b"a", 1))
        assert rx.recv(timeout=5).keys == ("a", b"a", 1)


# --- encodings and hashes that must not change ------------------------------------

# ints at the edges of one CPython digit (2**30), of a byte, and of 64 bits: the send paths
# encode them without calls, the general encoder (a key among several) with them
EDGE_INTS = [
    0,
    1,
    -1,
    127,
    128,
    -128,
    -129,
    255,
    2**30 - 1,
    2**30,
    -(2**30 - 1),
    -(2**30),
    2**31,
    -(2**31) - 1,
    2**62,
    2**63 - 1,
    -(2**63),
]


@pytest.mark.parametrize("key", EDGE_INTS)
def test_int_keys_encode_alike_on_every_send_path(tx, rx, key):
    tx.send(b"one", keys=key)
    tx.send_batch(b"batch", [5], [key])
    tx.send_many([(b"many", (key, "other"))])
    first = rx.recv(timeout=5)
    assert first.keys == (key,)
    assert rx.try_recv() is None  # the same key, so the same hash: both wait behind it
    first.release()
    second = rx.recv(timeout=5)
    assert (second.data.tobytes(), second.keys) == (b"batch", (key,))
    assert rx.try_recv() is None
    second.release()
    assert rx.recv(timeout=5).keys == (key, "other")


def test_key_hashes_are_the_same_in_every_version():
    # Records carry their keys' hashes and a paused key is found by its hash: a change here
    # is a change of the segment's format.
    keys = [bytes((i * 37 + 11) & 255 for i in range(n)) for n in range(41)]
    digest = hashlib.sha256(repr([key_hash(k) for k in keys]).encode()).hexdigest()
    assert digest == "f4e4b4b99058cdc2077d7f831b2be1105d9905e4af658a1dc0d2024fd0325f99"
    assert key_hash(0) == 0xB5C4A8090CB66FC8
    assert key_hash(-129) == 0xBD065B9AD8677A0D
    assert key_hash(-(2**30)) == 0xE6B34B2C82D5C63F
    assert key_hash(2**63 - 1) == 0x2B8A968A28800DD8
    assert key_hash("acct:1") == 0x514636DD97D39A59


@pytest.mark.parametrize("path", ["send", "send_many", "send_batch"])
def test_keys_of_every_short_length_round_trip_on_every_send_path(tx, rx, path):
    # blobs of 3 to 42 bytes: the lengths a record's key blob is copied in without a call
    keys = ["x" * n for n in range(40)] + [b"y" * n for n in range(20)]
    if path == "send":
        for i, k in enumerate(keys):
            tx.send(bytes([i]), keys=k)
    elif path == "send_many":
        tx.send_many([(bytes([i]), (k,)) for i, k in enumerate(keys)])
    else:
        tx.send_batch(bytes(range(len(keys))), [1] * len(keys), keys)
    got = []
    for _ in keys:
        h = rx.recv(timeout=5)
        got.append((h.data.tobytes(), h.keys))
        h.release()
    assert got == [(bytes([i]), (k,)) for i, k in enumerate(keys)]
