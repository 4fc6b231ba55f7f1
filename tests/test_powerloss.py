"""A durable channel's file after a power loss.

The kernel writes a file back page by page, so after a power loss each 4 KiB page of a
file-backed channel may come from a different moment. We take the file at consecutive
moments of a real workload (a child sends, receives, releases and holds; the ring wraps)
and build hybrids, each page from one of two consecutive states. Opened and drained, a
hybrid must never hand out a torn payload, and every failure must be a shmchan.Error
(ChannelCorrupted, LayoutMismatch): records carry a CRC-32C checked on recovery.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import struct

import pytest
from procs import CTX, WAIT, running

import shmchan

PAGE = 4096
STATES = 6
HYBRIDS_PER_PAIR = 14


def payload(n: int) -> bytes:
    """Message n: its number, a digest of its body, and a body that depends on n."""
    body = hashlib.sha256(str(n).encode()).digest() * (1 + (n * 7) % 90)
    return struct.pack("<I", n) + hashlib.blake2b(body, digest_size=8).digest() + body


def intact(data: bytes) -> bool:
    if len(data) < 12:
        return False
    (n,) = struct.unpack_from("<I", data)
    return data == payload(n)


def write_states(name: str, path: str, snap_dir: str) -> None:
    """Run a workload on a file-backed channel; copy the file after each round."""
    ch = shmchan.Channel.create(name, path=path, capacity=48 << 10)
    tx, rx = ch.sender(), ch.receiver()
    held: list[shmchan.Handle] = []
    n = 0
    for state in range(STATES):
        for _ in range(12 + state * 3):
            obj: object = payload(n) if n % 4 else ("pickled", payload(n))
            try:
                tx.send(obj, keys=(f"k{n % 7}",), timeout=0)
            except shmchan.Full:
                break
            n += 1
        for i in range(9):
            h = rx.try_recv()
            if h is None:
                break
            if i % 4 == 3 and len(held) < 3:
                held.append(h)  # in flight at the "power loss"
            else:
                h.release()
        if len(held) == 3 and state % 2:
            held.pop(0).release()
        with open(path, "rb") as f, open(os.path.join(snap_dir, f"state{state}"), "wb") as out:
            out.write(f.read())
    os._exit(0)  # no clean-up: the file stays as the last state left it


def drain(name: str, path: str) -> tuple[int, str | None]:
    """Open a hybrid and receive everything; (messages delivered, error reported)."""
    delivered = 0
    try:
        with shmchan.Channel.open(name, path=path) as ch, ch.receiver() as rx:
            for _ in range(1000):
                try:
                    h = rx.recv(timeout=0.2)
                except shmchan.Empty:
                    break
                value = h.payload
                if isinstance(value, tuple):
                    assert value[0] == "pickled", value
                    value = value[1]
                assert isinstance(value, bytes) and intact(value), f"torn payload seq={h.seq}"
                (n,) = struct.unpack_from("<I", value)
                assert h.keys == (f"k{n % 7}",), f"seq={h.seq}: keys {h.keys} for message {n}"
                h.release()
                delivered += 1
            for d in ch.dead_letters():
                assert intact(d.payload if isinstance(d.payload, bytes) else d.payload[1])
    except shmchan.Error as e:
        return delivered, f"{type(e).__name__}: {e}"
    return delivered, None


def hybrid(a: bytes, b: bytes, take_b: list[bool]) -> bytes:
    assert len(a) == len(b)
    pages = []
    for i in range(0, len(a), PAGE):
        pages.append((b if take_b[i // PAGE] else a)[i : i + PAGE])
    return b"".join(pages)


@pytest.mark.timeout(300)
def test_power_loss_hybrids_never_deliver_a_torn_payload(tmp_path, new_chan_name):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    writer = CTX.Process(
        target=write_states, args=(new_chan_name(), str(tmp_path / "live"), str(snaps))
    )
    with running(writer):
        writer.join(WAIT * 2)
    assert writer.exitcode == 0
    os.unlink(tmp_path / "live")
    states = [(snaps / f"state{i}").read_bytes() for i in range(STATES)]
    npages = len(states[0]) // PAGE
    rng = random.Random(9)
    outcomes: list[tuple[int, str | None]] = []
    for i in range(STATES - 1):
        a, b = states[i], states[i + 1]
        differing = [
            p for p in range(npages) if a[p * PAGE : (p + 1) * PAGE] != b[p * PAGE : (p + 1) * PAGE]
        ]
        patterns = [[rng.random() < 0.5 for _ in range(npages)] for _ in range(HYBRIDS_PER_PAIR)]
        # and: the old state with one changed page from the new one, for a few pages
        for p in differing[:: max(1, len(differing) // 6)]:
            patterns.append([q == p for q in range(npages)])
        for take_b in patterns:
            name = new_chan_name()
            path = tmp_path / f"{name}.chan"
            path.write_bytes(hybrid(a, b, take_b))
            outcomes.append(drain(name, str(path)))
            shmchan.unlink(name, path=path)
    delivered = sum(d for d, _ in outcomes)
    reported = [e for _, e in outcomes if e is not None]
    # the workload did tear records, and still delivered plenty from the hybrids
    assert len(outcomes) >= 60 and delivered > 100, (len(outcomes), delivered)
    print(
        f"{len(outcomes)} hybrids: {delivered} intact messages delivered, "
        f"{len(reported)} reported {sorted(set(e.split(':')[0] for e in reported))}"
    )


def test_a_torn_record_in_a_durable_channel_is_reported_not_delivered(tmp_path, chan_name):
    """One payload byte changed in the file after the sender committed it: the checksum
    catches it when the channel is recovered."""
    path = tmp_path / "chan"
    ch = shmchan.Channel.create(chan_name, path=path, capacity=1 << 16)
    tx = ch.sender()
    tx.send(b"A" * 3000, keys="k")
    tx.send(pickle.dumps("second"), keys="k2")
    ch.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"A" * 3000) + 1500
    data[at] = ord("B")
    path.write_bytes(bytes(data))
    with shmchan.Channel.open(chan_name, path=path) as again, again.receiver() as rx:
        for _ in range(3):  # the same report every time, never the torn bytes
            with pytest.raises(shmchan.ChannelCorrupted):
                rx.recv(timeout=1)
    shmchan.unlink(chan_name, path=path)


def test_in_memory_channels_carry_no_checksum(make_channel):
    """The checksum is only for file-backed channels: in /dev/shm there is no torn page."""
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"x" * 100)
    assert rx.recv(timeout=5).payload == b"x" * 100


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 4096, 100_003])
def test_crc32c_hardware_and_table_agree(size):
    from shmchan._lib import ffi, lib

    data = bytes(random.Random(size).getrandbits(8) for _ in range(size))
    out = ffi.new("uint32_t *")
    assert lib.shm_crc32c(data, size, 0, out) == lib.SHM_OK
    table = int(out[0])
    if lib.shm_crc32c(data, size, 1, out) == lib.SHM_OK:  # only where the CPU has SSE4.2
        assert int(out[0]) == table
    if size == 0:
        assert table == 0


def test_crc32c_check_value():
    from shmchan._lib import ffi, lib

    out = ffi.new("uint32_t *")
    for hw in (0, 1):
        if lib.shm_crc32c(b"123456789", 9, hw, out) == lib.SHM_OK:
            assert int(out[0]) == 0xE3069283  # the standard CRC-32C check value
