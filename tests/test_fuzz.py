"""Bad bytes in the segment (the failure model).

For each seed: a child process creates a channel, sends, receives, releases, nacks and
holds messages, and dies without cleaning up; random bytes are then written over random
parts of the segment file (header, producer registry, message table, key nodes, key
table, ring records); then a consumer child attaches and works the channel (open,
receiver, recv / try_recv / recv_many, payloads and keys, releases, nacks, dead letters,
stats, a few sends with a timeout). It must end with success or an exception the API
documents for this (a shmchan.Error, ChannelCorrupted above all, or a ValueError) and never
die by a signal or hang.

The seeds run in one worker interpreter (this file run as a script) that forks a child
per phase, so 150 of them take seconds; the worker prints one JSON line per seed. The same
worker runs against a copy of the C core built with AddressSanitizer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
SEEDS = list(range(200))
SEED_SECONDS = 10.0  # a consumer still running after this long is hung
MAX_FAILURES = 3  # stop a run after this many bad seeds (each may cost SEED_SECONDS)

# --- the segment's layout (csrc/core.h, LP64) ---------------------------------------------
# Used only to aim the scribbles at live structures; the worker checks the header against
# the file (magic, sizes, page-aligned increasing offsets) before trusting any of it.
MAGIC = 0x314E414843485353


def _fact(name: str) -> int:
    """Where a field lives, from the C core itself (csrc/segment.c shm_layout_fact)."""
    from shmchan._lib import ffi, lib

    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


H_MAX_PRODUCERS_OFF = _fact("header.max_producers")
H_MAX_MESSAGES = _fact("header.max_messages")
H_REGIONS = (
    _fact("header.slots_off") - 8
)  # producers_off, slots_off, nodes_off, keytab_off, ring_off
H_MAX_NODES, H_KEYTAB_SIZE = _fact("header.max_nodes"), _fact("header.keytab_size")
H_SEGMENT_SIZE = _fact("header.segment_size")
H_HEAD, H_INGEST = _fact("header.head"), _fact("header.ingest_pos")
H_READY_COUNT = _fact("header.ready_count")
# every header word a process may read, whatever the layout: all 4- and 8-byte words
_HEADER_SIZE = _fact("header.size")
HEADER_WORDS = [(o, 4) for o in range(0, _HEADER_SIZE, 4)] + [
    (o, 8) for o in range(0, _HEADER_SIZE, 8)
]
PRODUCER_SIZE, PRODUCER_WORDS = 64, [(0, 8), (8, 8), (16, 4)]
SLOT_SIZE = _fact("slot.size")
SLOT_WORDS = (
    [(0, 1)] + [(o, 4) for o in range(0, SLOT_SIZE, 4)] + [(o, 8) for o in range(0, SLOT_SIZE, 8)]
)
NODE_SIZE = _fact("node.size")
NODE_WORDS = [(o, 4) for o in range(0, NODE_SIZE, 4)] + [(0, 8)]
KEY_SIZE = _fact("key.size")
KEY_WORDS = [(o, 4) for o in range(0, KEY_SIZE, 4)] + [(0, 8)]
KEY_TAIL = _fact("key.tail")
RECORD_KIND = _fact("record.kind")
RECORD_WORDS = [(0, 8), (8, 8), (8, 1), (16, 8), (24, 4), (28, 4), (32, 8), (40, 4), (44, 4),
                (48, 8)]  # fmt: skip


# =========================================================================================
# the worker (this file run as a script; imports shmchan, never pytest)
# =========================================================================================

KEY_POOL = ["a", "b", "c", b"d", 5, 2**70]


def setup_channel(name: str, rng: random.Random) -> None:
    """In a forked child: make and use a channel, then die holding what it holds."""
    import shmchan

    ch = shmchan.Channel.create(
        name,
        capacity=rng.choice([4096, 16 << 10, 64 << 10]),
        order=rng.choice(["fifo", "eager"]),
        max_keys=4,
        max_messages=rng.choice([16, 32, 64]),
        max_attempts=rng.choice([None, 1, 2]),
        serializer="raw",
        max_producers=4,
    )
    tx = ch.sender()
    for _ in range(rng.randint(1, 40)):
        keys = rng.sample(KEY_POOL, rng.randint(0, 3))
        try:
            tx.send(rng.randbytes(rng.choice([0, 8, 100, 700])), keys=keys, timeout=0)
        except shmchan.Full:
            break
    held = []
    if rng.random() < 0.8:
        rx = ch.receiver()
        for _ in range(rng.randint(0, 30)):
            h = rx.try_recv()
            if h is None:
                break
            if rng.random() < 0.3:
                h.data  # a zero-copy view pins the record  # noqa: B018
            what = rng.random()
            if what < 0.4:
                h.release()
            elif what < 0.6:
                h.nack()
            else:
                held.append(h)
        if rng.random() < 0.3:
            rx.close()
    if rng.random() < 0.5:  # some sends the receiver has not looked at yet
        for _ in range(rng.randint(1, 5)):
            try:
                tx.send(rng.randbytes(rng.randint(0, 300)), keys=rng.sample(KEY_POOL, 1), timeout=0)
            except shmchan.Full:
                break
    # run_child ends this process with os._exit: held handles, the receiver seat and the
    # producer registration stay as a killed process leaves them.
    _KEEP.extend([ch, tx, held])


_KEEP: list = []


class Layout:
    """Where the live structures of a segment file are, read from its header."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        h = os.pread(fd, 4096, 0)

        def u(off: int, n: int) -> int:
            return int.from_bytes(h[off : off + n], "little")

        self.regions = [u(H_REGIONS + 8 * i, 8) for i in range(5)]
        self.max_producers = u(H_MAX_PRODUCERS_OFF, 4)
        self.max_messages = u(H_MAX_MESSAGES, 4)
        self.max_nodes = u(H_MAX_NODES, 4)
        self.keytab_size = u(H_KEYTAB_SIZE, 4)
        self.size = size
        self.capacity = size - self.regions[4]
        self.head, self.ingest = u(H_HEAD, 8), u(H_INGEST, 8)
        bounds = [*self.regions, size]
        if (
            u(0, 8) != MAGIC
            or u(H_SEGMENT_SIZE, 8) != size
            or bounds[0] < 4096
            or any(b % 4096 or b >= c for b, c in zip(bounds, bounds[1:], strict=False))
        ):
            raise SystemExit("harness: segment header does not match tests/test_fuzz.py's layout")
        self.records = self._walk(fd)

    def _walk(self, fd: int) -> list[int]:
        """File offsets of the ring's records from head up to the tail."""
        out, pos = [], self.head
        for _ in range(10000):
            off = self.regions[4] + pos % self.capacity
            owner = int.from_bytes(os.pread(fd, 8, off), "little")
            out.append(off)
            if owner & 1:  # the tail's EMPTY marker
                break
            length = int.from_bytes(os.pread(fd, 8, off + 8), "little") >> 8
            if length < 24 or length % 8:
                break
            pos += length
        return out


# where scribbles go; records twice: most of a segment's live bytes are there
REGIONS = ("header", "producers", "slots", "nodes", "keys", "records", "records", "anywhere")
INTERESTING = [0, 1, 2, 3, 7, 8, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63, 2**64 - 1]


def scribble(path: str, rng: random.Random) -> list[str]:
    """Write 1-4 corruptions into the segment file; returns what was done, for the report."""
    fd = os.open(path, os.O_RDWR)
    try:
        lay = Layout(fd)
        done = []
        for _ in range(rng.randint(1, 4)):
            region = rng.choice(REGIONS)
            if region == "header":
                off, n = rng.choice(HEADER_WORDS)
            elif region == "producers":
                w = rng.choice(PRODUCER_WORDS)
                off, n = (
                    lay.regions[0]
                    + rng.randrange(min(lay.max_producers, 4)) * PRODUCER_SIZE
                    + w[0],
                    w[1],
                )
            elif region == "slots":
                w = rng.choice(SLOT_WORDS)
                off, n = (
                    lay.regions[1] + rng.randrange(lay.max_messages + 1) * SLOT_SIZE + w[0],
                    w[1],
                )
            elif region == "nodes":
                w = rng.choice(NODE_WORDS)
                off, n = (
                    lay.regions[2] + rng.randrange(min(lay.max_nodes, 64)) * NODE_SIZE + w[0],
                    w[1],
                )
            elif region == "keys":
                live = [
                    i
                    for i in range(lay.keytab_size)
                    if os.pread(fd, KEY_SIZE, lay.regions[3] + i * KEY_SIZE) != bytes(KEY_SIZE)
                ]
                i = (
                    rng.choice(live)
                    if live and rng.random() < 0.8
                    else rng.randrange(lay.keytab_size)
                )
                w = rng.choice(KEY_WORDS)
                off, n = lay.regions[3] + i * KEY_SIZE + w[0], w[1]
            elif region == "records":
                rec = rng.choice(lay.records)
                if rng.random() < 0.7:
                    w = rng.choice(RECORD_WORDS)
                    off, n = rec + w[0], w[1]
                else:  # inside the body: key blob or payload
                    off, n = rec + rng.randrange(48, 256), rng.randint(1, 16)
                off = lay.regions[4] + (off - lay.regions[4]) % lay.capacity
            else:
                off, n = rng.randrange(lay.size - 64), rng.randint(1, 64)
            how = rng.random()
            if how < 0.35:
                data = rng.randbytes(n)
            elif how < 0.55:  # flip one bit
                old = os.pread(fd, n, off)
                bit = rng.randrange(8 * n)
                data = (int.from_bytes(old, "little") ^ (1 << bit)).to_bytes(n, "little")
            elif how < 0.75:  # off by a little
                old = int.from_bytes(os.pread(fd, n, off), "little")
                data = ((old + rng.choice([-2, -1, 1, 2, 64])) % (1 << (8 * n))).to_bytes(
                    n, "little"
                )
            else:
                data = (rng.choice(INTERESTING) % (1 << (8 * n))).to_bytes(n, "little")
            os.pwrite(fd, data, off)
            done.append(f"{region}@{off}:{data.hex()}")
        return done
    finally:
        os.close(fd)


def consume(name: str, rng: random.Random) -> str:
    """The consumer workload; returns "ok" or raises."""
    import shmchan

    with shmchan.Channel.open(name) as ch:
        ch.stats()
        rx = ch.receiver()
        held = []
        empties = 0
        for i in range(60):
            if i % 4 == 0:
                try:
                    batch = rx.recv_many(rng.randint(1, 8), timeout=0.01)
                except shmchan.Empty:
                    batch = []
            elif i % 4 == 1:
                try:
                    batch = [rx.recv(timeout=0.01)]
                except shmchan.Empty:
                    batch = []
            else:
                h = rx.try_recv()
                batch = [] if h is None else [h]
            if not batch:
                empties += 1
                if held:
                    held.pop(rng.randrange(len(held))).release()
                elif empties > 3:
                    break
            for h in batch:
                h.keys  # noqa: B018
                h.payload  # noqa: B018
                bytes(h.data)
                (h.seq, h.attempt)  # noqa: B018
                what = rng.random()
                if what < 0.5:
                    h.release()
                elif what < 0.6:
                    h.nack()
                else:
                    if what < 0.7:
                        h.extend(5.0)
                    held.append(h)
        for d in ch.dead_letters():
            d.discard()
        for h in held:
            h.release()
        rx.maintain()
        ch.stats()
        with ch.sender() as tx:
            for _ in range(3):
                tx.send(
                    rng.randbytes(rng.randint(0, 200)), keys=rng.sample(KEY_POOL, 2), timeout=0.02
                )
        while (h := rx.try_recv()) is not None:
            h.release()
        rx.close()
        ch.stats()
    return "ok"


def run_child(fn, *args, limit: float) -> tuple[str, str]:
    """Fork; run fn(*args) (its return value, or the exception it raised, is the outcome).

    Returns ("ok" | "error", detail), ("signal", name) or ("hang", "")."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        import faulthandler

        faulthandler.enable()  # a crash prints the Python stack that led into the core
        faulthandler.dump_traceback_later(limit - 1, exit=True)  # so does a hang
        try:
            out = "ok " + str(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the outcome is reported, not handled
            import shmchan

            cls = type(exc)
            if isinstance(exc, shmchan.Error):
                kind = "shmchan." + cls.__name__
            elif isinstance(exc, ValueError):
                kind = "ValueError"
            else:
                kind = "other"
            out = f"error {kind}: {cls.__module__}.{cls.__qualname__}: {exc}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + limit + 1
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "hang", ""
        time.sleep(0.002)
    report = b""
    while chunk := os.read(r, 4096):
        report += chunk
    os.close(r)
    if os.WIFSIGNALED(status):
        return "signal", signal.Signals(os.WTERMSIG(status)).name
    if not report:  # faulthandler's exit, or a sanitizer's
        return "hang" if os.WEXITSTATUS(
            status
        ) == 1 else "died", f"exit status {os.WEXITSTATUS(status)}"
    kind, _, detail = report.decode(errors="replace").partition(" ")
    return kind, detail


def worker(prefix: str, seeds: list[str]) -> None:
    import _shmchan_core

    import shmchan

    with open("/proc/self/maps") as maps:
        asan = "libasan" in maps.read()
    print(json.dumps({"core": _shmchan_core.__file__, "asan": asan}), flush=True)
    failures = 0
    for token in seeds:
        clean = token.startswith("c")  # "c<seed>": the same workload, segment left intact
        seed = int(token.lstrip("c"))
        rng = random.Random(seed)
        name = f"{prefix}{token}"
        result = {"seed": token}
        try:
            kind, detail = run_child(setup_channel, name, rng, limit=SEED_SECONDS)
            if (kind, detail) != ("ok", "None"):
                result.update(outcome="harness", detail=f"setup: {kind} {detail}")
            else:
                if not clean:
                    result["scribbles"] = scribble(f"/dev/shm/shmchan.{name}", rng)
                kind, detail = run_child(consume, name, rng, limit=SEED_SECONDS)
                result.update(outcome=kind, detail=detail)
        finally:
            try:
                shmchan.unlink(name)
            except shmchan.ChannelNotFound:
                pass
        print(json.dumps(result), flush=True)
        if not allowed(result, clean):
            failures += 1
            if failures >= MAX_FAILURES:
                break


def recv_all(name: str) -> str:
    import shmchan

    with shmchan.Channel.open(name) as ch, ch.receiver() as rx:
        got = []
        while True:
            try:
                h = rx.recv(timeout=0.2)
            except shmchan.Empty:
                return repr(got)
            got.append(h.payload)
            h.release()


def allowed(result: dict, clean: bool) -> bool:
    """Success, or an exception the API documents for bad bytes."""
    if result["outcome"] != "ok" and result["outcome"] != "error":
        return False
    if clean:
        return result["outcome"] == "ok"
    return result["outcome"] == "ok" or not result["detail"].startswith("other")


if __name__ == "__main__":
    if sys.argv[1] == "--recv-all":  # one consumer (recv_all) on one channel, in a child
        print(json.dumps(run_child(recv_all, sys.argv[2], limit=SEED_SECONDS)), flush=True)
    else:  # a prefix for channel names, then seeds: "N" corrupted, "cN" left intact
        worker(sys.argv[1], sys.argv[2:])
    sys.exit(0)


# =========================================================================================
# the tests
# =========================================================================================

import pytest  # noqa: E402 - the worker above must not need pytest


def run_worker(
    prefix: str, seeds: list[str], env: dict | None = None, limit: float = 100
) -> tuple[list[dict], dict, str]:
    """Run the worker on the seeds; returns (results, what it runs on, stderr)."""
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE), prefix, *seeds],
            capture_output=True,
            text=True,
            timeout=limit,
            env=env,
            cwd=str(ROOT),
        )
    finally:
        for entry in os.listdir("/dev/shm"):  # a killed worker may have left one behind
            if prefix in entry:
                os.unlink(os.path.join("/dev/shm", entry))
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"fuzz worker exited with {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}"
    )
    return lines[1:], lines[0], proc.stderr


def describe(bad: list[dict]) -> str:
    return "\n".join(
        f"seed {r['seed']}: {r['outcome']} {r.get('detail', '')[:300]} "
        f"scribbles={r.get('scribbles')}"
        for r in bad
    )


def test_corrupted_segments_raise_documented_errors_never_crash_or_hang():
    prefix = f"t{os.getpid()}_fz"
    results, _, stderr = run_worker(prefix, [str(s) for s in SEEDS])
    bad = [r for r in results if not allowed(r, clean=False)]
    assert not bad, (
        f"{len(bad)} seed(s) crashed, hung or raised an undocumented error (rerun one: "
        f"python tests/test_fuzz.py fz SEED):\n{describe(bad)}\n{stderr[-3000:]}"
    )
    assert len(results) == len(SEEDS)
    outcomes = {r["outcome"] + " " + r["detail"].split(":")[0] for r in results}
    assert any(o.startswith("error shmchan.ChannelCorrupted") for o in outcomes), (
        f"no seed was detected as corrupt: the fuzzer is not reaching the core ({outcomes})"
    )


def test_clean_runs_of_the_fuzz_workload_succeed():
    """The control: with no bytes changed, the same workload (after a dead owner) is fine."""
    prefix = f"t{os.getpid()}_fc"
    results, _, stderr = run_worker(prefix, [f"c{s}" for s in range(20)])
    bad = [r for r in results if not allowed(r, clean=True)]
    assert not bad, f"clean runs failed:\n{describe(bad)}\n{stderr[-3000:]}"


# --- the same under AddressSanitizer ----------------------------------------------------------


def _libasan() -> str:
    try:
        out = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out if os.path.isabs(out) and os.path.exists(out) else ""


@pytest.fixture(scope="module")
def asan_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C core compiled with -fsanitize=address into a temporary directory.

    Needs gcc's libasan (Debian: libasan8, installed with gcc / build-essential) and
    setuptools (cffi's compiler driver)."""
    libasan = _libasan()
    if not libasan:
        pytest.skip("gcc's libasan.so is not installed (Debian: apt-get install libasan8)")
    import importlib.util

    import cffi

    spec = importlib.util.spec_from_file_location(
        "_shmchan_build_ffi", ROOT / "csrc" / "build_ffi.py"
    )
    assert spec and spec.loader
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # for its list of sources: one place names them
    csrc = ROOT / "csrc"
    ffi = cffi.FFI()
    ffi.cdef((csrc / "shmchan.h").read_text())
    ffi.set_source(
        "_shmchan_core",
        '#include "core.h"',
        sources=[str(csrc / name) for name in build.SOURCES],
        include_dirs=[str(csrc)],
        extra_compile_args=[
            "-std=gnu11",
            "-O1",
            "-g",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
        ],
        extra_link_args=["-fsanitize=address"],
    )
    out = tmp_path_factory.mktemp("asan")
    ffi.compile(tmpdir=str(out))
    return out


@pytest.mark.timeout(300)
def test_core_under_address_sanitizer_reports_nothing(asan_core):
    """Clean and corrupted runs with the ASan build: any ASan report fails the test."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = _libasan()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(asan_core), env.get("PYTHONPATH")]))
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:exitcode=99"
    prefix = f"t{os.getpid()}_fa"
    seeds = [f"c{s}" for s in range(10)] + [str(s) for s in SEEDS[:60]]
    results, runs_on, stderr = run_worker(prefix, seeds, env=env)
    assert Path(runs_on["core"]).parent == asan_core, f"the worker imported {runs_on}"
    assert runs_on["asan"], "libasan is not loaded in the worker"
    assert "ERROR: AddressSanitizer" not in stderr, stderr[-6000:]
    bad = [r for r in results if not allowed(r, clean=r["seed"].startswith("c"))]
    assert not bad, f"under ASan:\n{describe(bad)}\n{stderr[-3000:]}"


# --- corruptions the fuzzer found, made deterministic ---------------------------------------------
# Each runs the consumer in a child process (this file as a script), so a segfault fails
# the test instead of killing pytest. Offsets: csrc/core.h on LP64 (the table at the top).


def _u(fd: int, off: int, n: int) -> int:
    return int.from_bytes(os.pread(fd, n, off), "little")


def _poke(name: str, off: int, value: int, n: int) -> None:
    fd = os.open(f"/dev/shm/shmchan.{name}", os.O_RDWR)
    try:
        assert _u(fd, 0, 8) == MAGIC, "not a segment of the layout this file knows"
        os.pwrite(fd, value.to_bytes(n, "little"), off)
    finally:
        os.close(fd)


def consume_in_child(name: str) -> tuple[str, str]:
    """recv_all(name) in a grandchild (the worker script forks it): (kind, detail)."""
    proc = subprocess.run(
        [sys.executable, str(HERE), "--recv-all", name],
        capture_output=True,
        text=True,
        timeout=SEED_SECONDS + 30,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, f"worker exited with {proc.returncode}: {proc.stderr[-3000:]}"
    kind, detail = json.loads(proc.stdout.splitlines()[-1])
    if kind not in ("ok", "error") or detail.startswith("other"):
        print(proc.stderr[-3000:])  # the crash's Python stack, from faulthandler
    return kind, detail


def _assert_reported(outcome: tuple[str, str]) -> None:
    kind, detail = outcome
    assert kind in ("ok", "error") and not detail.startswith("other"), f"{kind}: {detail}"


def test_out_of_range_ready_queue_count_is_not_followed(make_channel):
    """The ready queue's length (shm_header.ready_count) is read from the
    segment; a bad one must be reported, not used (it crashed in sched.c ready_push)."""
    ch = make_channel(capacity=64 << 10, max_messages=16, serializer="raw")
    with ch.sender() as tx:
        tx.send(b"one", keys="k")
    _poke(ch.name, H_READY_COUNT, 0x7FFFFFFF, 4)
    _assert_reported(consume_in_child(ch.name))


def test_out_of_range_key_line_tail_is_not_followed(make_channel):
    """A key's line tail (shm_key.tail) is a node index read from the segment; a bad one
    must be reported, not used (it crashed in sched.c line_append)."""
    ch = make_channel(capacity=64 << 10, max_messages=16, serializer="raw")
    tx = ch.sender()
    rx = ch.receiver()
    tx.send(b"one", keys="k")
    held = rx.recv(timeout=5)  # "k" now has a line: its key table entry is in use
    tx.send(b"two", keys="k")  # not yet taken in: taking it in appends to that line
    rx.close()  # the seat is free; `held` stays in flight
    fd = os.open(f"/dev/shm/shmchan.{ch.name}", os.O_RDONLY)
    try:
        keytab, size = _u(fd, H_REGIONS + 24, 8), _u(fd, H_KEYTAB_SIZE, 4)
        used = [i for i in range(size) if _u(fd, keytab + i * KEY_SIZE + 8, 4)]
    finally:
        os.close(fd)
    assert len(used) == 1, "expected exactly one key line"
    _poke(ch.name, keytab + used[0] * KEY_SIZE + KEY_TAIL, 0x7FFFFFFF, 4)
    _assert_reported(consume_in_child(ch.name))
    held.release()


def test_raw_channel_never_unpickles_a_record_marked_as_pickled(make_channel):
    """serializer="raw" promises that nothing is unpickled. A record whose kind word says
    PICKLE on such a channel is corrupt: it must be reported, not loaded."""
    import pickle

    ch = make_channel(capacity=64 << 10, max_messages=16, serializer="raw")
    with ch.sender() as tx:
        tx.send(pickle.dumps(("unpickled", 42)), keys="k")
    fd = os.open(f"/dev/shm/shmchan.{ch.name}", os.O_RDONLY)
    try:
        ring = _u(fd, H_REGIONS + 32, 8)
        assert _u(fd, ring + RECORD_KIND, 4) == 0, (
            "the first record is not where this test expects it"
        )
    finally:
        os.close(fd)
    _poke(ch.name, ring + RECORD_KIND, 1, 4)  # the first record's kind: SHM_PAYLOAD_PICKLE
    kind, detail = consume_in_child(ch.name)
    assert "('unpickled', 42)" not in detail, f"a raw-only channel unpickled a payload: {detail}"
    _assert_reported((kind, detail))
