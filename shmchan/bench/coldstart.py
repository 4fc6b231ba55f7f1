"""What users hit outside the warm steady state: a fresh process's first message, and the
first message after a burst (a backlog parked while the receiver sleeps
is parked_latency.py).

Every row is shmchan next to `multiprocessing.Queue` and faster-fifo (when installed). All
times are CLOCK_MONOTONIC (`time.perf_counter_ns` on Linux): one clock for every process
of the machine, so a stamp taken in the producer is compared with one taken in the consumer.

* import: a fresh interpreter (`python -c`, the page cache warm) times one import
  statement: `import shmchan`, `import multiprocessing.queues`, `import faster_fifo,
  faster_fifo_reduction` (what a producer needs to put on a queue it was handed). Bytecode
  is cached, as it is once pip has installed a package: the children write it under a
  temporary PYTHONPYCACHEPREFIX in a first, discarded round (so a PYTHONDONTWRITEBYTECODE
  environment does not time the compiler).
* first message of a fresh process: the consumer (this process) already waits in
  recv / get. A producer process is spawned (nothing inherited warm); its imports are done
  before the clock starts. The span starts when the child begins rebuilding its spawn
  arguments (a stamp pickled ahead of the transport calls the clock as it is unpickled)
  and ends when the consumer's recv / get returns the child's one 64 B message. shmchan
  attaches by name in the child's code (`Channel.open` + `sender()`, then the first
  `send`); a queue has no attach by name: it is rebuilt from the spawn arguments (inside
  the span), then the first `put` (mp.Queue's starts its feeder thread). One process per
  repetition and system; the notes split the span into its parts (medians).
* the first message after a burst: a producer sends `burst_messages` 64 B messages as fast
  as it can; the consumer takes and checks them all, then posts a semaphore ("drained") and
  calls recv / get; the producer sends one stamped ping either `burst_pause` later (5 ms:
  the consumer has gone to sleep) or as soon as it sees "drained" (it polls for it rather
  than sleeping on it, so the ping leaves a few tens of µs after the consumer went back to
  recv; the note gives the median). The figure is that ping's send -> recv: nothing is
  queued ahead of it, so it is the consumer's state after a burst, not the burst's
  queueing delay (a ping sent right behind the burst would measure how far the consumer
  lags a faster producer, which rewards a slow producer). Compare with the idle wake-up
  latency rows (latency.py: 1 ms between pings, nothing else sent). Beside the 5 ms rows,
  the floor: a bare posix_ipc semaphore ping-pong between two processes, no burst, posted
  after the same pause (a CPU left idle for milliseconds wakes slower, for everyone: on a
  virtual machine markedly so).
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import posix_ipc

import shmchan
from shmchan.bench.common import (
    FFIFO,
    MPQ,
    PAYLOAD,
    SEMAPHORE,
    SHMCHAN,
    TIMEOUT,
    BenchError,
    Sizes,
    no_gc,
    unique,
)
from shmchan.bench.endpoints import Endpoint, ShmchanEnd
from shmchan.bench.harness import Run, endpoint
from shmchan.bench.peers import QueueEnd
from shmchan.bench.producers import Job, Producers
from shmchan.bench.registry import register
from shmchan.bench.report import Result

# The first message of a fresh process: CLOCK_MONOTONIC ns when the child began rebuilding
# its spawn arguments (the queue, for the peers), when its code began, when it was attached.
COLD = struct.Struct("<qqq")
COLD_PAD = b"\0" * (PAYLOAD - COLD.size)

# One import statement per system, timed in a fresh interpreter; prints nanoseconds.
IMPORTS = {
    SHMCHAN: "import shmchan",
    MPQ: "import multiprocessing.queues",
    FFIFO: "import faster_fifo, faster_fifo_reduction",
}
_TIME_IMPORT = "import time; t = time.perf_counter_ns(); {stmt}; print(time.perf_counter_ns() - t)"


def _systems(run: Run) -> list[str]:
    return [SHMCHAN] + [s for s in (MPQ, FFIFO) if s in run.systems]


def _rotated(systems: list[str], rep: int) -> list[str]:
    """Each repetition in another order: drift of the machine hits every system alike."""
    k = rep % len(systems)
    return systems[k:] + systems[:k]


# --------------------------------------------------------------------------- import


def _import_us(system: str, env: dict[str, str]) -> float:
    """µs one fresh interpreter takes for the system's import statement."""
    code = _TIME_IMPORT.format(stmt=IMPORTS[system])
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, env=env
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{system}: `{IMPORTS[system]}` took over {TIMEOUT:g} s") from None
    if done.returncode != 0:
        raise BenchError(f"{system}: `{IMPORTS[system]}` failed:\n{done.stderr}")
    return int(done.stdout.split()[-1]) / 1e3


def _import_env(cache: str) -> dict[str, str]:
    """The children import the shmchan this process runs (installed or in place), with
    their bytecode cached under `cache` as an installed package's is (pip writes .pyc
    files), whether or not this environment sets PYTHONDONTWRITEBYTECODE."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = cache
    return env


def _run_import(run: Run, systems: list[str]) -> None:
    samples: dict[str, list[float]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="shmchan-bench-pycache-") as cache:
        env = _import_env(cache)
        for rep in range(-1, run.sizes.reps):
            for s in _rotated(systems, rep):
                us = _import_us(s, env)
                if rep >= 0:  # the first round writes the bytecode cache
                    samples[s].append(us)
            run.progress.step(f"import: rep {rep + 1}")
    for s in systems:
        run.results.append(
            Result(
                "cold_import",
                "import in a fresh interpreter",
                s,
                "us",
                False,
                samples[s],
                note=f"`{IMPORTS[s]}` timed inside `python -c`, bytecode cached",
            )
        )


# --------------------------------------------------------------------------- first message


class _Stamp:
    """Pickled into a child's spawn arguments ahead of the transport: unpickling calls the
    clock, so the child's span starts before the queue it was handed is rebuilt."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return time.perf_counter_ns, ()


def _first_message_child(system: str, t0: int, transport: Any, conn: Connection) -> None:
    """Spawned: attach (shmchan, by name) and send one message; then wait until the consumer
    says it has it, so that this process's exit is not timed. `t0` is the _Stamp's time."""
    try:
        clock = time.perf_counter_ns
        t1 = clock()
        if system == SHMCHAN:
            with shmchan.Channel.open(transport) as ch, ch.sender() as tx:
                t2 = clock()
                tx.send(COLD.pack(t0, t1, t2) + COLD_PAD, 0, TIMEOUT)
                if conn.poll(TIMEOUT):
                    conn.recv()
        else:
            transport.put(COLD.pack(t0, t1, t1) + COLD_PAD, True, TIMEOUT)
            if conn.poll(TIMEOUT):
                conn.recv()
    except BaseException:  # report everything, then exit
        with contextlib.suppress(Exception):
            conn.send(traceback.format_exc())


def _first(end: Endpoint, child: Any, conn: Connection) -> tuple[bytes, int]:
    """The consumer's side: the child's message and the time recv / get returned; waits in
    slices of a second so that a child that failed is reported at once."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            if isinstance(end, ShmchanEnd):
                h = end.rx.recv(1.0)
                got = time.perf_counter_ns()
                with h:
                    return bytes(h.data), got
            assert isinstance(end, QueueEnd)
            data = end.q.get(True, 1.0)
            return data, time.perf_counter_ns()
        except (queue.Empty, shmchan.Empty):
            why = ""
            with contextlib.suppress(Exception):
                if conn.poll(0):
                    why = "\n" + str(conn.recv())
            if why or not child.is_alive() or time.monotonic() > deadline:
                raise BenchError(
                    f"{end.system}: the fresh producer's first message did not arrive"
                    f" (exit code {child.exitcode}){why}"
                ) from None


def _one_first(run: Run, end: Endpoint) -> tuple[float, float, float, float]:
    """One fresh producer, in µs: from the start of its attaching to our receipt, and the
    parts: rebuilding its spawn arguments and starting its code; attaching (shmchan: open
    by name); its first send / put until our recv / get returned."""
    transport = end.name if isinstance(end, ShmchanEnd) else end.transport()
    mine, theirs = run.ctx.Pipe()
    child = run.ctx.Process(
        target=_first_message_child,
        args=(end.system, _Stamp(), transport, theirs),
        name=f"shmchan-bench-cold-{end.system}",
        daemon=True,
    )
    try:
        try:
            child.start()
        finally:
            theirs.close()
        with no_gc():
            data, got = _first(end, child, mine)
        t0, t1, t2 = COLD.unpack_from(data)
        if len(data) != PAYLOAD or data[COLD.size :] != COLD_PAD or not 0 < t0 <= t1 <= t2 <= got:
            raise BenchError(f"{end.system}: the fresh producer's message is wrong: {data!r}")
        mine.send(None)  # the child may exit
        child.join(TIMEOUT)
        if child.exitcode != 0:
            raise BenchError(f"{end.system}: the fresh producer exited with {child.exitcode}")
        return (got - t0) / 1e3, (t1 - t0) / 1e3, (t2 - t1) / 1e3, (got - t2) / 1e3
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        mine.close()


def _run_first(run: Run, systems: list[str]) -> None:
    samples: dict[str, list[float]] = {s: [] for s in systems}
    parts: dict[str, list[tuple[float, float, float]]] = {s: [] for s in systems}
    with contextlib.ExitStack() as stack:
        ends: dict[str, Endpoint] = {}
        for s in systems:
            ends[s] = endpoint(run, s, "cold")
            stack.callback(ends[s].close)
        for rep in range(-1, run.sizes.reps):
            for s in _rotated(systems, rep):
                us, *part = _one_first(run, ends[s])
                if rep >= 0:
                    samples[s].append(us)
                    parts[s].append((part[0], part[1], part[2]))
            run.progress.step(f"first message of a fresh process: rep {rep + 1}")
    for s in systems:
        start, attach, first = (statistics.median(p) for p in zip(*parts[s], strict=True))
        if s == SHMCHAN:
            note = (
                f"args rebuilt, started {start:,.0f}; Channel.open + sender() {attach:,.0f}; "
                f"first send -> recv {first:,.0f} (medians, us)"
            )
        else:
            note = (
                f"args (the queue) rebuilt, started {start:,.0f}; first put -> get "
                f"{first:,.0f} (medians, us)"
                + ("; put starts its feeder thread" if s == MPQ else "")
            )
        run.results.append(
            Result(
                "cold_first",
                "first message of a fresh process",
                s,
                "us",
                False,
                samples[s],
                note=note,
                checked=run.sizes.reps + 1,
            )
        )


# --------------------------------------------------------------------------- after a burst


def _burst_ping(end: Endpoint, group: Producers, ack: Any, n: int) -> tuple[float, float]:
    """One burst of n messages (checked), then the ping: its send -> recv in µs, and about
    how long after the consumer said "drained" it was sent. The floor (a bare semaphore)
    has no burst: its producer pauses as the others do, then posts."""
    group.go(1 if end.system == SEMAPHORE else n)
    clock = time.perf_counter_ns
    try:
        with no_gc():
            if end.system != SEMAPHORE:
                end.consume("msg", n, 1, 1, PAYLOAD)
                ack.release()  # drained: the producer may pause, then ping
            t0 = clock()
            lat = end.latencies(1, ack)[0]
            waited = (clock() - t0) / 1e3
    except (queue.Empty, shmchan.Empty, posix_ipc.BusyError):
        why = group.failure()
        raise BenchError(
            f"{end.system}: nothing arrived for {TIMEOUT:g} s after a burst"
            + (f"\n{why}" if why else "")
        ) from None
    group.wait_done()
    return max(lat, 0.01), max(waited - lat, 0.0)


def _run_burst(run: Run, systems: list[str]) -> None:
    sz = run.sizes
    n = sz.burst_messages
    pauses = {"burst_pause": sz.burst_pause, "burst_nopause": 0.0}
    every = {"burst_pause": [*systems, SEMAPHORE], "burst_nopause": systems}
    rows = [(w, s) for w in pauses for s in every[w]]
    lats: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    gaps: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    with contextlib.ExitStack() as stack:
        ends: dict[tuple[str, str], Endpoint] = {}
        groups: dict[tuple[str, str], Producers] = {}
        acks: dict[tuple[str, str], Any] = {}
        for w, s in rows:
            end = ends[w, s] = endpoint(run, s, "burst")
            stack.callback(end.close)
            ack = acks[w, s] = posix_ipc.Semaphore(
                "/" + unique("burst"), posix_ipc.O_CREX, mode=0o600
            )
            stack.callback(ack.unlink)
            if s == SEMAPHORE:
                job = Job(s, "latency", 0, 1, gap=pauses[w])
            else:
                job = Job(s, "burst", 0, n, gap=pauses[w], ack=ack.name)
            groups[w, s] = Producers(run.ctx, s, [(job, end.transport())])
            stack.callback(groups[w, s].close)
        for group in groups.values():
            group.wait_ready()
        run.progress.step("first message after a burst: started")
        for rep in range(-1, sz.reps):
            for w in pauses:
                for s in _rotated(every[w], rep):
                    lat, gap = _burst_ping(ends[w, s], groups[w, s], acks[w, s], n)
                    if rep >= 0:
                        lats[w, s].append(lat)
                        gaps[w, s].append(gap)
            run.progress.step(f"first message after a burst: rep {rep + 1}")
    ms = f"{sz.burst_pause * 1e3:g} ms"
    for w, s in rows:
        ref = s == SEMAPHORE
        if ref:
            note = f"post -> wait of a bare posix_ipc semaphore, no burst, {ms} after the last"
        elif w == "burst_pause":
            note = (
                f"ping send -> recv, sent {ms} after the consumer drained the burst "
                "(asleep by then); nothing queued ahead of it"
            )
        else:
            note = (
                "ping send -> recv, sent as soon as the consumer drained the burst "
                f"(median {statistics.median(gaps[w, s]):.0f} us later: it is back in recv); "
                "nothing queued ahead of it"
            )
        run.results.append(
            Result(
                w,
                f"first msg after a {n:,}-msg burst, "
                + (f"{ms} pause" if w == "burst_pause" else "no pause"),
                s,
                "us",
                False,
                lats[w, s],
                reference=ref,
                note=note,
                checked=0 if ref else (n + 1) * (sz.reps + 1),
            )
        )


# --------------------------------------------------------------------------- the group


def _run(run: Run) -> None:
    systems = _systems(run)
    _run_import(run, systems)
    _run_first(run, systems)
    _run_burst(run, systems)


def _steps(sizes: Sizes, nsys: int) -> int:
    return 3 * (sizes.reps + 1) + 1


# Not in the default run: 8-12 s in full on 2 cores (18 fresh interpreters, 25 spawned
# processes, 36 bursts) depending on the load, not well under the ~20 s a default group
# should stay within.
register("cold", _run, steps=_steps, order=52, default=False)
