"""Shared memory follows traffic: a channel's /dev/shm use is its fixed part plus what its
traffic used, running out of /dev/shm is Full (never a SIGBUS, never a lost message), and
every default fits a container's 64 MiB /dev/shm.

The running-out tests mount a small tmpfs on /dev/shm in a private mount namespace
(`unshare -m`, which needs root or CAP_SYS_ADMIN); where that is not permitted they are
skipped with the reason.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

import shmchan
from shmchan import liveness
from tests.procs import child_env, kill_at_pause, layout_fact, take_receiver_seat

MiB = 1 << 20
DEV_SHM = "/dev/shm"


def allocated(name: str) -> int:
    """Bytes the filesystem holds for a channel's segment (its allocated blocks)."""
    return os.stat(os.path.join(DEV_SHM, f"shmchan.{name}")).st_blocks * 512


# ---- footprint ---------------------------------------------------------------------------


def test_an_idle_default_channel_holds_at_most_2_mib(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name)  # every default: a 64 MiB capacity
    try:
        assert ch.capacity == 64 * MiB
        assert allocated(chan_name) <= 2 * MiB
        st = ch.stats()
        assert 0 < st.committed_bytes <= 2 * MiB
        # the receiver's seat and a first message do not change that
        tx, rx = ch.sender(), ch.receiver()
        tx.send(b"x" * 100, keys=("a",))
        rx.recv(timeout=5).release()
        assert allocated(chan_name) <= 2 * MiB
    finally:
        ch.close()


def test_a_burst_of_n_bytes_holds_at_most_1_1_n_plus_2_mib(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name)
    try:
        tx, rx = ch.sender(), ch.receiver()
        sent = 0
        for i in range(6000):  # about 24 MiB queued, in records of 4 KiB and some keys
            tx.send(bytes([i & 0xFF]) * 4000, keys=(f"k{i % 97}", i))
            sent += 1
        queued = ch.stats().used_bytes
        assert 20 * MiB < queued < 30 * MiB
        held = allocated(chan_name)
        assert held <= 1.1 * queued + 2 * MiB, (held, queued)
        # the committed figure is what the filesystem holds
        assert abs(ch.stats().committed_bytes - held) <= 64 << 10
        got = 0
        while (h := rx.try_recv()) is not None:
            assert h.data == bytes([h.seq - 1 & 0xFF]) * 4000
            h.release()
            got += 1
        assert got == sent
        # a second burst of the same size reuses what the first committed (the ring rewinds)
        for _i in range(6000):
            tx.send(b"y" * 4000)
        while (h := rx.try_recv()) is not None:
            h.release()
        assert allocated(chan_name) <= held + 2 * MiB
    finally:
        ch.close()


def test_an_idle_keyed_executor_holds_at_most_4_mib() -> None:
    before = set(os.listdir(DEV_SHM))
    with shmchan.KeyedExecutor(max_workers=2) as ex:
        assert ex.submit(sum, (1, 2, 3), keys=("a",)).result(timeout=60) == 6
        ours = f"shmchan.kx-{liveness.current_token():x}-"  # this process's executors
        mine = [n for n in set(os.listdir(DEV_SHM)) - before if n.startswith(ours)]
        assert len(mine) == 2, mine  # its task and result channels
        total = sum(os.stat(os.path.join(DEV_SHM, n)).st_blocks * 512 for n in mine)
        assert total <= 4 * MiB, total


def _numbers_received(rx: shmchan.Receiver, n: int) -> list[int]:
    """The numbers n messages carry, as received (each released at once); within 60 s."""
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        for h in rx.recv_many(64, timeout=1):
            seen.append(struct.unpack_from("<I", h.data)[0])
            h.release()
    return seen


def _tables_and_ring(name: str) -> tuple[int, int]:
    """(bytes of the tables committed, bytes of the ring committed), by the header's marks."""
    with open(os.path.join(DEV_SHM, f"shmchan.{name}"), "rb") as f:

        def mark(fact: str, width: int) -> int:
            return int.from_bytes(os.pread(f.fileno(), width, layout_fact(fact)), "little")

        s, n, k = (mark(f"header.{t}_committed", 4) for t in ("slots", "nodes", "keys"))
        ring = mark("header.ring_committed", 8)
    pages = lambda b: -(-b // 4096) * 4096  # noqa: E731
    slot, node, key = (layout_fact(f"{t}.size") for t in ("slot", "node", "key"))
    return pages(s * slot) + pages(s * 16) + pages(n * node) + pages(k * key), ring


# What the tables hold for each message taken in (ready or in flight): its slot, its ready
# heap entry, a node per key, and two to four key table entries per key (the table doubles
# when half full). A 1-key message thus costs 248 to 344 bytes of tables, whatever its size:
# the tables are within a tenth of the ring only for records of about 3.4 KiB and more.
PER_MESSAGE_1KEY = 112 + 16 + 24 + 4 * 48


@pytest.mark.parametrize("payload", [16, 4000])
def test_the_tables_cost_a_tenth_of_the_ring_idle_and_a_fixed_amount_per_message(
    chan_name: str, payload: int
) -> None:
    ch = shmchan.Channel.create(chan_name)
    try:
        tx, rx = ch.sender(), ch.receiver()
        tables, ring = _tables_and_ring(chan_name)
        assert tables <= ring // 10, f"idle: {tables} bytes of tables for {ring} of ring"
        held = []
        for i in range(3000):
            tx.send(b"x" * payload, keys=(i,))
            held.extend(iter(rx.try_recv, None))
        held.extend(iter(rx.try_recv, None))
        assert len(held) == 3000
        tables, ring = _tables_and_ring(chan_name)
        first = 64 << 10  # the first chunks, committed at create
        assert tables <= first + 1.15 * len(held) * PER_MESSAGE_1KEY, tables
        if payload >= 4000:
            assert tables <= ring // 10, f"{tables} bytes of tables for {ring} of ring"
        for h in held:
            h.release()
    finally:
        ch.close()


def _keys_for(kind: str, i: int) -> tuple[str, ...]:
    if kind == "one key":
        return ("k",)
    if kind == "distinct keys":
        return (f"u{i}",)
    if kind == "hot key backlog":
        return ("hot",)
    return ("hot", f"u{i}")  # waiting on a hot key, each bringing a new key


@pytest.mark.parametrize(
    "kind", ["one key", "distinct keys", "hot key backlog", "hot key and new keys"]
)
def test_the_tables_stay_within_a_tenth_of_the_committed_ring_at_every_fill(
    make_channel: Any, kind: str
) -> None:
    # Small records (64 bytes, one key) queued up to several fills, the receiver polling
    # as they come (taking in, parking) but holding at most the hot key's handle: the
    # tables' committed bytes stay within a tenth of the ring's (invariant B, budget.c).
    capacity = 16 * MiB
    ch = make_channel(capacity=capacity)
    tx, rx = ch.sender(), ch.receiver()
    held = []
    if kind.startswith("hot"):
        tx.send(b"h", keys=("hot",))
        held.append(rx.recv(timeout=5))
    sent, shares = 0, []
    for fill in (0.002, 0.03, 0.2, 0.6):
        while ch.stats().used_bytes < fill * capacity:
            batch = [(b"x" * 64, _keys_for(kind, sent + j)) for j in range(500)]
            tx.send_many(batch, timeout=10)
            sent += len(batch)
            h = rx.try_recv()  # a poll: the receiver looks at what came
            if h is not None:
                h.release()
        tables, ring = _tables_and_ring(ch.name)
        st = ch.stats()
        assert (st.table_bytes, st.ring_committed_bytes) == (tables, ring)  # stats agree
        shares.append((fill, tables, ring))
        # Also a backlog that brings a new key per message: parking stops at the budget,
        # and what lies beyond is left in the ring (a free message there is found by the
        # look-ahead, csrc/lookahead.c).
        assert tables <= ring // 10, f"{kind} at {fill:.0%}: {tables} B, {ring} B of ring"
    # Nothing is lost or reordered by the receiver leaving records in the ring.
    for h in held:
        h.release()
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        try:
            rx.recv(timeout=1).release()  # one handle at a time: the tables hold no more
        except shmchan.Empty:
            break
    st = ch.stats()
    assert st.queued == 0 and st.released == st.sent, (st, shares)
    # Drained and idle, the ring gives memory back, and the node and key tables with it.
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=2.0)
    tables, ring = _tables_and_ring(ch.name)
    assert ring <= 2 * MiB and tables <= ring // 10, f"{kind}, drained: {tables} B, {ring} B"


def test_a_consumer_holding_many_small_handles_gets_every_one(make_channel: Any) -> None:
    # The budget never refuses a recv: a message free to go is handed out even when the
    # handles held make the tables pass their tenth of the ring (budget.c: live handles).
    ch = make_channel(capacity=16 * MiB)
    tx, rx = ch.sender(), ch.receiver()
    n = 5000
    tx.send_many([(b"x" * 64, (f"u{i}",)) for i in range(n)], timeout=10)
    held = rx.recv_many(n, timeout=5)
    while len(held) < n:
        held += rx.recv_many(n, timeout=5)
    tables, ring = _tables_and_ring(ch.name)
    assert tables > ring // 10  # the cost of the handles held, which the budget allows
    for h in held:
        h.release()
    assert ch.stats().inflight == 0


def test_the_key_table_grows_with_the_keys_in_use(make_channel: Any) -> None:
    # Many distinct keys waiting at once (parked behind one held key) make the key table
    # grow past its first size; the order on every key is kept through the growth. The
    # padding makes the ring commit enough for the tables' budget (a tenth of it) to
    # allow the growth.
    ch = make_channel(capacity=64 * MiB)
    tx, rx = ch.sender(), ch.receiver()
    seg = os.open(os.path.join(DEV_SHM, f"shmchan.{ch.name}"), os.O_RDONLY)
    at = layout_fact("header.keys_active")

    def table_size() -> int:
        return int.from_bytes(os.pread(seg, 4, at), "little")

    first = table_size()
    tx.send(b"hot", keys=("hot",))
    hot = rx.recv(timeout=5)
    n = 6000
    for i in range(n):
        tx.send(struct.pack("<I", i) + bytes(400), keys=("hot", f"u{i}", f"v{i % 300}"))
    assert rx.try_recv() is None  # all of them wait for "hot"
    grown = table_size()
    os.close(seg)
    assert grown >= 4 * first  # the table took more room as the keys came
    hot.release()
    assert _numbers_received(rx, n) == list(range(n))  # all share "hot": strictly in order
    assert ch.stats().held_keys == 0


# ---- running out, for real, in a private mount namespace ---------------------------------


def _namespace_run(
    tmpfs_size: str, script: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run `python -c script` with a tmpfs of tmpfs_size on /dev/shm in a private mount
    namespace; skip the test if this machine does not permit that."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with a tmpfs here: {probe.stderr.strip()}")
    return subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount -t tmpfs -o size={tmpfs_size} tmpfs /dev/shm && exec "$0" -c "$1"',
            sys.executable,
            textwrap.dedent(script),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


_RUN_OUT = """
    import multiprocessing as mp, os, signal, struct, sys, time, zlib
    import shmchan

    def body(me, n):
        head = struct.pack("<II", me, n)
        return head + bytes(((me * 7 + n + j) & 0xFF) for j in range(8184))

    def produce(me, q):
        tx = shmchan.Sender.open("runout")
        n = 0
        while True:
            try:
                tx.send(body(me, n), keys=(f"k{n % 5}",), timeout=0.5)
            except shmchan.Full as e:
                q.put((me, n, str(e)))
                return
            n += 1

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        ch = shmchan.Channel.create("runout", capacity=32 << 20)  # 8 times the tmpfs
        q = ctx.Queue()
        procs = [ctx.Process(target=produce, args=(me, q)) for me in range(3)]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        codes = [p.exitcode for p in procs]
        print("producer exit codes", codes)
        assert codes == [0, 0, 0], codes
        accepted = {me: n for me, n, _ in results}
        print("accepted", accepted)
        msg = results[0][2]
        print("FULL:", msg)
        assert "out of space" in msg and "/dev/shm is 4.0 MiB" in msg, msg
        assert "--shm-size" in msg and "capacity=" in msg, msg
        assert sum(accepted.values()) * 8192 > 2 << 20  # it got near the limit first
        st = ch.stats()
        assert st.committed_bytes <= 4 << 20
        # the receiver delivers every accepted message, intact and in each producer's order
        rx = ch.receiver()
        nexts = {me: 0 for me in accepted}
        while True:
            try:
                h = rx.recv(timeout=1)
            except shmchan.Empty:
                break
            me, n = struct.unpack_from("<II", h.data)
            assert bytes(h.data) == body(me, n), (me, n)
            assert n == nexts[me], (me, n, nexts[me])
            nexts[me] = n + 1
            h.release()
        assert nexts == accepted, (nexts, accepted)
        # once drained, the same memory carries more: the ring starts over at its start
        tx = ch.sender()
        for n in range(2000):
            tx.send(body(9, n), timeout=10)
            h = rx.recv(timeout=10)
            assert bytes(h.data) == body(9, n)
            h.release()
        print("ok")
"""


@pytest.mark.timeout(180)
def test_running_out_of_dev_shm_is_full_and_loses_nothing() -> None:
    r = _namespace_run("4m", _RUN_OUT, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr  # -SIGBUS (or 135) would be a crash
    assert "ok" in r.stdout.splitlines(), r.stdout + r.stderr


_CREATE_TOO_BIG = """
    import shmchan
    try:
        shmchan.Channel.create("big", capacity=1 << 30, max_messages=1 << 22, max_producers=65536)
    except shmchan.ResourceError as e:
        print("ERR:", e)
    ch = shmchan.Channel.create("fits", capacity=1 << 30)  # larger than the tmpfs: allowed
    print("created", ch.capacity)
    ch.unlink()
"""


@pytest.mark.timeout(60)
def test_a_channel_whose_fixed_part_does_not_fit_says_what_to_do() -> None:
    r = _namespace_run("2m", _CREATE_TOO_BIG, timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr
    err = [line for line in r.stdout.splitlines() if line.startswith("ERR:")]
    assert err, r.stdout
    assert "/dev/shm is 2.0 MiB" in err[0] and "--shm-size" in err[0], err[0]
    assert "created 1073741824" in r.stdout


# Each a program of its own, run side by side in one 64 MiB /dev/shm.
_DEFAULTS_JOB = """
import shmchan, time
chans = [shmchan.Channel.create(f"dflt{i}") for i in range(3)]
tx, rx = chans[0].sender(), chans[0].receiver()
for i in range(1000):
    tx.send(b"m" * 1000, keys=(i % 10,))
for i in range(1000):
    rx.recv(timeout=10).release()
time.sleep(2)
for c in chans:
    c.unlink()
"""

_EXECUTORS_JOB = """
import shmchan, threading

def task(blob, i):
    return len(blob) + i

def run(k, out):
    with shmchan.KeyedExecutor(max_workers=8) as ex:
        futs = [ex.submit(task, bytes(1 << 20), i, keys=(f"k{i % 4}",)) for i in range(24)]
        out[k] = [f.result(timeout=150) for f in futs]

if __name__ == "__main__":
    out = {}
    ts = [threading.Thread(target=run, args=(k, out)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert all(out.get(k) == [(1 << 20) + i for i in range(24)] for k in range(4)), sorted(out)
"""

_POOL_JOB = """
import shmchan, time

def handler(payload, keys):
    pass

if __name__ == "__main__":
    ch = shmchan.Channel.create("poolch")
    with shmchan.KeyedPool("poolch", handler, processes=2):
        tx = ch.sender()
        for i in range(500):
            tx.send(b"p" * 2000, keys=(i % 7,), timeout=30)
        deadline = time.monotonic() + 90
        while ch.stats().released < 500 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ch.stats().released == 500, ch.stats()
    ch.unlink()
"""

_EXCHANGE_JOB = """
import shmchan
chans = [shmchan.Channel.create(f"ex{i}") for i in range(3)]
ex = shmchan.Exchange.create("fan", kind="fanout")
for i in range(3):
    ex.bind(f"ex{i}")
for i in range(300):
    ex.publish(b"e" * 4000, keys=(i % 3,), timeout=30)
for c in chans:
    rx = c.receiver()
    for i in range(300):
        rx.recv(timeout=10).release()
    c.unlink()
ex.unlink()
"""

_SIDE_BY_SIDE_DRIVER = """
import os, subprocess, sys, tempfile
py = sys.executable
here = tempfile.mkdtemp()  # scripts as files: spawned workers import their functions

def script(name, text):
    path = os.path.join(here, name + ".py")
    with open(path, "w") as f:
        f.write(text)
    return [py, path]

jobs = {
    "demo": [py, "-m", "shmchan", "demo", "--messages", "2000"],
    "quickstart": [py, "examples/quickstart.py"],
    "orders": [py, "examples/orders.py"],
    "defaults": script("defaults", DEFAULTS),
    "executors": script("executors", EXECUTORS),
    "pool": script("pool", POOL),
    "exchange": script("exchange", EXCHANGE),
}
procs = {k: subprocess.Popen(v, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
         for k, v in jobs.items()}
failed = []
for k, p in procs.items():
    try:
        out, _ = p.communicate(timeout=220)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        failed.append(k)
        print(f"--- {k} timed out\\n{out[-3000:]}")
        continue
    if p.returncode != 0:
        failed.append(k)
        print(f"--- {k} exited {p.returncode}\\n{out[-3000:]}")
print("failed:", failed)
print("left in /dev/shm:", sorted(os.listdir("/dev/shm")))
import shutil
shutil.rmtree(here)
"""
_SIDE_BY_SIDE = (
    "".join(
        f"{var} = {text!r}\n"
        for var, text in [
            ("DEFAULTS", _DEFAULTS_JOB),
            ("EXECUTORS", _EXECUTORS_JOB),
            ("POOL", _POOL_JOB),
            ("EXCHANGE", _EXCHANGE_JOB),
        ]
    )
    + _SIDE_BY_SIDE_DRIVER
)


@pytest.mark.timeout(300)
def test_every_default_fits_a_64_mib_dev_shm_side_by_side() -> None:
    r = _namespace_run("64m", _SIDE_BY_SIDE, timeout=270)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed: []" in r.stdout, r.stdout + r.stderr


# ---- crash safety --------------------------------------------------------------------------


_COMMIT_VICTIM = """
    import os, sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tx = shmchan.Sender.open(name)
    lib.shm_test_pause_at(lib.SHM_PAUSE_RING_COMMIT, notify, wait)
    for i in range(100000):  # past the ring's first committed part: a commit pauses us
        tx.send(i.to_bytes(4, "little") * 256, timeout=5)
"""


@pytest.mark.timeout(120)
def test_a_producer_killed_while_committing_a_chunk_stops_nobody(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=64 * MiB)
    try:
        # killed between its fallocate and raising the mark
        kill_at_pause(_COMMIT_VICTIM, chan_name, "a ring commit")
        # another producer goes on through the same chunk, and everything arrives whole
        tx, rx = ch.sender(), ch.receiver()
        for _i in range(2000):
            tx.send(b"z" * 1024, timeout=5)
        theirs = ours = 0
        while (h := rx.try_recv()) is not None:
            if h.data == b"z" * 1024:
                ours += 1
            else:
                assert h.data == theirs.to_bytes(4, "little") * 256
                theirs += 1
            h.release()
        assert ours == 2000
        assert theirs * 1048 > 256 << 10  # it had filled the first committed part
        assert allocated(chan_name) <= 10 * MiB
    finally:
        ch.close()


_GROW_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    lib.shm_test_pause_at(lib.SHM_PAUSE_KEY_GROW, notify, wait)
    held = rx.recv(timeout=10)  # "hot": everything after it parks, and the table grows
    while True:
        rx.try_recv()
"""


@pytest.mark.timeout(120)
def test_a_receiver_killed_while_the_key_table_grows_loses_nothing(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=64 * MiB)
    try:
        tx = ch.sender()
        tx.send(b"hot", keys=("hot",))
        n = 4000
        for i in range(n):
            tx.send(struct.pack("<I", i), keys=("hot", f"u{i}"))
        # killed half way through the rehash
        kill_at_pause(_GROW_VICTIM, chan_name, "the key table's growth")
        rx = take_receiver_seat(ch)
        # first: handed out again if its holder had it (the growth may come before that)
        hot = rx.recv(timeout=10)
        assert bytes(hot.data) == b"hot" and hot.attempt in (1, 2)
        hot.release()
        assert _numbers_received(rx, n) == list(range(n))
    finally:
        ch.close()


_SMALL_GROW_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    lib.shm_test_pause_at(lib.SHM_PAUSE_KEY_GROW, notify, wait)
    while True:  # its first poll takes messages in, and the 16-entry table grows
        h = rx.try_recv()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_receiver_killed_while_a_small_key_table_grows_loses_nothing(
    chan_name: str, order: str
) -> None:
    # A channel whose key table starts at 16 entries (a test-only setting): its receiver's
    # first poll takes in messages holding keys and parks others on key chains, the table
    # grows, and the receiver is killed half way through the rehash. The next receiver
    # rebuilds the table and hands out every message once, keys and order kept.
    from shmchan._lib import lib
    from tests.procs import check_core

    assert lib.shm_test_keytab_first(16) == 0
    try:
        ch = shmchan.Channel.create(chan_name, capacity=4 * MiB, order=order)
    finally:
        assert lib.shm_test_keytab_first(0) == 0
    at = layout_fact("header.keys_active")
    with open(os.path.join(DEV_SHM, f"shmchan.{ch.name}"), "rb") as seg:
        assert int.from_bytes(os.pread(seg.fileno(), 4, at), "little") == 16
    try:
        tx = ch.sender()
        tx.send(-1, keys=("hot",))
        n = 600  # evens wait behind "hot", odds go at once: both kinds of entries grow
        for i in range(n):
            tx.send(i, keys=("hot", f"u{i}") if i % 2 == 0 else (f"u{i}",))
        kill_at_pause(_SMALL_GROW_VICTIM, chan_name, "the key table's growth")
        rx = take_receiver_seat(ch)
        check_core(rx)
        got: list[int] = []
        hot = None
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            for h in rx.recv_many(64, timeout=0.5):
                if h.payload == -1:
                    hot = h  # held until every odd one is out: evens wait for it
                else:
                    got.append(h.payload)
                    h.release()
            if hot is not None and len(got) == n // 2:
                hot.release()
        check_core(rx)
        assert hot is not None and sorted(got) == list(range(n))
        assert got[: n // 2] == list(range(1, n, 2))  # the odds went while "hot" was held
        assert got[n // 2 :] == list(range(0, n, 2))  # the evens, in line behind "hot"
        with open(os.path.join(DEV_SHM, f"shmchan.{ch.name}"), "rb") as seg:
            assert int.from_bytes(os.pread(seg.fileno(), 4, at), "little") >= 512
        assert ch.stats().held_keys == 0
    finally:
        ch.close()


# ---- the committed figure in `stat` ---------------------------------------------------------


def test_stat_reports_committed_bytes_as_text_json_and_prometheus(chan_name: str) -> None:
    import json

    from tests.procs import run_shmchan

    ch = shmchan.Channel.create(chan_name)
    try:
        tx = ch.sender()
        for _ in range(3000):  # about 3 MiB: past the ring's first committed part
            tx.send(b"c" * 1000)
        held = allocated(chan_name)
        js = run_shmchan("stat", chan_name, "--json", timeout=60)
        assert js.returncode == 0, js
        committed = json.loads(js.stdout)["stats"]["committed_bytes"]
        assert 3 * MiB < committed <= held + (64 << 10)
        text = run_shmchan("stat", chan_name, timeout=60)
        assert re.search(rf"^committed_bytes\s+{committed} \(", text.stdout, re.M), text.stdout
        prom = run_shmchan("stat", chan_name, "--prometheus", timeout=60)
        found = re.search(
            rf'^shmchan_committed_bytes{{channel="{chan_name}"}} (\S+)$', prom.stdout, re.M
        )
        assert found and float(found.group(1)) == committed, prom.stdout
    finally:
        ch.close()


# ---- giving memory back -------------------------------------------------------------------


def _burst(tx: shmchan.Sender, n: int) -> None:
    for i in range(n):
        tx.send(struct.pack("<I", i) + b"g" * 996, keys=(i % 100,), timeout=10)


def test_a_drained_ring_gives_its_memory_back_after_a_second_idle(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name)
    try:
        tx, rx = ch.sender(), ch.receiver()
        for _round in range(2):
            _burst(tx, 20000)  # about 20 MiB queued
            assert allocated(chan_name) > 20 * MiB
            assert sorted(_numbers_received(rx, 20000)) == list(range(20000))
            with pytest.raises(shmchan.Empty):
                rx.recv(timeout=2.0)  # idle: its polls give the memory back after 1 s
            assert allocated(chan_name) <= 2 * MiB
            assert ch.stats().committed_bytes <= 2 * MiB
    finally:
        ch.close()


_GIVE_BACK_VICTIM = """
    import sys, time
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    while (h := rx.try_recv()) is not None:
        h.release()
    lib.shm_test_pause_at(lib.SHM_PAUSE_GIVE_BACK, notify, wait)
    while True:
        try:
            rx.recv(timeout=0.2)
        except shmchan.Empty:
            pass
"""


@pytest.mark.timeout(120)
def test_a_receiver_killed_while_giving_memory_back_stops_nobody(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name)
    try:
        tx = ch.sender()
        _burst(tx, 12000)
        # the receiver drains, idles, and is killed holding the tail, memory given back
        kill_at_pause(_GIVE_BACK_VICTIM, chan_name, "a give-back")
        assert allocated(chan_name) <= 2 * MiB
        # a producer steps over the dead receiver's claim; a new receiver gets it all
        _burst(tx, 12000)
        rx = take_receiver_seat(ch)
        assert _numbers_received(rx, 12000) == list(range(12000))
        assert rx.try_recv() is None
    finally:
        ch.close()
