"""Wrong use and bad segments: each raises its specific exception at once, never a crash or hang."""

from __future__ import annotations

import json
import os
import queue
import struct
import subprocess
import sys
import textwrap

import pytest

import shmchan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(script: str, *args: str, timeout: float = 60) -> dict:
    """Run `script` in a fresh interpreter, which prints one JSON line; a crash or hang fails."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child died with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def segment_path(name: str) -> str:
    """The /dev/shm file holding the channel's segment (not its semaphores)."""
    entries = [e for e in os.listdir("/dev/shm") if name in e and not e.startswith("sem.")]
    assert len(entries) == 1, entries
    return os.path.join("/dev/shm", entries[0])


# --- the hierarchy -----------------------------------------------------------------------

HIERARCHY = [
    ("Full", queue.Full),
    ("Empty", queue.Empty),
    ("Closed", Exception),
    ("MessageTooLarge", ValueError),
    ("TooManyKeys", ValueError),
    ("ChannelNotFound", FileNotFoundError),
    ("ChannelExists", FileExistsError),
    ("ReceiverBusy", Exception),
    ("LayoutMismatch", Exception),
    ("ChannelCorrupted", Exception),
]


@pytest.mark.parametrize("name,builtin", HIERARCHY, ids=[n for n, _ in HIERARCHY])
def test_exception_subclasses_error_and_its_builtin(name, builtin):
    cls = getattr(shmchan, name)
    assert issubclass(cls, shmchan.Error)
    assert issubclass(cls, builtin)


def test_error_is_an_exception():
    assert issubclass(shmchan.Error, Exception)


# --- names -----------------------------------------------------------------------------

BAD_NAMES = ["", "a/b", "/abs", "x" * 201, ".hidden", "..", "nul\x00byte"]
BAD_NAME_IDS = ["empty", "slash", "leading-slash", "too-long", "dot", "dotdot", "nul"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=BAD_NAME_IDS)
def test_create_with_invalid_name_raises_value_error(bad):
    with pytest.raises(ValueError):
        shmchan.Channel.create(bad, capacity=1 << 20)


@pytest.mark.parametrize("bad", BAD_NAMES, ids=BAD_NAME_IDS)
def test_open_with_invalid_name_raises_value_error(bad):
    with pytest.raises(ValueError):
        shmchan.Channel.open(bad)


@pytest.mark.parametrize("bad", ["", "a/b", ".x"], ids=["empty", "slash", "dot"])
def test_sender_open_with_invalid_name_raises_value_error(bad):
    with pytest.raises(ValueError):
        shmchan.Sender.open(bad)


@pytest.mark.parametrize("bad", ["", "a/b", ".x"], ids=["empty", "slash", "dot"])
def test_unlink_with_invalid_name_raises_value_error(bad):
    with pytest.raises(ValueError):
        shmchan.unlink(bad)


def test_name_of_200_characters_is_accepted(chan_name):
    long_name = chan_name + "n" * (200 - len(chan_name))
    try:
        with shmchan.Channel.create(long_name, capacity=1 << 20) as ch:
            assert ch.name == long_name
    finally:
        try:
            shmchan.unlink(long_name)
        except shmchan.ChannelNotFound:
            pass


# --- missing / existing ---------------------------------------------------------------


def test_open_missing_channel_raises_channel_not_found(chan_name):
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name)


def test_open_missing_channel_is_a_file_not_found_error(chan_name):
    with pytest.raises(FileNotFoundError):
        shmchan.Channel.open(chan_name)


def test_sender_open_missing_channel_raises_channel_not_found(chan_name):
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Sender.open(chan_name)


def test_unlink_missing_channel_raises_channel_not_found(chan_name):
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.unlink(chan_name)


def test_create_existing_channel_raises_channel_exists(make_channel, chan_name):
    make_channel(chan_name)
    with pytest.raises(shmchan.ChannelExists):
        shmchan.Channel.create(chan_name, capacity=1 << 20)


def test_failed_create_leaves_the_existing_channel_working(make_channel, chan_name):
    ch = make_channel(chan_name)
    with ch.sender() as tx:
        tx.send(b"before")
    with pytest.raises(FileExistsError):
        shmchan.Channel.create(chan_name, capacity=1 << 20)
    with ch.receiver() as rx:
        assert rx.recv(timeout=5).payload == b"before"


# --- bad arguments ---------------------------------------------------------------------


def test_unknown_order_raises_value_error(chan_name):
    with pytest.raises(ValueError):
        shmchan.Channel.create(chan_name, capacity=1 << 20, order="lifo")


def test_unknown_serializer_raises_value_error(chan_name):
    with pytest.raises(ValueError):
        shmchan.Channel.create(chan_name, capacity=1 << 20, serializer="json")


@pytest.mark.parametrize("capacity", [0, -1], ids=["zero", "negative"])
def test_nonsense_capacity_raises_value_error(chan_name, capacity):
    with pytest.raises(ValueError):
        shmchan.Channel.create(chan_name, capacity=capacity)


# --- oversize messages ------------------------------------------------------------------


def test_message_larger_than_the_channel_raises_at_once_without_timeout(ch, tx, bounded):
    with pytest.raises(shmchan.MessageTooLarge):
        bounded(tx.send, bytes(ch.capacity + 1), timeout=None, limit=10)


def test_message_too_large_is_a_value_error(ch, tx, bounded):
    with pytest.raises(ValueError):
        bounded(tx.send, bytes(2 * ch.capacity), limit=10)


def test_pickled_object_larger_than_the_channel_raises_message_too_large(ch, tx, bounded):
    with pytest.raises(shmchan.MessageTooLarge):
        bounded(tx.send, {"blob": bytes(ch.capacity + 1)}, limit=30)


def test_message_too_large_raises_even_while_the_channel_is_full(ch, tx, bounded):
    for _ in range(100):
        try:
            tx.send(bytes(64 << 10), timeout=0.1)
        except shmchan.Full:
            break
    else:
        pytest.fail("channel never became full")
    with pytest.raises(shmchan.MessageTooLarge):
        bounded(tx.send, bytes(ch.capacity + 1), limit=10)


def test_send_many_with_an_oversize_message_raises_message_too_large(ch, tx, bounded):
    with pytest.raises(shmchan.MessageTooLarge):
        bounded(tx.send_many, [(b"ok", ()), (bytes(ch.capacity + 1), ())], limit=10)


def test_refused_message_leaves_the_channel_usable(ch, tx, rx):
    with pytest.raises(shmchan.MessageTooLarge):
        tx.send(bytes(ch.capacity + 1))
    assert ch.stats().sent == 0
    tx.send(b"fine")
    assert rx.recv(timeout=5).payload == b"fine"


# --- segments that cannot be (or are no longer) a channel -------------------------------


@pytest.mark.timeout(120)
def test_a_capacity_larger_than_dev_shm_is_allowed(chan_name):
    # Memory is committed as it is used: capacity is how much may be queued, not what is
    # taken at create (running out is Full at that moment: tests/test_footprint.py).
    vfs = os.statvfs("/dev/shm")
    too_big = vfs.f_bavail * vfs.f_frsize + (1 << 30)
    out = run_child(
        """
        import json, sys, shmchan
        ch = shmchan.Channel.create(sys.argv[1], capacity=int(sys.argv[2]))
        ch.sender().send(b"x" * 64, keys=("k",))
        with ch.receiver().recv(timeout=5) as h:
            got = bytes(h.data)
        print(json.dumps({"capacity": ch.capacity, "committed": ch.stats().committed_bytes,
                          "got": len(got)}))
        ch.close()
        """,
        chan_name,
        str(too_big),
    )
    assert out["capacity"] == too_big and out["got"] == 64
    assert out["committed"] < 4 << 20, out


def _mangle_and_open(
    name: str, offset: int, data: bytes | None = None, truncate: int | None = None
) -> dict:
    return run_child(
        """
        import json, os, sys, shmchan
        path, offset, truncate = sys.argv[1], int(sys.argv[2]), sys.argv[4]
        data = bytes.fromhex(sys.argv[3])
        with open(path, "r+b") as f:
            if truncate != "none":
                f.truncate(int(truncate))
            else:
                f.seek(offset)
                f.write(data)
        try:
            with shmchan.Channel.open(sys.argv[5]) as ch, ch.receiver() as rx:
                rx.try_recv()
            out = {"raised": None}
        except shmchan.Error as exc:
            out = {"raised": type(exc).__name__}
        print(json.dumps(out))
        """,
        segment_path(name),
        str(offset),
        (data or b"").hex(),
        "none" if truncate is None else str(truncate),
        name,
    )


@pytest.mark.timeout(60)
def test_segment_with_wrong_magic_raises_layout_mismatch(make_channel, chan_name):
    make_channel(chan_name).close()
    out = _mangle_and_open(chan_name, 0, b"NOTACHAN")
    assert out["raised"] == "LayoutMismatch"


@pytest.mark.timeout(60)
def test_segment_of_another_layout_version_raises_layout_mismatch(make_channel, chan_name):
    make_channel(chan_name).close()
    # offset 8: shm_header.layout_version, a u32 right after the u64 magic (csrc/core.h)
    out = _mangle_and_open(chan_name, 8, (0xFFFF).to_bytes(4, "little"))
    assert out["raised"] == "LayoutMismatch"


@pytest.mark.timeout(60)
def test_segment_of_zeros_raises_layout_mismatch(make_channel, chan_name):
    make_channel(chan_name).close()
    out = _mangle_and_open(chan_name, 0, bytes(4096))
    assert out["raised"] == "LayoutMismatch"


@pytest.mark.timeout(60)
def test_truncated_segment_is_refused(make_channel, chan_name):
    make_channel(chan_name).close()
    out = _mangle_and_open(chan_name, 0, truncate=64)
    assert out["raised"] in ("LayoutMismatch", "ChannelCorrupted")


@pytest.mark.timeout(60)
def test_segment_shorter_than_its_header_says_is_refused(make_channel, chan_name):
    make_channel(chan_name).close()
    size = os.path.getsize(segment_path(chan_name))
    out = _mangle_and_open(chan_name, 0, truncate=size // 2)
    assert out["raised"] in ("LayoutMismatch", "ChannelCorrupted")


@pytest.mark.timeout(120)
def test_random_corruption_never_crashes_or_hangs(new_chan_name):
    """Flip bytes in live segments; every outcome but a crash or a hang is acceptable."""
    names = [new_chan_name() for _ in range(20)]
    out = run_child(
        """
        import json, os, random, sys, shmchan
        rng = random.Random(20240601)
        outcomes = {}
        for name in sys.argv[1:]:
            ch = shmchan.Channel.create(name, capacity=1 << 16, max_keys=4)
            with ch.sender() as tx:
                for i in range(20):
                    keys = rng.sample(["a", "b", "c", 1, b"d"], rng.randint(0, 3))
                    tx.send(os.urandom(rng.randint(0, 300)), keys=keys)
            ch.close()
            path = [os.path.join("/dev/shm", e) for e in os.listdir("/dev/shm")
                    if name in e and not e.startswith("sem.")][0]
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                for _ in range(rng.randint(1, 64)):
                    f.seek(rng.randrange(min(size, 1 << 16)))
                    f.write(bytes([rng.randrange(256)]))
            try:
                with shmchan.Channel.open(name) as ch2, ch2.receiver() as rx:
                    for _ in range(200):
                        h = rx.try_recv()
                        if h is None:
                            break
                        h.payload, h.keys
                        h.release()
                    ch2.stats()
                    with ch2.sender() as tx2:
                        tx2.send(b"after", timeout=0.1)
                outcome = "ok"
            except shmchan.Error as exc:
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            shmchan.unlink(name)
        print(json.dumps(outcomes))
        """,
        *names,
        timeout=100,
    )
    assert sum(out.values()) == len(names)


def _scribble_record_field(name: str, payload: bytes, field: int, value: int) -> None:
    """Overwrite one u64 field (byte offset from the record's start) of the record whose
    payload is `payload`, through the segment's file. The record is found from its
    payload: walking back from it in words, data_len (offset 32) is the first word that
    holds len(payload) with a raw kind (0, offset 24) before it."""
    with open(segment_path(name), "r+b") as f:
        seg = f.read()
        at = seg.index(payload)
        want = struct.pack("<Q", len(payload))
        start = next(
            at - back - 32
            for back in range(8, 512, 8)
            if seg[at - back : at - back + 8] == want
            and seg[at - back - 8 : at - back - 4] == b"\0\0\0\0"
        )
        f.seek(start + field)
        f.write(struct.pack("<Q", value))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_len", [1 << 40, 8])
def test_a_record_scribbled_on_after_take_in_is_not_handed_out(make_channel, chan_name, data_len):
    """A record checked when the receiver took it in, then changed in shared memory before
    it is handed out (here: its payload length, beyond the record or short of it), is
    refused at hand-out: the receive raises ChannelCorrupted rather than hand out offsets
    outside the record. (A paused key elsewhere sends the receive down the general path,
    which takes records in ahead of their hand-out; a free-key record otherwise goes from
    its take-in straight to its hand-out.)"""
    ch = make_channel(chan_name)
    first, second = b"F" * 64, b"S" * 64
    ch.pause_key("elsewhere")
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(first, keys="a")
        tx.send(second, keys="b")  # taken in with the first, ready, not handed out
        h = rx.recv(timeout=5)
        assert h.payload == first
        assert ch.stats().window == 2  # both taken in: the second is ready, not handed out
        _scribble_record_field(chan_name, second, 32, data_len)
        h.release()
        with pytest.raises(shmchan.ChannelCorrupted):
            rx.recv(timeout=1)
