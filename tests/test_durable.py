"""Durable channels: a segment backed by a regular file (the failure model: durability).

`Channel.create(name, path=FILE)` keeps the segment in FILE instead of /dev/shm. When every
process using it is SIGKILLed (producer, consumer holding handles), a fresh process that
opens it with the same path recovers every accepted message; those in flight at the kill
come back with attempt + 1. `shmchan.unlink(name, path=FILE)` removes the file and the
semaphores.

Children are spawned; every wait has a timeout; every child is killed and joined.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import struct
import time

import posix_ipc
import pytest
from procs import CTX, WAIT, running

import shmchan


def payload(n: int) -> bytes:
    """Message n: its number, a checksum, and a body that depends on n."""
    body = hashlib.sha256(str(n).encode()).digest() * (1 + n % 20)
    return struct.pack("<I", n) + hashlib.blake2b(body, digest_size=8).digest() + body


def keys_of(n: int) -> tuple[str, ...]:
    return (f"k{n % 5}",) if n % 3 else (f"k{n % 5}", f"k{(n + 1) % 5}")


SEND_LOG = struct.Struct("<QI")  # seq, n: appended after send returned


def create_and_produce(name: str, path: str, log_path: str, first: int, ready) -> None:
    """Create the file-backed channel, send `first` messages, say so, then keep sending."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    ch = shmchan.Channel.create(name, path=path, capacity=128 << 10)
    tx = ch.sender()
    n = 0
    while True:
        if n == first:
            ready.set()
        try:
            seq = tx.send(payload(n), keys=keys_of(n), timeout=0.5)
        except shmchan.Full:
            continue  # nobody consumes any more: we wait to be killed
        os.write(fd, SEND_LOG.pack(seq, n))
        n += 1


def consume_hold_and_release(name: str, path: str, events, take: int) -> None:
    """Receive up to `take` messages (until the keys it holds block the rest); release every
    third, hold the others; report; wait to be killed."""
    with shmchan.Channel.open(name, path=path) as ch:
        rx = ch.receiver()
        held = []
        for i in range(take):
            try:
                h = rx.recv(timeout=0.5)
            except shmchan.Empty:
                break
            if i % 3 == 0:
                seq = h.seq
                h.release()
                events.put(("released", seq, 0))
            else:
                held.append(h)
                events.put(("held", h.seq, h.attempt))
        events.put(("ready", 0, 0))
        time.sleep(WAIT * 4)


def recover_and_drain(name: str, path: str, results) -> None:
    """A fresh process: open by path, take the receiver, drain, report (or report why not)."""
    try:
        _recover_and_drain(name, path, results)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails at once
        results.put(f"recovery failed: {type(exc).__module__}.{type(exc).__qualname__}: {exc}")


def _recover_and_drain(name: str, path: str, results) -> None:
    with shmchan.Channel.open(name, path=path) as ch, ch.receiver() as rx:
        got = []
        while True:
            try:
                h = rx.recv(timeout=1.0)
            except shmchan.Empty:
                break
            data = h.payload
            (n,) = struct.unpack_from("<I", data)
            got.append((h.seq, h.attempt, n, data == payload(n), h.keys == keys_of(n)))
            h.release()
        assert rx.try_recv() is None
        st = ch.stats()
        results.put((got, (st.queued, st.inflight, st.used_bytes)))


def read_send_log(path: str) -> dict[int, int]:
    with open(path, "rb") as f:
        data = f.read()
    usable = len(data) - len(data) % SEND_LOG.size
    return dict(SEND_LOG.unpack_from(data, off) for off in range(0, usable, SEND_LOG.size))


def kill_everyone_then_recover(name: str, path: str, tmp_path, before_recovery=None):
    """Producer and consumer (holding handles) SIGKILLed; then a fresh process recovers.
    Returns (accepted {seq: n}, consumer events, recovered list, final stats)."""
    log = str(tmp_path / "sends.log")
    ready, events, results = CTX.Event(), CTX.Queue(), CTX.Queue()
    producer = CTX.Process(target=create_and_produce, args=(name, path, log, 60, ready))
    consumer = CTX.Process(target=consume_hold_and_release, args=(name, path, events, 24))
    with running(producer):
        assert ready.wait(WAIT), "the producer never got going"
        with running(consumer):
            seen = []
            while not seen or seen[-1][0] != "ready":
                seen.append(events.get(timeout=WAIT))
            time.sleep(0.2)  # the producer keeps sending into the space releases freed
            for p in (producer, consumer):
                os.kill(p.pid, signal.SIGKILL)
            for p in (producer, consumer):
                p.join(WAIT)
    if before_recovery is not None:
        before_recovery()
    recovery = CTX.Process(target=recover_and_drain, args=(name, path, results))
    with running(recovery):
        outcome = results.get(timeout=WAIT)
        assert not isinstance(outcome, str), outcome
        recovered, stats = outcome
        recovery.join(WAIT)
        assert recovery.exitcode == 0
    return read_send_log(log), seen[:-1], recovered, stats


def check_recovery(accepted: dict[int, int], events: list, recovered: list, stats: tuple) -> None:
    released = {seq for what, seq, _ in events if what == "released"}
    held = {seq: attempt for what, seq, attempt in events if what == "held"}
    by_seq: dict[int, tuple[int, int]] = {}
    for seq, attempt, n, whole, keys_ok in recovered:
        assert whole and keys_ok, f"seq {seq} (message {n}) came back torn or with other keys"
        assert seq not in by_seq, f"seq {seq} recovered twice"
        by_seq[seq] = (attempt, n)
    for seq, n in accepted.items():
        if seq in released:
            assert seq not in by_seq, f"seq {seq} was released before the kill, yet came back"
            continue
        assert seq in by_seq, f"accepted message {n} (seq {seq}) was lost"
        attempt, got_n = by_seq[seq]
        assert got_n == n
        expected = held[seq] + 1 if seq in held else 1
        assert attempt == expected, f"seq {seq}: attempt {attempt}, expected {expected}"
    assert held and released and len(accepted) > 60, "the scenario did not happen"
    assert stats == (0, 0, 0), f"after the drain: queued, inflight, used_bytes = {stats}"


@pytest.mark.timeout(120)
def test_fresh_process_recovers_every_accepted_message_after_all_users_are_killed(
    chan_name, tmp_path
):
    path = str(tmp_path / "orders.chan")
    try:
        check_recovery(*kill_everyone_then_recover(chan_name, path, tmp_path))
    finally:
        with contextlib.suppress(shmchan.ChannelNotFound):
            shmchan.unlink(chan_name, path=path)


def forget_semaphores(name: str) -> None:
    """What a reboot does to a file-backed channel: /dev/shm (its semaphores) is empty."""
    for suffix in (".rx", ".tx"):
        posix_ipc.unlink_semaphore(f"/shmchan.{name}{suffix}")


@pytest.mark.timeout(120)
def test_durable_channel_recovers_after_a_reboot_emptied_dev_shm(chan_name, tmp_path):
    """The point of path=: messages survive a reboot. A reboot leaves the file and loses
    everything in /dev/shm, the channel's semaphores included."""
    path = str(tmp_path / "orders.chan")
    try:
        check_recovery(
            *kill_everyone_then_recover(
                chan_name, path, tmp_path, before_recovery=lambda: forget_semaphores(chan_name)
            )
        )
    finally:
        with contextlib.suppress(shmchan.ChannelNotFound):
            shmchan.unlink(chan_name, path=path)


def test_file_backed_channel_lives_in_its_file_not_in_dev_shm(chan_name, tmp_path):
    path = tmp_path / "orders.chan"
    with shmchan.Channel.create(chan_name, path=path, capacity=64 << 10) as ch:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert not os.path.exists(f"/dev/shm/shmchan.{chan_name}")
        with shmchan.Channel.open(chan_name, path=path) as other, other.sender() as tx:
            seq = tx.send(b"kept", keys="k")
        with ch.receiver() as rx, rx.recv(timeout=5) as h:
            assert (h.seq, h.payload) == (seq, b"kept")
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name)  # not under its name in /dev/shm
    shmchan.unlink(chan_name, path=path)


def test_unlink_with_path_removes_the_file_and_the_semaphores(chan_name, tmp_path):
    path = tmp_path / "orders.chan"
    shmchan.Channel.create(chan_name, path=path, capacity=64 << 10).close()
    assert path.exists()
    assert any(chan_name in e for e in os.listdir("/dev/shm")), "no semaphores were made"
    shmchan.unlink(chan_name, path=path)
    assert not path.exists()
    assert not [e for e in os.listdir("/dev/shm") if chan_name in e]
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name, path=path)
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.unlink(chan_name, path=path)


def log_handled(log_path: str, payload: object, keys: tuple[object, ...]) -> None:
    """A KeyedPool handler: append the message to a log file."""
    with open(log_path, "a") as f:
        f.write(f"{keys[0]} {payload}\n")


@pytest.mark.timeout(120)
def test_keyed_pool_serves_a_durable_channel(chan_name, tmp_path):
    """KeyedPool(name, ..., path=FILE) serves a channel created with path=; without the
    path it says where to look."""
    import functools

    path = tmp_path / "orders.chan"
    log = tmp_path / "log"
    ch = shmchan.Channel.create(chan_name, path=path, capacity=256 << 10)
    try:
        with ch.sender() as tx:
            for i in range(20):
                tx.send(i, keys=(f"k{i % 3}",))
        with pytest.raises(shmchan.ChannelNotFound, match="path="):
            shmchan.KeyedPool(chan_name, print, processes=1)
        handler = functools.partial(log_handled, str(log))
        with shmchan.KeyedPool(chan_name, handler, processes=2, path=path) as pool:
            ch.shutdown()  # the pool ends once everything was handed out and handled
            assert pool.join(WAIT)
            st = pool.stats()
        assert st.handled == 20 and st.failed == 0
        by_key: dict[str, list[int]] = {}
        for line in log.read_text().splitlines():
            key, n = line.split()
            by_key.setdefault(key, []).append(int(n))
        assert by_key == {f"k{k}": list(range(k, 20, 3)) for k in range(3)}
    finally:
        ch.close()
        shmchan.unlink(chan_name, path=path)


@pytest.mark.timeout(120)
def test_operators_view_of_a_durable_channel(chan_name, tmp_path):
    """held(), waiting(), why_waiting(), stats() and `shmchan stat --path` read a durable
    channel; `shmchan stat` without --path says to give it."""
    import json

    from procs import run_shmchan

    path = tmp_path / "orders.chan"
    ch = shmchan.Channel.create(chan_name, path=path, capacity=256 << 10)
    try:
        with ch.sender() as tx, ch.receiver() as rx:
            tx.send(b"first", keys=("acct",))
            behind = tx.send(b"second", keys=("acct",))
            h = rx.recv(timeout=5)
            assert [k.key for k in ch.held()] == ["acct"]
            assert ch.held()[0].pid == os.getpid()
            assert [line.key for line in ch.waiting()] == ["acct"]
            assert [w.seq for w in ch.why_waiting(behind)] == [h.seq]
            out = run_shmchan("stat", chan_name, "--path", str(path), "--json", timeout=60)
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            assert doc["name"] == chan_name and doc["stats"]["inflight"] == 1, doc
            missing = run_shmchan("stat", chan_name, timeout=60)
            assert missing.returncode != 0 and "--path" in missing.stderr, missing.stderr
            h.release()
    finally:
        ch.close()
        shmchan.unlink(chan_name, path=path)


def test_an_exchange_refuses_a_durable_channel_and_says_why(chan_name, tmp_path):
    path = tmp_path / "orders.chan"
    ch = shmchan.Channel.create(chan_name, path=path, capacity=64 << 10)
    ex = shmchan.Exchange.create(f"t{os.getpid()}_xdur", kind="fanout")
    try:
        with pytest.raises(shmchan.InvalidArgument, match="durable"):
            ex.bind(ch)
        with pytest.raises(shmchan.ChannelNotFound, match="path="):
            ex.bind(chan_name)
        assert ex.bindings() == []
    finally:
        ex.close()
        shmchan.unlink_exchange(ex.name)
        ch.close()
        shmchan.unlink(chan_name, path=path)
