"""Ring space: long-lived records keep only their own space (csrc/compact.c).

Dead letters and held handles stay in the ring for as long as they live. Scattered
among released messages they must not pin the space around them: the channel keeps
accepting messages while the bytes it holds fit, whatever is pinned where.
"""

from __future__ import annotations

import os
import random
import struct
import time

import pytest
from procs import CTX, WAIT, running, send_to_a_waiting_receiver

import shmchan


def payload(i: int, size: int) -> bytes:
    head = struct.pack("<Q", i)
    return head + bytes((i + j) & 0xFF for j in range(size - len(head)))


def test_scattered_dead_letters_do_not_fill_a_small_channel(make_channel):
    # The reproduction of issue #8 item 2: 64 KiB, max_attempts=1, every 10th message
    # nacked. It used to raise Full after 7-8 dead letters (8 KB of 64 KB) with nothing
    # queued or in flight.
    ch = make_channel(capacity=64 << 10, max_attempts=1)
    tx, rx = ch.sender(), ch.receiver()
    dead = []
    for i in range(400):  # 40 dead letters: about 41 KB of the 64 KB
        tx.send(payload(i, 1000), keys=(f"k{i % 7}",), timeout=2)
        h = rx.recv(timeout=2)
        assert h.seq == i + 1 and h.payload == payload(i, 1000)
        if i % 10 == 9:
            h.nack()
            dead.append(i)
        else:
            h.release()
    stats = ch.stats()
    assert (stats.queued, stats.inflight, stats.dead_letters) == (0, 0, len(dead))
    letters = ch.dead_letters()
    assert [d.payload for d in letters] == [payload(i, 1000) for i in dead]
    assert [d.seq for d in letters] == [i + 1 for i in dead]
    for d in letters:
        assert d.discard()
    rx.try_recv()  # let the receiver take the discards in
    assert ch.stats().dead_letters == 0


def chaos_producer(name: str, me: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        for i in range(count):
            size = rng.randrange(64, 6000)
            tx.send(payload(me << 32 | i, size), keys=(f"k{rng.randrange(20)}",), timeout=WAIT)


@pytest.mark.timeout(120)
def test_dead_letters_under_chaos_keep_only_their_own_space(make_channel):
    # Variant of the 1 MiB chaos run that stayed full with 15-18 dead letters (40 KB):
    # two producers, random sizes and keys, random nacks, some handles held a while.
    ch = make_channel(capacity=1 << 20, max_attempts=1)
    rx = ch.receiver()
    per = 2500
    procs = [CTX.Process(target=chaos_producer, args=(ch.name, p, per, 1000 + p)) for p in range(2)]
    rng = random.Random(7)
    seen: set[int] = set()
    nacked: set[int] = set()
    held: list[shmchan.Handle] = []
    with running(*procs):
        last = time.monotonic()
        while len(seen) < 2 * per:
            try:
                h = rx.recv(timeout=1.0)
            except shmchan.Empty:
                # Whatever waits behind the held handles' keys may go on once they are
                # released; a channel that stays stuck after that is the bug.
                assert time.monotonic() - last < WAIT, f"stuck at {len(seen)}: {ch.stats()}"
                for h in held:
                    h.release()
                held.clear()
                continue
            last = time.monotonic()
            ident = struct.unpack_from("<Q", h.payload)[0]  # a copy: nothing pinned
            assert ident not in seen
            seen.add(ident)
            roll = rng.random()
            if roll < 0.04 and len(nacked) < 120:  # ~120 dead letters, ~360 KB at most
                nacked.add(ident)
                h.nack()
            elif roll < 0.10:
                held.append(h)  # released a little later, out of order
            else:
                h.release()
            if len(held) > 8:
                held.pop(rng.randrange(len(held))).release()
        for h in held:
            h.release()
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0  # no send stayed Full for WAIT seconds
    assert {struct.unpack_from("<Q", d.payload)[0] for d in ch.dead_letters()} == nacked
    assert ch.stats().dead_letters == len(nacked)


# ---- zero-copy views: pinned records become islands (csrc/islands.c) ----------------------


def island_producer(name: str, count: int, size: int) -> None:
    """Send `count` messages of `size` bytes; message i carries key "pinned" (i == 0) or
    k<i % 3>. A send that stays Full for WAIT seconds fails the process."""
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        for i in range(count):
            tx.send(payload(i, size), keys=("pinned" if i == 0 else f"k{i % 3}",), timeout=WAIT)


def drain_in_key_order(rx: shmchan.Receiver, proc, want: int, first: int = 1) -> None:
    """Receive messages first..want-1 (releasing each), checking every one arrives once and
    each key's messages in order; fail if the producer died or nothing came for WAIT."""
    seen: set[int] = set()
    last_per_key: dict[tuple[object, ...], int] = {}
    last = time.monotonic()
    while len(seen) < want - first:
        try:
            h = rx.recv(timeout=0.5)
        except shmchan.Empty:
            assert proc.exitcode in (None, 0), f"the producer failed (Full?): {proc.exitcode}"
            assert time.monotonic() - last < WAIT, f"stuck at {len(seen)}"
            continue
        last = time.monotonic()
        with h:
            i = struct.unpack_from("<Q", h.data)[0]  # a view of its own, released at once
            assert first <= i < want and i not in seen
            seen.add(i)
            assert last_per_key.get(h.keys, -1) < i  # per-key order
            last_per_key[h.keys] = i


@pytest.mark.timeout(180)
def test_a_zero_copy_view_held_while_10_mb_flow_does_not_stop_the_channel(make_channel):
    # The reproduction of issue #8 item 3: one handle held with h.data read, in a 1 MiB
    # channel, made 100 KB sends raise Full forever after 10 messages (used_bytes 1 001 552,
    # queued=0). Here 10 MB flow past it from another process.
    ch = make_channel(capacity=1 << 20)
    rx = ch.receiver()
    count, size = 101, 100_000
    proc = CTX.Process(target=island_producer, args=(ch.name, count, size))
    with running(proc):
        held = rx.recv(timeout=WAIT)
        view = held.data  # pins the record where it is, for the whole test
        assert bytes(view) == payload(0, size)
        drain_in_key_order(rx, proc, count)
        proc.join(WAIT)
        assert proc.exitcode == 0  # no send stayed Full
    assert bytes(view) == payload(0, size)  # the view still reads its own bytes
    assert [(k.key, k.seq) for k in ch.held()] == [("pinned", 1)]  # operators see it
    stats = ch.stats()
    assert (stats.queued, stats.inflight, stats.sent, stats.released) == (0, 1, count, count - 1)
    assert stats.used_bytes < 2 * (size + 512)  # live bytes: the held message, a frame at most
    del view
    held.release()
    rx.try_recv()  # the receiver takes the release in
    assert ch.stats().used_bytes < size + 512


def test_many_pinned_views_at_once_keep_the_channel_flowing(make_channel):
    # Twenty views (up to 40 KB each, about half the ring pinned at times) held across many
    # laps, scattered among 10 MB of messages of mixed sizes, released oldest first.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    rng = random.Random(3)
    pinned: list[tuple[shmchan.Handle, memoryview, bytes]] = []
    most = 0
    sent = 0
    i = 0
    while sent < 10_000_000:
        size = rng.randrange(1000, 40_000)
        body = payload(i, size)
        tx.send(body, keys=(f"m{i}",), timeout=2)  # Full after 2 s fails the test
        sent += size
        h = rx.recv(timeout=2)
        assert h.seq == i + 1
        if i % 9 == 4:
            pinned.append((h, h.data, body))  # h.data pins the record where it lies
            most = max(most, len(pinned))
        else:
            assert h.data == body
            h.release()
        if len(pinned) > 20:  # release the oldest now and then: its space comes back
            h, view, want = pinned.pop(0)
            assert view == want  # never overwritten while it was an island
            h.release()
        i += 1
    assert most == 21
    for h, view, want in pinned:
        assert view == want
        h.release()
    rx.try_recv()
    stats = ch.stats()
    assert (stats.inflight, stats.queued, stats.released) == (0, 0, i)
    assert stats.used_bytes < 64 << 10


def test_past_32_islands_the_next_pinned_record_waits_until_a_view_is_released(make_channel):
    # The bound README states: at most 32 islands at once. A 33rd pinned record at head
    # stops the ring there (sends then raise Full once it is full); releasing any view
    # lets it become an island, and the channel flows again. Nothing is lost.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    pinned: list[tuple[shmchan.Handle, memoryview, bytes]] = []
    i = 0

    def one(pin: bool, timeout: float = 2) -> None:
        nonlocal i
        body = payload(i, 10_000)
        tx.send(body, keys=(f"k{i}",), timeout=timeout)
        h = rx.recv(timeout=2)
        assert h.seq == i + 1
        if pin:
            pinned.append((h, h.data, body))
        else:
            assert h.data == body
            h.release()
        i += 1

    for _ in range(32):  # 32 views, each followed by more than a ring of traffic
        one(pin=True)
        for _ in range(120):
            one(pin=False)  # Full after 2 s fails the test
    one(pin=True)  # the 33rd
    with pytest.raises(shmchan.Full):
        for _ in range(200):  # the ring fills behind it: 1 MiB holds about 100 of these
            one(pin=False, timeout=0.05)
    h, view, want = pinned.pop(5)  # any island's view: its table entry frees
    assert view == want
    h.release()
    for _ in range(300):  # three rings of traffic flow again
        one(pin=False)
    for h, view, want in pinned:
        assert view == want
        h.release()
    rx.try_recv()
    assert (ch.stats().inflight, ch.stats().queued) == (0, 0)


def adopt_and_view(handles, ready) -> None:
    """Adopt a pickled handle, pin its record with a view, and sit on it."""
    h = handles.get(timeout=WAIT)
    view = h.data
    ready.put(bytes(view[:8]))
    time.sleep(WAIT * 4)


@pytest.mark.timeout(120)
def test_a_killed_viewer_gives_its_island_back(make_channel):
    # The holder of a zero-copy view is SIGKILLed while its record is an island: the
    # message comes back (attempt 2) from where it lies, and its space once released.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    first = payload(0, 100_000)
    tx.send(first, keys=("pinned",))
    handles, ready = CTX.Queue(), CTX.Queue()
    viewer = CTX.Process(target=adopt_and_view, args=(handles, ready))
    with running(viewer):
        h = rx.recv(timeout=WAIT)
        handles.put(h)  # pickling hands it over
        del h
        assert ready.get(timeout=WAIT) == first[:8]
        for i in range(1, 31):  # 3 MB: head must pass the pinned record
            tx.send(payload(i, 100_000), keys=(f"k{i % 3}",), timeout=WAIT)
            with rx.recv(timeout=WAIT) as h:
                assert h.seq == i + 1 and h.data == payload(i, 100_000)
        assert ch.stats().inflight == 1
        viewer.kill()
        viewer.join(WAIT)
        h = rx.recv(timeout=WAIT)  # the dead holder's message, redelivered
        assert (h.seq, h.attempt) == (1, 2) and h.data == first
        for i in range(31, 61):  # and the channel flows on meanwhile
            tx.send(payload(i, 100_000), keys=(f"k{i % 3}",), timeout=WAIT)
            with rx.recv(timeout=WAIT) as h2:
                assert h2.seq == i + 1 and h2.data == payload(i, 100_000)
        h.release()
    rx.try_recv()
    stats = ch.stats()
    assert (stats.inflight, stats.queued, stats.redelivered) == (0, 0, 1)
    assert stats.used_bytes < 100_000  # the island's space is back


def receive_view_and_die(name: str, nack: bool, ready) -> None:
    """As a receiver: pin the first message with a view, let 3 MB flow past it (head
    passes it: an island), nack it if asked, then report and wait to be killed."""
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        h = rx.recv(timeout=WAIT)
        view = h.data
        ready.put(bytes(view[:8]))
        for i in range(1, 31):
            with rx.recv(timeout=WAIT) as h2:
                assert h2.data == payload(i, 100_000)
        if nack:
            del view
            h.nack()  # waits for its redelivery where it lies, behind head
        ready.put(ch.stats().inflight)
        time.sleep(WAIT * 4)


def feed(name: str, start: int, stop: int) -> None:
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        for i in range(start, stop):
            tx.send(payload(i, 100_000), keys=(f"k{i % 3}",), timeout=WAIT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nack", [False, True], ids=["held", "nacked"])
def test_islands_survive_a_receiver_that_dies_inside_an_update(make_channel, nack):
    # The receiver dies with an island in the ring (held by its own view, or nacked and
    # waiting behind head for its redelivery) and its dirty flag up, so its successor
    # rebuilds (rebuild.c, islands.c): the message comes back once, from its island.
    from test_crash import mark_dirty

    ch = make_channel(capacity=1 << 20)
    ch.sender().send(payload(0, 100_000), keys=("pinned",))
    ready = CTX.Queue()
    child = CTX.Process(target=receive_view_and_die, args=(ch.name, nack, ready))
    producer = CTX.Process(target=feed, args=(ch.name, 1, 31))
    with running(child, producer):
        assert ready.get(timeout=WAIT) == payload(0, 8)
        assert ready.get(timeout=WAIT) == (0 if nack else 1)
        producer.join(WAIT)
        assert producer.exitcode == 0
        child.kill()
        child.join(WAIT)
    mark_dirty(ch.name)  # as if it died inside an update: the next receiver must rebuild
    rx = ch.receiver()
    producer = CTX.Process(target=feed, args=(ch.name, 31, 61))
    with running(producer):
        h = rx.recv(timeout=WAIT)
        # held: the dead receiver's handle, revoked (attempt 2). nacked: a rebuild takes
        # every message no handle holds in afresh (rebuild.c), so its count starts again.
        assert (h.seq, h.attempt) == (1, 1 if nack else 2) and h.data == payload(0, 100_000)
        drain_in_key_order(rx, producer, 61, first=31)  # 3 MB more flow past it
        producer.join(WAIT)
        assert producer.exitcode == 0
        h.release()
    rx.try_recv()
    stats = ch.stats()
    assert (stats.inflight, stats.queued) == (0, 0)
    assert stats.used_bytes < 100_000


def produce_logged(name: str, me: int, log_path: str) -> None:
    """Send 50-100 KB messages until killed; log each n once its send returned."""
    rng = random.Random(me)
    with shmchan.Channel.open(name) as ch, open(log_path, "a") as log:
        tx = ch.sender()
        for n in range(1 << 30):
            tx.send(
                payload(me << 32 | n, rng.randrange(50_000, 100_000)),
                keys=(f"k{n % 3}",),
                timeout=WAIT,
            )
            log.write(f"{n}\n")
            log.flush()


@pytest.mark.timeout(180)
def test_producers_killed_while_stepping_over_islands_lose_nothing(make_channel, tmp_path):
    # Producers SIGKILLed at random moments while two views pin islands in a 1 MiB ring
    # (so claims keep stepping over them, lap after lap; a claim cut short is repaired by
    # the next walker, csrc/islands.c): every send that returned is delivered, once, and
    # no message is torn; the islands' bytes are never written over.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    rng = random.Random(11)
    views = []
    for i in range(2):
        tx.send(payload(i, 60_000 + 30_000 * i), keys=(f"pinned{i}",))
    for i in range(2):
        h = rx.recv(timeout=WAIT)
        views.append((h, h.data, payload(i, 60_000 + 30_000 * i)))
    delivered: dict[int, set[int]] = {}
    logs = {}

    def take(timeout: float) -> bool:
        try:
            h = rx.recv(timeout=timeout)
        except shmchan.Empty:
            return False
        with h:
            ident = struct.unpack_from("<Q", h.data)[0]
            me, n = ident >> 32, ident & 0xFFFFFFFF
            assert h.data == payload(ident, len(h.data))  # whole, never torn
            assert n not in delivered.setdefault(me, set())
            delivered[me].add(n)
        return True

    for me in range(1, 9):
        logs[me] = tmp_path / f"p{me}.log"
        proc = CTX.Process(target=produce_logged, args=(ch.name, me, str(logs[me])))
        with running(proc):
            started = time.monotonic()
            while not delivered.get(me):  # it runs: now kill it at a random moment
                assert time.monotonic() - started < WAIT, f"producer {me} sent nothing"
                take(0.05)
            end = time.monotonic() + rng.uniform(0.05, 0.5)
            while time.monotonic() < end:
                take(0.05)
            proc.kill()
            proc.join(WAIT)
    while take(1.0):
        pass
    for me, path in logs.items():
        logged = {int(x) for x in path.read_text().split()} if path.exists() else set()
        got = delivered.get(me, set())
        assert logged <= got  # every send that returned
        assert got == set(range(len(got)))  # and nothing but its sends, in one piece
    for h, view, want in views:
        assert view == want
        h.release()
    rx.try_recv()
    stats = ch.stats()
    assert (stats.inflight, stats.queued) == (0, 0)
    assert stats.used_bytes < 64 << 10


@pytest.mark.parametrize("kinds", ["held,viewed", "viewed,held", "held,viewed,held"])
def test_handles_held_next_to_a_pinned_view_do_not_stop_the_channel(make_channel, kinds):
    # A handle held without a view can be slid forward (compact.c) -- but not past a
    # pinned record right behind it, nor, on a later lap, past the skip over an island
    # it landed next to. Then it stays where it is too, as an island.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    kept = []
    for j, kind in enumerate(kinds.split(",")):
        tx.send(payload(j, 50_000), keys=(f"x{j}",))
        h = rx.recv(timeout=2)
        kept.append((h, h.data if kind == "viewed" else None, payload(j, 50_000)))
    for i in range(len(kept), 120):  # 12 MB
        tx.send(payload(i, 100_000), keys=(f"k{i % 3}",), timeout=2)
        with rx.recv(timeout=2) as h:
            assert h.seq == i + 1 and h.data == payload(i, 100_000)
    for h, view, want in kept:
        assert h.payload == want and (view is None or view == want)
        h.release()
    rx.try_recv()
    assert ch.stats().used_bytes < 64 << 10


def test_messages_waiting_for_a_held_key_next_to_an_island_do_not_stop_the_channel(make_channel):
    # Messages parked behind a held key (window.c) slide forward (compact.c); the skip
    # over an island right after them must not stop them.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(payload(0, 30_000), keys=("a",))
    held = rx.recv(timeout=2)  # holds key "a", no view
    tx.send(payload(1, 50_000), keys=("p",))
    pinned = rx.recv(timeout=2)
    view = pinned.data
    for j in range(2, 5):
        tx.send(payload(j, 20_000), keys=("a",))  # wait for "a": parked
    for i in range(5, 130):  # 12.5 MB
        tx.send(payload(i, 100_000), keys=(f"k{i % 3}",), timeout=2)
        with rx.recv(timeout=2) as h:
            assert h.seq == i + 1 and h.data == payload(i, 100_000)
    held.release()
    for j in range(2, 5):
        with rx.recv(timeout=2) as h:
            assert h.seq == j + 1 and h.data == payload(j, 20_000)
    assert view == payload(1, 50_000)
    del view
    pinned.release()
    rx.try_recv()
    assert ch.stats().used_bytes < 64 << 10


def view_first_and_wait(name: str, ready) -> None:
    """As a receiver: take the first message, pin it with a view, and wait to be killed."""
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        h = rx.recv(timeout=WAIT)
        view = h.data
        ready.put(bytes(view[:8]))
        time.sleep(WAIT * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["held", "queued"])
def test_a_receiver_killed_while_making_an_island_leaves_a_whole_channel(make_channel, entry):
    # The state a receiver SIGKILLed inside island_make_at_head leaves: the island's entry
    # written (and counted), head not yet past the record, its dirty flag up. The next
    # receiver rebuilds (islands.c island_rebuild): an entry whose record is a message
    # that a handle holds stays; one over a message no handle holds, not yet passed by
    # head, is dropped (the message is taken in from the ring as usual).
    from test_crash import DIRTY_OFFSET, _fact

    ch = make_channel(capacity=1 << 20)
    tx = ch.sender()
    tx.send(payload(0, 100_000), keys=("pinned",))
    ready = CTX.Queue()
    child = CTX.Process(target=view_first_and_wait, args=(ch.name, ready))
    with running(child):
        assert ready.get(timeout=WAIT) == payload(0, 8)
        child.kill()
        child.join(WAIT)
    fd = os.open(f"/dev/shm/shmchan.{ch.name}", os.O_RDWR)
    try:
        header = os.pread(fd, 4096, 0)
        ring_off = int.from_bytes(header[_fact("header.ring_off") :][:8], "little")
        head = int.from_bytes(header[_fact("header.head") :][:8], "little")
        assert head == 0
        meta = int.from_bytes(os.pread(fd, 8, ring_off + 8), "little")
        length = meta >> 8  # the record at head (core.h: meta = length << 8 | state)
        where = length if entry == "queued" else 0  # record 2, or record 1
        if where:  # a second message, not received yet
            tx.send(payload(1, 1000), keys=("other",))
        islands = _fact("header.islands")
        end_len = (where + length).to_bytes(8, "little") + length.to_bytes(8, "little")
        os.pwrite(fd, end_len, islands)
        os.pwrite(fd, (1).to_bytes(4, "little"), _fact("header.island_count"))
        os.pwrite(fd, (1).to_bytes(4, "little"), DIRTY_OFFSET)
    finally:
        os.close(fd)
    rx = ch.receiver()
    got = {}
    while len(got) < (2 if where else 1):  # the dead receiver's handle, revoked; the other
        h = rx.recv(timeout=WAIT)
        assert h.seq not in got
        got[h.seq] = h
    if where:
        other = got.pop(2)
        assert other.attempt == 1 and other.data == payload(1, 1000)
        other.release()
    h = got.pop(1)
    assert h.attempt == 2 and h.data == payload(0, 100_000)
    producer = CTX.Process(target=feed, args=(ch.name, 2, 62))
    with running(producer):
        drain_in_key_order(rx, producer, 62, first=2)  # 6 MB flow past the pinned one
        producer.join(WAIT)
        assert producer.exitcode == 0
    assert h.data == payload(0, 100_000)
    h.release()
    rx.try_recv()
    stats = ch.stats()
    assert (stats.inflight, stats.queued) == (0, 0)
    assert stats.used_bytes < 100_000


# ---- a held key with its waiting messages scattered through the ring -----------------------


def send_or_poll_once(tx: shmchan.Sender, rx: shmchan.Receiver, body: bytes, key: str, keep):
    """Send without waiting; if the ring is full, let the receiver poll once (whatever it
    hands out goes to `keep`) and send again: that second try must get in."""
    try:
        tx.send(body, keys=(key,), timeout=0)
        return
    except shmchan.Full:
        pass
    h = rx.try_recv()
    if h is not None:
        keep(h)
    tx.send(body, keys=(key,), timeout=0)  # Full here fails the test


def test_a_held_key_with_messages_parked_all_over_the_ring_does_not_fill_it(make_channel):
    # A 1 MiB channel; the receiver holds the first message it gets and releases every
    # other one at once; 64-byte messages on keys drawn from 2 000. The ones on the held
    # key wait (parked, csrc/window.c), one every 2 000 or so, scattered through the ring:
    # about 20 KB of live data at the end. It used to raise Full for good after about
    # 123 000 sends (used_bytes 1 048 464, queued 56, inflight 1), whatever the receiver
    # did, until the one handle was released.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    rng = random.Random(1)
    held: list[shmchan.Handle] = []

    def keep(h: shmchan.Handle) -> None:
        if held:
            h.release()
        else:
            held.append(h)

    count = 250_000
    for i in range(count):
        send_or_poll_once(tx, rx, i.to_bytes(8, "little") * 8, f"k{rng.randrange(2000)}", keep)
        while (h := rx.try_recv()) is not None:
            keep(h)
    stats = ch.stats()
    assert stats.inflight == 1 and stats.queued > 50  # the held one and those behind it
    (first,) = held
    waiting, keys, last = stats.queued, first.keys, first.seq
    first.release()
    got = 0
    while (h := rx.try_recv()) is not None:  # in order, each after the one before
        with h:
            assert h.keys == keys and h.seq > last
            last = h.seq
            got += 1
    assert got == waiting
    stats = ch.stats()
    assert (stats.inflight, stats.queued, stats.released) == (0, 0, count)


def hold_slow(payload: bytes, keys: tuple, flag: str = "") -> None:
    """KeyedPool handler: the message marked b"S" on key "slow" runs until `flag` exists
    (20 s at most); every other one returns at once."""
    if keys == ("slow",) and payload[:1] == b"S":
        flag = payload[1:].decode()
        end = time.monotonic() + 20
        while time.monotonic() < end and not os.path.exists(flag):
            time.sleep(0.01)


@pytest.mark.timeout(120)
def test_a_pool_handler_holding_one_key_does_not_stop_producers_on_other_keys(
    make_channel, tmp_path
):
    # KeyedPool: one handler runs for up to 20 s on key "slow"; an outside producer sends
    # 512-byte messages on other keys, and one in a hundred on "slow", which waits behind
    # it. The 1 MiB channel used to refuse the producer (Full after about 1 900 sends, with
    # 10 messages, 6 KB, waiting) until the slow handler returned.
    ch = make_channel(capacity=1 << 20)
    tx = ch.sender()
    flag = tmp_path / "go"
    rng = random.Random(5)
    with shmchan.KeyedPool(ch.name, hold_slow, processes=2, mp_context=CTX) as pool:
        tx.send(b"S" + str(flag).encode(), keys=("slow",), timeout=WAIT)
        started = time.monotonic()
        for i in range(6_000):  # 3 MB: three times round the ring
            key = "slow" if rng.random() < 1 / 100 else f"k{rng.randrange(1000)}"
            tx.send(i.to_bytes(8, "little") * 64, keys=(key,), timeout=5)  # Full fails it
        assert time.monotonic() - started < 20  # all before the slow handler gave up
        assert pool.stats().held_keys >= 1
        flag.touch()
    stats = ch.stats()  # the pool stops taking messages at close: the rest wait in the channel
    assert (stats.inflight, stats.queued + stats.released) == (0, 6_001)


def wait_for_flag(flag: str) -> str:
    end = time.monotonic() + 20
    while time.monotonic() < end and not os.path.exists(flag):
        time.sleep(0.01)
    return "slow"


def identity(i: int, pad: bytes) -> int:
    return i


@pytest.mark.timeout(120)
def test_a_slow_task_does_not_hold_submits_on_other_keys(tmp_path):
    # KeyedExecutor over a 1 MiB task channel: one task on key "slow" runs until the test
    # lets it go (20 s at most), and now and then a task on "slow" waits behind it.
    # Submitting 30 000 tasks on other keys used to block until the slow task gave up.
    flag = tmp_path / "go"
    rng = random.Random(5)
    with shmchan.KeyedExecutor(max_workers=2, capacity=1 << 20) as ex:
        slow = ex.submit(wait_for_flag, str(flag), keys=("slow",))
        futures = []
        for i in range(30_000):
            key = "slow" if rng.random() < 1 / 200 else f"k{i}"
            futures.append(ex.submit(identity, i, bytes(400), keys=(key,)))
        assert not slow.done()  # every submit returned while the slow task still ran
        flag.touch()
        assert slow.result(timeout=WAIT) == "slow"
        assert [f.result(timeout=WAIT) for f in futures] == list(range(30_000))


def test_a_refused_send_gets_a_look_at_the_next_poll(make_channel):
    # After a look for space that found nothing to gain, the receiver waits for records
    # to finish (or 50 ms) before it looks again: walking a long backlog on every poll
    # would cost too much. A sender the ring refuses cuts that wait short: the very next
    # poll looks, and here finds room (the handles released meanwhile freed 48 KB behind
    # a dead letter, a held handle and 100 messages parked behind it).
    ch = make_channel(capacity=64 << 10, max_attempts=1)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"x" * 1000, keys=("x",))
    rx.recv(timeout=WAIT).nack()  # a dead letter at head
    tx.send(b"k", keys=("a",))
    held = rx.recv(timeout=WAIT)
    for _ in range(100):
        tx.send(bytes(24), keys=("a",))  # parked behind the held key
    assert rx.try_recv() is None
    bigs = []
    with pytest.raises(shmchan.Full):
        while True:  # handles held until the ring is full
            tx.send(bytes(3000), keys=(f"b{len(bigs)}",), timeout=0)
            bigs.append(rx.recv(timeout=WAIT))
    time.sleep(0.1)  # whatever the receiver did before, its next look is due now
    assert rx.try_recv() is None  # it looks, finds only live records, and waits
    for h in bigs[:-1]:
        h.release()  # 48 KB free behind the head, too few records for another look
    with pytest.raises(shmchan.Full):
        tx.send(bytes(3000), keys=("new",), timeout=0)
    assert rx.try_recv() is None  # one poll
    tx.send(bytes(3000), keys=("new",), timeout=0)
    assert held.keys == ("a",) and ch.stats().queued == 101


def _send_most_of_the_ring_past_one_small_handle_held_at_head(make_channel, asleep):
    """One small handle held at head, then 100 000 messages received and released: 43 % of
    the 8 MiB ring is finished space behind head, the rest free, and nothing else is live.
    A message of 90 % of the ring fits once the held record is slid out of the way, which
    takes several slides (one frees an eighth of the ring at most). The receiver waits in
    recv meanwhile (asleep: the send starts once it has had time to fall asleep)."""
    capacity = 8 << 20
    ch = make_channel(capacity=capacity)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"A", keys="k")
    a = rx.recv(timeout=WAIT)
    for _ in range(100):
        tx.send_many([(bytes(200), ())] * 1000, timeout=WAIT)
        rx.release_many(rx.recv_many(1000, timeout=WAIT))
    while True:
        try:
            rx.release_many(rx.recv_many(1000, timeout=0))
        except shmchan.Empty:
            break
    st = ch.stats()
    assert (st.queued, st.inflight) == (0, 1)
    assert capacity // 3 < st.used_bytes < capacity // 2
    settle = 0.2 if asleep else 0.0
    send_to_a_waiting_receiver(ch, tx, rx, bytes(capacity * 9 // 10), timeout=10, settle=settle)
    a.release()
    tx.close()
    rx.close()


@pytest.mark.timeout(120)
def test_a_message_larger_than_half_the_ring_goes_past_one_small_handle_held_at_head(
    make_channel,
):
    # The receiver must not skip the slides because the ring is less than half used.
    _send_most_of_the_ring_past_one_small_handle_held_at_head(make_channel, asleep=False)


@pytest.mark.timeout(120)
def test_a_waiting_sender_gets_every_slide_it_needs_without_waiting_for_upkeep(
    make_channel, monkeypatch
):
    # The receiver, asleep in recv, owes the sender waiting every slide it needs, not one
    # per wake-up: the sender, refused again, wakes nobody. With the upkeep period (the
    # longest sleep of the receiver and of a sender) longer than the send's timeout, a
    # receiver that slides once and sleeps leaves the sender refused until its timeout.
    from shmchan import _segment

    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 60.0)
    _send_most_of_the_ring_past_one_small_handle_held_at_head(make_channel, asleep=True)
