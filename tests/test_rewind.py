"""Rewind: an empty ring starts again at offset 0 (csrc/ring.c, ring_rewind).

A channel whose receiver keeps up must not walk through all of its capacity: a 1 GiB
ring carrying a trickle would touch a fresh page every few dozen messages, in every
process that maps it. When the receiver finds the ring empty far into its lap it claims
the tail for a skip to the lap's end, so the next message lands at the start again. These
tests look at what that must and must not change: the pages a process ends up mapping
(its resident set in the channel's mapping, from /proc/self/smaps), the room the ring
offers afterwards, and every message's delivery with producers in other processes.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import struct
import time

import pytest
from procs import CTX, WAIT, running, take_receiver_seat

import shmchan

MIB = 1 << 20


def mapped_rss(name: str) -> int:
    """Bytes of this process's mappings of channel `name`'s segment that are resident
    (the ring is mapped twice in a row: both count)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                mine = line.rstrip().endswith(name)
            elif mine and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def record(i: int, size: int) -> bytes:
    return struct.pack("<Q", i) + bytes([(i * 7 + 1) & 0xFF]) * (size - 8)


def test_a_receiver_that_keeps_up_maps_only_the_start_of_a_big_ring(make_channel):
    # 32 MiB through a 256 MiB channel, each message received before the next is sent:
    # without rewinds the process maps 32 MiB of ring pages; with them, about the 4 MiB
    # a lap goes before the receiver finds it empty and rewinds.
    ch = make_channel(capacity=256 * MIB)
    tx, rx = ch.sender(), ch.receiver()
    body = bytes(4000)
    tx.send(body, keys=(0,), timeout=WAIT)
    rx.recv(timeout=WAIT).release()
    before = mapped_rss(ch.name)  # the tables and the ring's first page
    for i in range(1, 8 * 1024):
        tx.send(body, keys=(i % 16,), timeout=WAIT)
        with rx.recv(timeout=WAIT) as h:
            assert h.seq == i + 1
    grew = mapped_rss(ch.name) - before
    assert 0 < grew < 8 * MIB, f"{grew / MIB:.1f} MiB more of the ring mapped"


@pytest.mark.parametrize("mib", [8, 64])
def test_a_new_channels_first_messages_take_no_page_fault(make_channel, mib):
    # Every attachment maps the ring's first RING_WARM (320 KiB) when it attaches
    # (csrc/segment.c): a channel's first 2,500 small messages, each received before
    # the next is sent, take no page fault. Before, the ring was walked page by page:
    # 71 faults for these 2,000 messages at 523429c, 7-12 us each on this
    # project's VM, in the sender and again in the receiver.
    import resource

    ch = make_channel(capacity=mib * MIB)
    tx, rx = ch.sender(), ch.receiver()
    body = bytes(64)
    for _ in range(20):  # this process's own first-use costs (handles, the key's entry)
        tx.send(body, keys=(7,), timeout=WAIT)
        rx.recv(timeout=WAIT).release()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2_000):  # 128 bytes a record: 250 KiB of the ring
        tx.send(body, keys=(7,), timeout=WAIT)
        rx.recv(timeout=WAIT).release()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 20, f"{faults} page faults while 2,000 messages went through"


def test_a_rewound_ring_still_holds_its_whole_capacity(make_channel):
    # Rewinding frees nothing and takes nothing: right after one, the channel accepts as
    # many messages as a fresh one does before it is full, and delivers them intact.
    size = 3000

    def fill(tx) -> int:
        n = 0
        while True:
            try:
                tx.send(record(n, size), keys=(n % 5,), timeout=0)
            except shmchan.Full:
                return n
            n += 1

    fresh = make_channel(capacity=16 * MIB)
    want = fill(fresh.sender())
    assert want > 5000

    ch = make_channel(capacity=16 * MIB)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(2000):  # about 6 MiB: past REWIND_AT (4 MiB) of a 16 MiB ring
        tx.send(record(i, size), keys=(i % 5,), timeout=WAIT)
        rx.recv(timeout=WAIT).release()
    assert rx.try_recv() is None  # empty: the receiver rewinds here
    got = fill(tx)
    assert got == want
    for i in range(got):
        with rx.recv(timeout=WAIT) as h:
            assert h.payload == record(i, size)
    assert rx.try_recv() is None


def bursty_producer(name: str, me: int, bursts: int, per_burst: int, size: int) -> None:
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        i = 0
        for _ in range(bursts):
            for _ in range(per_burst):
                tx.send(record(me << 32 | i, size), keys=(f"p{me}k{i % 7}",), timeout=WAIT)
                i += 1
            time.sleep(0.005)  # the receiver catches up and finds the ring empty


def test_producers_in_other_processes_lose_nothing_across_rewinds(make_channel):
    # Three producers in bursts, so the receiver often finds the ring empty mid-lap and
    # rewinds while they claim: every message arrives once, intact, in its key's order,
    # and the receiver's mapping shows that rewinds kept it near the ring's start.
    ch = make_channel(capacity=64 * MIB)
    rx = ch.receiver()
    before = mapped_rss(ch.name)
    nprod, bursts, per_burst, size = 3, 100, 20, 4000  # about 23 MiB in all
    procs = [
        CTX.Process(target=bursty_producer, args=(ch.name, me, bursts, per_burst, size))
        for me in range(nprod)
    ]
    last: dict[tuple[int, int], int] = {}
    seen = 0
    deadline = time.monotonic() + 4 * WAIT
    with running(*procs):
        while seen < nprod * bursts * per_burst:
            assert time.monotonic() < deadline, f"only {seen} messages arrived"
            h = rx.recv(timeout=WAIT)
            (tag,) = struct.unpack_from("<Q", h.payload)
            me, i = tag >> 32, tag & 0xFFFFFFFF
            assert h.payload == record(tag, size)
            assert h.keys == (f"p{me}k{i % 7}",)
            assert last.get((me, i % 7), -1) < i  # per key, in the order sent
            last[(me, i % 7)] = i
            h.release()
            seen += 1
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0
    assert rx.try_recv() is None
    assert len(last) == nprod * 7
    stats = ch.stats()
    assert (stats.queued, stats.inflight) == (0, 0)
    assert mapped_rss(ch.name) - before < 8 * MIB


# --- torture: receivers and producers SIGKILLed while the ring rewinds ----------------------


def _header_offset(field: bytes) -> int:
    """Where a header word lives, from the C core (csrc/segment.c)."""
    from shmchan._lib import ffi, lib

    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(b"header." + field, out) == 0
    return int(out[0])


def torture_message(me: int, n: int) -> tuple[bytes, tuple[str, ...]]:
    """(payload, keys) of producer me's message n: its size and bytes follow from (me, n)."""
    size = 16 + (n * 2654435761 + me * 97) % 6000
    body = struct.pack("<QQ", me, n) + bytes((me * 31 + n + j) & 0xFF for j in range(size - 16))
    return body, (f"p{me}k{n % 3}",)


def torture_producer(name: str, me: int, log_path: str, seed: int) -> None:
    """Send bursts until killed; log n (one write) once send(n) has returned."""
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        n = 0
        while True:
            for _ in range(rng.randint(1, 40)):
                body, keys = torture_message(me, n)
                tx.send(body, keys=keys, timeout=WAIT)
                os.write(fd, b"%d\n" % n)
                n += 1
            time.sleep(rng.uniform(0.001, 0.008))  # the receiver drains the ring and rewinds


def torture_receiver(name: str, log_path: str, seed: int) -> None:
    """Take the receiver seat, then receive, check, hold a few handles (some with their
    zero-copy view: islands) and release them in random order until killed. Logs, one
    write each: 'R me n seq attempt' once checked, 'l me n' before a release, 'L me n'
    after it."""
    rng = random.Random(seed)
    with shmchan.Channel.open(name) as ch:
        rx = take_receiver_seat(ch)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"S\n")  # seated: from now on a kill is a receiver's death
        held: list[tuple[shmchan.Handle, memoryview | None, int, int]] = []

        def release_one() -> None:
            h, view, me, n = held.pop(rng.randrange(len(held)))
            if view is not None and view != torture_message(me, n)[0]:
                os.write(fd, b"X a held view changed: seq %d\n" % h.seq)
                os._exit(3)
            os.write(fd, b"l %d %d\n" % (me, n))
            h.release()
            os.write(fd, b"L %d %d\n" % (me, n))

        while True:
            if held:  # what is queued may wait for keys we hold
                got = rx.try_recv()
                batch = [got] if got is not None else []
                if not batch:
                    release_one()
                    continue
            else:
                try:
                    batch = rx.recv_many(rng.randint(1, 8), timeout=0.05)
                except shmchan.Empty:
                    continue
            for h in batch:
                data = h.data.tobytes()
                me, n = struct.unpack_from("<QQ", data)
                if (data, h.keys) != torture_message(me, n):
                    os.write(fd, b"X torn or wrong: seq %d\n" % h.seq)
                    os._exit(3)
                os.write(fd, b"R %d %d %d %d\n" % (me, n, h.seq, h.attempt))
                held.append((h, h.data if rng.random() < 0.3 else None, me, n))
            while len(held) > rng.randint(0, 4):
                release_one()


@pytest.mark.timeout(120)
def test_receivers_and_producers_killed_while_the_ring_rewinds_lose_nothing(make_channel, tmp_path):
    # A 256 KiB ring rewinds once the receiver finds it empty 128 KiB into a lap. Producers
    # send in bursts, so that happens again and again; meanwhile the receiver process is
    # SIGKILLed at random moments (inside ring_rewind too, sometimes) and a new one takes
    # its seat, and producers are killed and replaced. The failure model: every
    # send that returned is delivered; none is torn; a message the receiver had released
    # never comes back; one in flight at the receiver's death comes back with a higher
    # attempt; per key, releases follow the order of sending.
    ch = make_channel(capacity=256 << 10)
    rng = random.Random(2026)
    rewinds_at = _header_offset(b"rewinds")  # counted by ring_rewind, kept across receivers
    seg = os.open(f"/dev/shm/shmchan.{ch.name}", os.O_RDONLY)
    producers: dict[int, multiprocessing.process.BaseProcess] = {}
    plogs: dict[int, str] = {}
    rlogs: list[str] = []
    receiver: multiprocessing.process.BaseProcess | None = None
    next_id = 0

    def start_producer() -> None:
        nonlocal next_id
        me, next_id = next_id, next_id + 1
        plogs[me] = str(tmp_path / f"p{me}.log")
        p = CTX.Process(target=torture_producer, args=(ch.name, me, plogs[me], rng.random()))
        p.start()
        producers[me] = p

    def start_receiver() -> multiprocessing.process.BaseProcess:
        rlogs.append(str(tmp_path / f"r{len(rlogs)}.log"))
        p = CTX.Process(target=torture_receiver, args=(ch.name, rlogs[-1], rng.random()))
        p.start()
        return p

    def kill(p: multiprocessing.process.BaseProcess) -> None:
        p.kill()
        p.join(WAIT)
        assert p.exitcode == -signal.SIGKILL, f"exited with {p.exitcode} before the kill"

    try:
        for _ in range(3):
            start_producer()
        receiver = start_receiver()
        stop = time.monotonic() + 8.0
        next_rx_kill = 0.0  # set once the receiver is seated and has rewound
        next_tx_kill = time.monotonic() + rng.uniform(0.2, 1.0)
        rewinds = 0
        seated: tuple[int, float] | None = None  # (rewinds, when) as the receiver sat down
        killed_after = 0  # rewinds done before the latest receiver kill
        # A receiver spends its first moments draining what queued while no receiver was
        # seated (a new process starts slowly, more so on a loaded machine), and a ring
        # that is never empty does not rewind: receivers killed at a random moment of that
        # (10-300 ms after they sat down) rewound about once in 40 s. So each one is killed
        # at a random moment after it rewound the ring (or after 3 s without): the rewinds
        # interleave with the kills. 8 s, longer (at most 40 s more) until 3 rewinds came
        # before a receiver kill and more than 10 receivers were killed (a loaded machine
        # starts a receiver process in seconds).
        kills = 0
        while time.monotonic() < stop or (
            (killed_after < 3 or kills <= 10) and time.monotonic() < stop + 40.0
        ):
            rewinds = int.from_bytes(os.pread(seg, 4, rewinds_at), "little")
            now = time.monotonic()
            if seated is None and os.path.exists(rlogs[-1]):
                seated = (rewinds, now)
            if seated and not next_rx_kill and (rewinds > seated[0] or now > seated[1] + 3.0):
                next_rx_kill = now + rng.uniform(0.01, 0.3)  # a random moment of its work
            if next_rx_kill and now > next_rx_kill:
                kill(receiver)
                killed_after = rewinds
                kills += 1
                receiver = start_receiver()
                next_rx_kill = 0.0
                seated = None
            if now > next_tx_kill:
                me = rng.choice(sorted(producers))
                kill(producers.pop(me))
                start_producer()
                next_tx_kill = now + rng.uniform(0.2, 1.0)
            time.sleep(0.0005)
        for me in sorted(producers):
            kill(producers.pop(me))
        kill(receiver)
        receiver = None
        rlogs.append(str(tmp_path / "final.log"))
        torture_receiver_drain(ch, rlogs[-1])
    finally:
        os.close(seg)
        for p in [*producers.values(), *([receiver] if receiver else [])]:
            p.kill()
            p.join(WAIT)

    # The scenario happened: the receivers rewound the ring while they and the producers
    # were being killed (3 rewinds before a receiver kill are aimed for; the check asks
    # for the scenario itself: at least one).
    assert killed_after >= 1, f"{killed_after} rewinds before a receiver kill, {rewinds} in all"
    # Each receiver's log, in the order they lived (each was dead before the next took
    # its seat). A receiver logs l before a release and L after it, so a message with
    # an l and no L may have been released before the kill; one with neither was still
    # out and must come back.
    gens = []
    for path in rlogs:
        if os.path.exists(path):  # killed before it was seated: nothing happened
            with open(path, "rb") as f:
                gens.append([ln.split(" ") for ln in f.read().decode().split("\n")[:-1]])
    # More than 10 receivers are aimed for; a machine loaded enough to start a receiver
    # process only every few seconds still gives the scenario with 5 (the final drain is one).
    assert len(gens) >= 5, f"only {len(gens)} receivers"
    received: dict[tuple[int, int], list[int]] = {}  # message -> attempts, in order
    released: set[tuple[int, int]] = set()
    maybe_released: set[tuple[int, int]] = set()  # released, or its receiver died first
    last_released: dict[tuple[int, int], int] = {}  # (producer, key) -> last n released
    for events in gens:
        out: set[tuple[int, int]] = set()  # taken in this generation, not yet released
        releasing: tuple[int, int] | None = None
        for kind, *rest in events:
            assert kind != "X", rest
            if kind == "S":
                continue
            me, n = int(rest[0]), int(rest[1])
            if kind == "R":
                assert (me, n) not in released, f"{(me, n)} came back after its release"
                attempts = received.setdefault((me, n), [])
                # redelivered after a receiver's death: a higher attempt
                assert not attempts or int(rest[3]) > attempts[-1], (me, n, rest, attempts)
                attempts.append(int(rest[3]))
                maybe_released.discard((me, n))
                out.add((me, n))
            elif kind == "l":
                releasing = (me, n)
            else:
                assert releasing == (me, n)
                releasing = None
                out.remove((me, n))
                released.add((me, n))
                key = (me, n % 3)  # per key, releases in the order of sending
                assert last_released.get(key, -1) < n, f"key {key}: {n} after {last_released[key]}"
                last_released[key] = n
        if releasing is not None:
            maybe_released.add(releasing)
    for me, path in plogs.items():
        logged = {int(x) for x in open(path).read().split()} if os.path.exists(path) else set()
        got = {n for (who, n) in received if who == me}
        assert logged <= got, f"producer {me}: sent, never delivered: {sorted(logged - got)[:5]}"
        assert got == set(range(len(got)))  # its sends and nothing else (one may be unlogged)
    # Every message taken was released, by the final drain at the latest, except at most
    # one per killed receiver, released as it died.
    assert set(received) - released <= maybe_released
    stats = ch.stats()
    assert (stats.queued, stats.inflight) == (0, 0)


def torture_receiver_drain(ch: shmchan.Channel, log_path: str) -> None:
    """In this process, after every child is dead: the last receiver drains the channel,
    logging as torture_receiver does."""
    with open(log_path, "wb") as log:
        rx = ch.receiver()
        deadline = time.monotonic() + WAIT
        while True:
            assert time.monotonic() < deadline, "the final drain did not end"
            try:
                h = rx.recv(timeout=1.0)
            except shmchan.Empty:
                break
            data = h.data.tobytes()
            me, n = struct.unpack_from("<QQ", data)
            assert (data, h.keys) == torture_message(me, n), f"torn or wrong: seq {h.seq}"
            log.write(b"R %d %d %d %d\n" % (me, n, h.seq, h.attempt))
            log.write(b"l %d %d\n" % (me, n))
            h.release()
            log.write(b"L %d %d\n" % (me, n))
        rx.close()
