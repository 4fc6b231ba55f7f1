"""Across real processes (multiprocessing "spawn"): producers, handle hand-over, dead holders.

Every blocking call has a timeout, every child is joined with a timeout and
killed in `finally` if still alive. Child entry points are module-level so
spawned interpreters can import them.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import multiprocessing
import os
import random
import signal
import struct
import time

import pytest
from procs import CTX, WAIT, held_by_another_thread, running, wait_forked

import shmchan


def join_all(*procs: multiprocessing.process.BaseProcess) -> None:
    for p in procs:
        p.join(WAIT)
        assert not p.is_alive(), f"{p.name} did not finish"
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


def recv_n(rx, n: int) -> list:
    """Receive and release n handles; returns (seq, payload, keys, attempt) tuples."""
    out = []
    for _ in range(n):
        with rx.recv(timeout=WAIT) as h:
            out.append((h.seq, h.payload, h.keys, h.attempt))
    return out


def recv_n_handles(rx, n: int) -> list:
    """Receive n handles and keep them live."""
    return [rx.recv(timeout=WAIT) for _ in range(n)]


# --- child entry points -----------------------------------------------------------------


def produce(tx, index: int, count: int, keyed: bool, results) -> None:
    seqs = []
    for i in range(count):
        keys = (f"p{index}",) if keyed else ()
        seqs.append(tx.send((index, i), keys=keys, timeout=WAIT))
    tx.close()
    results.put((index, seqs))


def produce_by_name(name: str, payloads: list, keys: list) -> None:
    with shmchan.Sender.open(name) as tx:
        for payload, k in zip(payloads, keys, strict=True):
            tx.send(payload, keys=k, timeout=WAIT)


def send_later(name: str, delay: float, payload: bytes) -> None:
    time.sleep(delay)
    with shmchan.Sender.open(name) as tx:
        tx.send(payload, timeout=WAIT)


def hold_then_release(handle, results, go) -> None:
    results.put((handle.payload, handle.data.tobytes(), handle.keys, handle.seq, handle.attempt))
    if go.wait(WAIT):
        handle.release()
        results.put("released")


def hold_from_queue(handles, results, go) -> None:
    handle = handles.get(timeout=WAIT)
    hold_then_release(handle, results, go)


def hold_forever(handle, results) -> None:
    results.put(handle.seq)
    time.sleep(WAIT * 4)


def consume_one_and_hold(name: str, results) -> None:
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        h = rx.recv(timeout=WAIT)
        results.put(h.seq)
        time.sleep(WAIT * 4)


def hold_receiver(name: str, results, go) -> None:
    with shmchan.Channel.open(name) as ch, ch.receiver():
        results.put("holding")
        go.wait(WAIT)


def send_huge_after_signal(name: str, size: int, ready) -> None:
    """Build a huge payload, say so, then send it: a kill right after lands mid-copy."""
    payload = b"\x01" * size
    with shmchan.Sender.open(name) as tx:
        ready.send_bytes(b"go")
        tx.send(payload, keys="huge", timeout=WAIT)
        ready.send_bytes(b"sent")


# Torture payloads: numbered, checksummed, with keys derived from the number, so the consumer
# can tell a torn, corrupt, misattributed or mis-keyed message from a good one.
TORTURE_KEYS = ("a", "b", "c", "d", "e")
TORTURE_HEAD = struct.Struct("<IIQ")  # producer id, message number, body length
TORTURE_DIGEST = 16  # blake2b digest of head + body, stored between the two
SEND_LOG = struct.Struct("<QII")  # seq, producer id, message number: one write() per send


def torture_message(producer_id: int, n: int) -> tuple[bytes, tuple[str, ...]]:
    """Message n of a producer: (payload, keys), the same in every process."""
    rng = random.Random(f"{producer_id}:{n}")  # str seeds are hashed with sha512: stable
    keys = tuple(rng.sample(TORTURE_KEYS, rng.randint(0, 3)))
    # Mostly small records, now and then a large one: a 64 KiB channel is full often.
    size = rng.randint(16 << 10, 24 << 10) if rng.random() < 0.1 else rng.randint(0, 3000)
    body = rng.randbytes(size)
    head = TORTURE_HEAD.pack(producer_id, n, size)
    return head + hashlib.blake2b(head + body, digest_size=TORTURE_DIGEST).digest() + body, keys


def check_torture_message(data: bytes) -> tuple[int, int]:
    """(producer id, message number) of a whole, uncorrupted payload; AssertionError else."""
    assert len(data) >= TORTURE_HEAD.size + TORTURE_DIGEST, f"payload too short: {len(data)}"
    producer_id, n, size = TORTURE_HEAD.unpack_from(data)
    head, digest = (
        data[: TORTURE_HEAD.size],
        data[TORTURE_HEAD.size : TORTURE_HEAD.size + TORTURE_DIGEST],
    )
    body = data[TORTURE_HEAD.size + TORTURE_DIGEST :]
    assert len(body) == size, f"torn payload ({producer_id}, {n}): {len(body)} of {size} bytes"
    assert hashlib.blake2b(head + body, digest_size=TORTURE_DIGEST).digest() == digest, (
        f"corrupt payload ({producer_id}, {n})"
    )
    return producer_id, n


def produce_logged(name: str, producer_id: int, log_path: str) -> None:
    """Send torture messages until killed; log each one only after its send returned.

    One write() per record on an O_APPEND file: a SIGKILL leaves whole records and at
    worst a torn last one, which read_send_log drops. The log is created once the Sender
    is open, so its existence says "this producer is in its send loop".
    """
    with shmchan.Sender.open(name) as tx:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        for n in itertools.count():
            payload, keys = torture_message(producer_id, n)
            seq = tx.send(payload, keys=keys, timeout=WAIT)
            os.write(fd, SEND_LOG.pack(seq, producer_id, n))


def read_send_log(path: str) -> list[tuple[int, int, int]]:
    """(seq, producer id, message number) records of a send log; a torn tail is ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:  # killed before its first send returned
        return []
    usable = len(data) - len(data) % SEND_LOG.size
    return [SEND_LOG.unpack_from(data, off) for off in range(0, usable, SEND_LOG.size)]


def producer(ch, index: int, count: int, keyed: bool, results) -> multiprocessing.Process:
    """A spawned process sending `count` messages through a pickled Sender."""
    return CTX.Process(target=produce, args=(ch.sender(), index, count, keyed, results))


# --- producers ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_spawned_producers_messages_arrive_in_each_producers_order(ch, rx):
    results = CTX.Queue()
    count = 300
    procs = [producer(ch, i, count, False, results) for i in range(3)]
    with running(*procs):
        got = recv_n(rx, 3 * count)
        sent = dict(results.get(timeout=WAIT) for _ in procs)
        join_all(*procs)
    per_producer: dict[int, list[int]] = {}
    for _seq, (index, i), _keys, _attempt in got:
        per_producer.setdefault(index, []).append(i)
    assert per_producer == {i: list(range(count)) for i in range(3)}
    assert sorted(seq for seq, *_ in got) == sorted(s for seqs in sent.values() for s in seqs)


@pytest.mark.timeout(120)
def test_each_producers_seqs_strictly_increase(ch, rx):
    results = CTX.Queue()
    procs = [producer(ch, i, 200, False, results) for i in range(2)]
    with running(*procs):
        recv_n(rx, 400)
        sent = dict(results.get(timeout=WAIT) for _ in procs)
        join_all(*procs)
    for seqs in sent.values():
        assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False))
    assert not set(sent[0]) & set(sent[1])


@pytest.mark.timeout(120)
def test_keyed_producers_are_received_in_order_while_handles_are_held_in_batches(ch, rx):
    results = CTX.Queue()
    count = 200
    procs = [producer(ch, i, count, True, results) for i in range(3)]
    per_producer: dict[int, list[int]] = {}
    with running(*procs):
        received = 0
        while received < 3 * count:
            batch = rx.recv_many(64, timeout=WAIT)
            keys = [k for h in batch for k in h.keys]
            assert len(keys) == len(set(keys)), "two live handles share a key"
            for h in batch:
                index, i = h.payload
                assert h.keys == (f"p{index}",)
                per_producer.setdefault(index, []).append(i)
            for h in reversed(batch):
                h.release()
            received += len(batch)
        for _ in procs:
            results.get(timeout=WAIT)
        join_all(*procs)
    assert per_producer == {i: list(range(count)) for i in range(3)}


@pytest.mark.timeout(60)
def test_sender_opened_by_name_in_a_child_delivers(ch, rx):
    child = CTX.Process(target=produce_by_name, args=(ch.name, [b"a", {"b": 2}], [(), ("k", 5)]))
    with running(child):
        got = recv_n(rx, 2)
        join_all(child)
    assert [(p, k) for _s, p, k, _a in got] == [(b"a", ()), ({"b": 2}, ("k", 5))]


@pytest.mark.timeout(60)
def test_blocked_recv_wakes_up_for_a_send_from_another_process(ch, rx):
    child = CTX.Process(target=send_later, args=(ch.name, 0.5, b"wake"))
    with running(child):
        h = rx.recv(timeout=WAIT)
        assert h.payload == b"wake"
        join_all(child)


@pytest.mark.timeout(60)
def test_keys_from_another_process_conflict_with_equal_local_keys(ch, tx, rx):
    """Key hashing is stable across interpreters (each spawned child has its own hash seed)."""
    tx.send(b"local", keys=("acct", 2**70, b"raw"))
    held = rx.recv(timeout=5)
    child = CTX.Process(
        target=produce_by_name,
        args=(ch.name, [b"c1", b"c2", b"c3", b"c4"], ["acct", 2**70, b"raw", "other"]),
    )
    with running(child):
        join_all(child)
    free = []
    while (h := rx.try_recv()) is not None:
        free.append(h)
    assert [h.payload for h in free] == [b"c4"]
    held.release()
    assert sorted(h.payload for h in recv_n_handles(rx, 3)) == [b"c1", b"c2", b"c3"]


# --- handle hand-over ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_handle_pickled_to_a_spawned_process_can_be_read_there(ch, tx, rx):
    seq = tx.send(b"work item", keys=("k", 3))
    h = rx.recv(timeout=5)
    results, go = CTX.Queue(), CTX.Event()
    child = CTX.Process(target=hold_then_release, args=(h, results, go))
    with running(child):
        go.set()
        assert results.get(timeout=WAIT) == (b"work item", b"work item", ("k", 3), seq, 1)
        assert results.get(timeout=WAIT) == "released"
        join_all(child)


@pytest.mark.timeout(60)
def test_release_in_the_receiving_process_unblocks_the_next_message_on_the_key(ch, tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    results, go = CTX.Queue(), CTX.Event()
    child = CTX.Process(target=hold_then_release, args=(h, results, go))
    with running(child):
        results.get(timeout=WAIT)  # the child holds it now
        del h
        gc.collect()  # the handed-over original must not release
        assert rx.try_recv() is None
        go.set()
        assert results.get(timeout=WAIT) == "released"
        assert rx.recv(timeout=WAIT).payload == b"2"
        join_all(child)


@pytest.mark.timeout(60)
def test_handle_can_travel_through_a_multiprocessing_queue(ch, tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    handles, results, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    child = CTX.Process(target=hold_from_queue, args=(handles, results, go))
    with running(child):
        handles.put(rx.recv(timeout=5))
        assert results.get(timeout=WAIT)[0] == b"1"
        gc.collect()
        assert rx.try_recv() is None
        go.set()
        assert results.get(timeout=WAIT) == "released"
        assert rx.recv(timeout=WAIT).payload == b"2"
        join_all(child)


# --- dead processes ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_message_of_a_killed_holder_is_redelivered_with_the_next_attempt(ch, tx, rx):
    seq = tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    results = CTX.Queue()
    child = CTX.Process(target=hold_forever, args=(h, results))
    with running(child):
        assert results.get(timeout=WAIT) == seq
        del h
        gc.collect()
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)
        again = rx.recv(timeout=WAIT)
        assert (again.seq, again.attempt) == (seq, 2)
        assert rx.try_recv() is None  # still in front of "2" on k
        again.release()
        assert rx.recv(timeout=WAIT).payload == b"2"


@pytest.mark.timeout(60)
def test_receiver_busy_while_another_process_has_the_receiver(ch):
    results, go = CTX.Queue(), CTX.Event()
    child = CTX.Process(target=hold_receiver, args=(ch.name, results, go))
    with running(child):
        assert results.get(timeout=WAIT) == "holding"
        with pytest.raises(shmchan.ReceiverBusy):
            ch.receiver()
        go.set()
        join_all(child)
    with ch.receiver() as rx:  # free again once that process closed its receiver
        assert rx.try_recv() is None


def kill_consumer_holding_one(ch) -> int:
    """A child takes the receiver, receives one message and holds it; it is SIGKILLed."""
    results = CTX.Queue()
    child = CTX.Process(target=consume_one_and_hold, args=(ch.name, results))
    with running(child):
        held_seq = results.get(timeout=WAIT)
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)  # reaped: no zombie left to look alive
    return held_seq


@pytest.mark.timeout(60)
def test_new_receiver_attaches_after_the_consumer_is_killed(ch, tx):
    tx.send(b"taken", keys="k")
    kill_consumer_holding_one(ch)
    tx.send(b"later", keys="other")
    with ch.receiver() as rx:
        first = rx.recv(timeout=WAIT)
        if first.payload == b"taken":  # redelivered from the dead consumer: fine here
            first.release()
            first = rx.recv(timeout=WAIT)
        assert first.payload == b"later"


@pytest.mark.timeout(60)
def test_message_held_by_a_killed_consumer_is_redelivered(ch, tx):
    seqs = [tx.send(i, keys="k") for i in range(2)]
    held_seq = kill_consumer_holding_one(ch)
    with ch.receiver() as rx:
        got = recv_n(rx, 2)
    assert held_seq == seqs[0]
    assert [(s, a) for s, _p, _k, a in got] == [(seqs[0], 2), (seqs[1], 1)]


def _kill_mid_send(ch, size: int, delay: float) -> None:
    """SIGKILL a producer of one `size`-byte message `delay` s after its record shows in
    the ring (its length published, its body being copied). Counted from its "go"
    instead, the delay runs out before the send begins whenever the child is not
    scheduled in time, as on a loaded machine."""
    ours, theirs = CTX.Pipe(duplex=False)
    child = CTX.Process(target=send_huge_after_signal, args=(ch.name, size, theirs))
    with running(child):
        assert ours.poll(WAIT), "producer never got ready"
        assert ours.recv_bytes() == b"go"
        deadline = time.monotonic() + WAIT
        while ch.stats().used_bytes < size and not ours.poll(0):  # until it shows, or is sent
            assert time.monotonic() < deadline, "the producer's send never began"
            time.sleep(0.0002)
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["recv", "try_recv"])
def test_consumer_is_not_stuck_behind_a_producer_killed_mid_send(make_channel, how):
    """The dead producer's claim is skipped, whether the consumer blocks or polls."""
    size = 96 << 20
    ch = make_channel(capacity=256 << 20)
    rx = ch.receiver()
    try:
        for attempt in range(6):
            _kill_mid_send(ch, size, delay=0.002 * (attempt + 1))
            with ch.sender() as tx:
                after = tx.send(b"after", keys="after")
            got: dict[int, int] = {}
            deadline = time.monotonic() + 15
            while after not in got and time.monotonic() < deadline:
                if how == "recv":
                    try:
                        h = rx.recv(timeout=0.5)
                    except shmchan.Empty:
                        continue
                else:
                    h = rx.try_recv()
                    if h is None:
                        time.sleep(0.01)
                        continue
                with h:
                    got[h.seq] = len(h.data)
                    if len(h.data) == size:
                        assert h.data[0] == 1 and h.data[-1] == 1  # whole, not torn
            assert after in got, f"consumer stuck behind a dead producer's claim ({how})"
            if ch.stats().discarded:
                return  # the kill landed inside send and the claim was skipped
        pytest.skip("the kill never landed inside send; scenario not produced")
    finally:
        rx.close()


# --- torture -------------------------------------------------------------------------------------

TORTURE_SECONDS = 18.0  # how long producers are killed and replaced, at least
TORTURE_KILLS = 20  # kills to make and...
TORTURE_SENDS = 1000  # ...sends to see returned, at least: the run goes on for them up to...
TORTURE_MAX_SECONDS = 90.0  # ...this long (a replacement's start is slow on a loaded machine)
TORTURE_PRODUCERS = 3
# Longest the consumer may go without a message while one can arrive. A dead producer's
# claim holds the receiver for STALL_CHECK_SECONDS (0.01 s) before its owner is checked
# and the claim repaired or discarded, a dead writer's record until the next upkeep
# (MAINTENANCE_SECONDS, 0.1 s): 10 s is that bound with room for a loaded 2-core
# machine's scheduling, and still catches a consumer that never gets past a claim.
# The clock stops while nothing can arrive: the ring is empty and no producer is in its
# send loop (a spawned interpreter takes 1-3 s to import and open its Sender on a loaded
# machine; that wait is bounded separately, by WAIT). A claim or record left in the ring
# keeps it running, whether or not a producer is sending.
STALL_LIMIT = 10.0


@pytest.mark.torture
@pytest.mark.timeout(180)
def test_producers_killed_mid_send_never_tear_lose_or_duplicate(make_channel, tmp_path):
    """The failure model, "producer killed mid-send".

    Producers send into a 64 KiB channel (often full: they block in send) while one of them
    is SIGKILLed every 50-400 ms and replaced. One drawn while still starting (its Sender
    not yet open) is spared: a kill there tests nothing of the channel, and on a loaded
    machine, where that start takes longer than the time between kills, such kills left no
    producer sending for seconds at a time. The consumer holds up to 6 handles and
    releases them in random order. Checked at every recv: whole and uncorrupted payload
    with the keys it was sent with, no duplicate, no key shared with a live handle, per-key
    seq order; that the consumer never waits STALL_LIMIT for a message while one can
    arrive; at the end: every logged send delivered, and the channel empty and idle.
    """
    rng = random.Random(1)
    ch = make_channel(capacity=64 << 10)
    rx = ch.receiver()
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    logs: list[str] = []
    held: list = []
    delivered: dict[int, tuple[int, int]] = {}  # seq -> (producer id, n)
    origins: set[tuple[int, int]] = set()
    last_seq_of_key: dict[str, int] = {}
    kills = 0

    sending: set[int] = set()  # producers in their send loop (their log exists)

    def start_producer() -> None:
        producer_id = len(logs)
        logs.append(str(tmp_path / f"p{producer_id}.log"))
        p = CTX.Process(target=produce_logged, args=(ch.name, producer_id, logs[-1]), daemon=True)
        p.start()
        procs[producer_id] = p

    def sent() -> int:  # sends returned so far (each log record is one)
        return sum(os.path.getsize(p) for p in logs if os.path.exists(p)) // SEND_LOG.size

    def any_sending() -> bool:
        sending.update(i for i in procs if i not in sending and os.path.exists(logs[i]))
        return bool(sending)

    def take(h) -> None:
        data = h.data.tobytes()
        origin = check_torture_message(data)
        assert origin == check_torture_message(h.payload)
        assert h.keys == torture_message(*origin)[1], f"message {origin} has the wrong keys"
        assert h.seq not in delivered, f"seq {h.seq} delivered twice"
        assert origin not in origins, f"message {origin} delivered twice (seq {h.seq})"
        held_keys = {k for other in held for k in other.keys}
        assert not held_keys & set(h.keys), f"seq {h.seq} shares keys with a live handle"
        for k in h.keys:
            assert h.seq > last_seq_of_key.get(k, 0), f"key {k!r}: seq {h.seq} out of order"
            last_seq_of_key[k] = h.seq
        assert h.attempt == 1  # no holder ever died
        delivered[h.seq] = origin
        origins.add(origin)
        held.append(h)

    def release_some(keep: int) -> None:
        while len(held) > keep:
            held.pop(rng.randrange(len(held))).release()

    try:
        for _ in range(TORTURE_PRODUCERS):
            start_producer()
        now = start = time.monotonic()
        end, give_up = now + TORTURE_SECONDS, now + TORTURE_MAX_SECONDS
        next_kill, last_progress, idle_since = now + 1.0, now, now
        while (now < end or kills < TORTURE_KILLS or sent() < TORTURE_SENDS) and now < give_up:
            if not any_sending() and not ch.stats().used_bytes:
                last_progress = now  # nothing can arrive: the stall clock stops
                assert now - idle_since < WAIT, f"no producer opened its Sender in {WAIT} s"
            else:
                idle_since = now
            if now >= next_kill:
                victim = rng.choice(sorted(procs))
                if victim in sending:  # one still starting is spared, not replaced
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    procs.pop(victim).join(WAIT)  # reaped: its token no longer looks alive
                    sending.discard(victim)
                    kills += 1
                    start_producer()
                next_kill = time.monotonic() + rng.uniform(0.05, 0.4)
            if held:  # what is queued may wait for keys we hold: never block then
                h = rx.try_recv()
                if h is None:
                    release_some(len(held) - 1)
            else:
                try:
                    h = rx.recv(timeout=0.05)
                except shmchan.Empty:
                    h = None
                    assert time.monotonic() - last_progress < STALL_LIMIT, "consumer stalled"
            if h is not None:
                take(h)
                last_progress = time.monotonic()
            release_some(rng.randint(0, 6))
            now = time.monotonic()

        for p in procs.values():
            os.kill(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.join(WAIT)
        # Drain: everything committed comes out; claims of the dead are skipped.
        while True:
            release_some(rng.randint(0, 3))
            try:
                take(rx.recv(timeout=1.0))
            except shmchan.Empty:
                if not held:
                    break
                release_some(0)
        assert rx.try_recv() is None  # also makes the receiver take in the releases
        stats = ch.stats()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(WAIT)
        rx.close()

    sends = [r for path in logs for r in read_send_log(path)]
    assert kills >= TORTURE_KILLS and len(sends) >= TORTURE_SENDS, (
        f"too little happened in {now - start:.0f} s: {kills} kills, {len(sends)} sends"
    )
    for seq, producer_id, n in sends:
        assert delivered.get(seq) == (producer_id, n), (
            f"returned send {seq} ({producer_id}, {n}) lost"
        )
    assert (stats.used_bytes, stats.queued, stats.inflight, stats.producers) == (0, 0, 0, 0), stats
    assert stats.delivered == stats.released == len(delivered)
    # With records of at most 24 KiB a kill rarely lands between claim and commit (a few
    # microseconds of memcpy against a Python loop): runs here saw 0 discarded
    # reservations in ~80 kills, so it is reported, not required.
    # test_consumer_is_not_stuck_behind_a_producer_killed_mid_send makes that case happen.
    assert stats.discarded >= 0
    print(
        f"{kills} kills, {len(sends)} logged sends, {len(delivered)} delivered, "
        f"{stats.discarded} reservations of dead producers discarded"
    )


@pytest.mark.timeout(60)
def test_a_child_forked_while_another_thread_holds_the_attachment_lock_can_send(ch, rx):
    """Re-opening a channel by name (an unpickled Sender, an adopted handle) takes a
    process-wide lock. A thread of the parent holds it at the moment another thread
    forks; the child has no such thread, so it must start with the lock free."""
    import pickle

    from shmchan import _segment

    blob = pickle.dumps(ch.sender())
    with held_by_another_thread(_segment._shared_lock):
        pid = os.fork()
        if pid == 0:  # the child: no pytest from here on, only os._exit
            code = 1
            try:
                pickle.loads(blob).send("from the child", keys=("k",))
                code = 0
            finally:
                os._exit(code)
    assert wait_forked(pid, 10) == 0, "the forked child hung on an inherited lock"
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == "from the child"
