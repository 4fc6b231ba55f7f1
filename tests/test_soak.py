"""Soak: the layers users touch, run together while their processes are killed and stopped.

One test, SOAK_SECONDS long (60 s by default; SHMCHAN_SOAK_SECONDS overrides), with four
things running at once on one machine:

* a KeyedExecutor (3 workers) fed tasks on 8 keys by a submitting thread;
* a KeyedPool (2 workers) serving a channel that 2 producer processes send to;
* an Exchange fanning out to 3 channels, fed by 2 publisher processes, each channel drained
  by its own consumer process, which now and then shuts its channel down, drains it,
  unlinks it and creates it again under the same name;
* an operators' view polling every channel (stats, held keys, lines, `shmchan ls`).

A chaos thread meanwhile SIGKILLs and SIGSTOPs (then SIGCONTs) executor workers, pool
workers, producers and publishers at random; killed producers and publishers are replaced.

Every process appends what it did to its own log file, one line per event with a
CLOCK_MONOTONIC timestamp (the same clock in every process). From the logs the test
checks, after everything is stopped:

* nothing is lost: every task's future ends (its result, or WorkerDied after its attempts);
  every message whose send returned is handled; every publish that returned reached each
  channel it reported, and is received there;
* nothing runs twice beyond the documented at-least-once case (a run whose process was
  killed or whose handle went back may run again; a run that finished in a process that
  was never killed does not);
* per-key order and exclusivity: on each key, runs that finished never overlap, and first
  runs start in the order the work was sent;
* all or nothing: a publish that began while every bound channel existed reached all of
  them or none, even when its publisher was killed mid-publish;
* no call blocks past its timeout (plus slack for a loaded machine).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import shmchan
from tests.procs import CTX, child_env

SOAK_SECONDS = float(os.environ.get("SHMCHAN_SOAK_SECONDS", "60"))
SLACK = 5.0  # seconds a timed call may overrun its timeout on a loaded 2-core machine
EXEC_KEYS = [f"e{i}" for i in range(8)]
POOL_KEYS = [f"p{i}" for i in range(16)]
NCHANNELS = 3
MARGIN = 200_000_000  # ns around a channel's re-creation where a publish may see it missing

pytestmark = [pytest.mark.torture, pytest.mark.timeout(SOAK_SECONDS + 240)]


def _now() -> int:
    return time.monotonic_ns()


class _Log:
    """An append-only log file: one line per event, written in one write(2)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, *fields: object) -> None:
        os.write(self.fd, (" ".join(map(str, fields)) + "\n").encode())


def _read(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            # a line cut short by a SIGKILL has no newline: it never counts
            return [line.split() for line in f.read().split("\n")[:-1] if line]
    except FileNotFoundError:
        return []


def _logs(logdir: str, prefix: str) -> list[list[str]]:
    out: list[list[str]] = []
    for name in sorted(os.listdir(logdir)):
        if name.startswith(prefix):
            out.extend(_read(os.path.join(logdir, name)))
    return out


# -- code that runs in other processes ------------------------------------------------------


def exec_task(logdir: str, task_id: int, key: str) -> int:
    log = _Log(os.path.join(logdir, f"exec.{os.getpid()}"))
    log.write("start", task_id, key, os.getpid(), _now())
    time.sleep(random.uniform(0.0005, 0.004))
    log.write("end", task_id, key, os.getpid(), _now())
    return task_id * 2


def pool_handler(payload: Any, keys: tuple[Any, ...]) -> None:
    producer, n, logdir = payload
    log = _Log(os.path.join(logdir, f"pool.{os.getpid()}"))
    log.write("start", producer, n, keys[0], os.getpid(), _now())
    time.sleep(random.uniform(0.0002, 0.002))
    log.write("end", producer, n, keys[0], os.getpid(), _now())


def producer_main(name: str, producer: str, logdir: str, stop_at: float) -> None:
    log = _Log(os.path.join(logdir, f"sent.{producer}"))
    tx = shmchan.Sender.open(name)
    rng = random.Random(producer)
    n = 0
    while time.monotonic() < stop_at:
        key = rng.choice(POOL_KEYS)
        t0 = time.monotonic()
        try:
            tx.send((producer, n, logdir), keys=(key,), timeout=1.0)
        except shmchan.Full:
            log.write("full", n, round(time.monotonic() - t0, 3))
            continue  # the same n is sent again: it was not accepted
        log.write("sent", n, key, round(time.monotonic() - t0, 3))
        n += 1
        if n % 64 == 0:
            time.sleep(0.002)


def publisher_main(exchange: str, publisher: str, logdir: str, stop_at: float) -> None:
    log = _Log(os.path.join(logdir, f"pub.{publisher}"))
    ex = shmchan.Exchange.open(exchange)
    n = 0
    while time.monotonic() < stop_at:
        log.write("begin", n, _now())
        t0 = time.monotonic()
        try:
            routed = ex.publish((publisher, n), keys=(f"x{n % 8}",), timeout=1.0)
        except (shmchan.Full, shmchan.Closed, shmchan.ChannelRemoved) as exc:
            # published nowhere: the next message takes a new number
            log.write("failed", n, type(exc).__name__, round(time.monotonic() - t0, 3))
        else:
            took = round(time.monotonic() - t0, 3)
            log.write("done", n, ",".join(sorted(routed)) or "-", took, _now())
        n += 1
        time.sleep(0.001)


def consumer_main(name: str, capacity: int, logdir: str, stop_at: float, recreate: Any) -> None:
    """Drain channel `name`; when `recreate` is set, shut it down, drain it, unlink it and
    create it again under the same name."""
    log = _Log(os.path.join(logdir, f"cons.{name}"))
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    generation = 0
    while True:
        t0 = time.monotonic()
        try:
            h = rx.recv(timeout=0.2)
        except shmchan.Empty:
            log.write("timing", "recv", round(time.monotonic() - t0 - 0.2, 3))
            if time.monotonic() > stop_at + 10:
                return
            if recreate.is_set():
                recreate.clear()
                log.write("recreate-begin", generation, _now())
                ch.shutdown()
                for h in rx:  # ends once shut down and drained
                    with h:
                        log.write("got", h.payload[0], h.payload[1], generation)
                rx.close()
                ch.close()
                shmchan.unlink(name)
                time.sleep(0.3)  # a consumer restarting takes a while: publishes meanwhile
                generation += 1
                ch = shmchan.Channel.create(name, capacity=capacity)
                rx = ch.receiver()
                log.write("recreate-end", generation, _now())
            continue
        except shmchan.Closed:
            return
        with h:
            log.write("got", h.payload[0], h.payload[1], generation)


# -- the test process's side ----------------------------------------------------------------


class _Chaos:
    """Kills and stops processes at random; remembers what it did to whom."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.killed: set[int] = set()
        self.stopped: set[int] = set()
        self.counts: collections.Counter[str] = collections.Counter()

    def kill(self, pid: int, what: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.killed.add(pid)
            self.counts[f"kill {what}"] += 1

    def pause(self, pid: int, what: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            self.stopped.add(pid)
            self.counts[f"stop {what}"] += 1
            time.sleep(self.rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def resume_all(self) -> None:
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


def _recent_pids(logdir: str, prefix: str) -> list[int]:
    """Pids that logged work under `prefix` and are still alive (the workers of a pool)."""
    pids = []
    for name in os.listdir(logdir):
        if name.startswith(prefix):
            pid = int(name.split(".")[1])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 0)
                pids.append(pid)
    return pids


@contextlib.contextmanager
def _cleanup(names: list[str], exchange: str, procs: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, ValueError):
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGCONT)
            if p.is_alive():
                p.kill()
            p.join(10)
        for name in names:
            with contextlib.suppress(shmchan.ChannelNotFound):
                shmchan.unlink(name)
        with contextlib.suppress(shmchan.ChannelNotFound):
            shmchan.unlink_exchange(exchange)


def _check_runs(
    runs: list[tuple[str, int, str, int, int, int]], killed: set[int], what: str
) -> tuple[int, int]:
    """Runs are (kind, id, key, pid, t, order): check exclusivity of finished runs on each
    key, first-start order on each key, and no second run after one that finished in a
    process never killed. Returns (finished ids, extra runs allowed by at-least-once)."""
    starts: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    ends: dict[tuple[int, int], int] = {}
    key_of: dict[int, str] = {}
    for kind, ident, key, pid, t, _ in runs:
        key_of[ident] = key
        if kind == "start":
            starts[ident].append((t, pid))
        else:
            ends[(ident, pid)] = t
    intervals: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    extra = 0
    for ident, ss in starts.items():
        ss.sort()
        finished = [(t, pid) for t, pid in ss if (ident, pid) in ends]
        for t, pid in finished:
            intervals[key_of[ident]].append((t, ends[(ident, pid)], ident))
        if len(ss) > 1:
            extra += len(ss) - 1
            for (_t, pid), _later in zip(ss, ss[1:], strict=False):
                if (ident, pid) in ends:
                    assert pid in killed, (
                        f"{what} {ident} ran again after finishing in process {pid}, "
                        "which was never killed"
                    )
    for key, spans in intervals.items():
        spans.sort()
        for (_s1, e1, i1), (s2, _e2, i2) in zip(spans, spans[1:], strict=False):
            assert s2 >= e1, f"{what}: {i1} and {i2} ran at the same time on key {key}"
    return len({ident for ident, _ in ends}), extra


def _check_executor(
    logdir: str, futures: dict[int, tuple[str, Future[int]]], killed: set[int]
) -> tuple[int, int]:
    """Tasks: exclusive and in submit order on each key; a result means the task ran."""
    exec_runs = [(r[0], int(r[1]), r[2], int(r[3]), int(r[4]), 0) for r in _logs(logdir, "exec.")]
    exec_finished, exec_extra = _check_runs(exec_runs, killed, "task")
    first_start: dict[int, int] = {}
    for kind, ident, _key, _pid, t, _ in exec_runs:
        if kind == "start":
            first_start[ident] = min(first_start.get(ident, t), t)
    for key in EXEC_KEYS:
        ids = sorted(i for i, (k, _) in futures.items() if k == key and i in first_start)
        times = [first_start[i] for i in ids]
        assert times == sorted(times), f"tasks on key {key} started out of submit order"
    for i, (_key, fut) in futures.items():
        if fut.exception() is None:
            assert i in first_start, f"task {i} has a result but never ran"
    return exec_finished, exec_extra


def _check_pool(logdir: str, killed: set[int]) -> tuple[int, int, int, int]:
    """KeyedPool: every message whose send returned was handled, exclusive on each key and
    in each producer's order; sends returned within their timeout."""
    pool_runs = []
    for r in _logs(logdir, "pool."):
        ident = (int(r[1][4:]) << 32) | int(r[2])  # producer number, message number
        pool_runs.append((r[0], ident, r[3], int(r[4]), int(r[5]), 0))
    pool_finished, pool_extra = _check_runs(pool_runs, killed, "message")
    handled = {ident for kind, ident, *_ in pool_runs if kind == "end"}
    first_pool: dict[int, int] = {}
    for kind, ident, _key, _pid, t, _ in pool_runs:
        if kind == "start":
            first_pool[ident] = min(first_pool.get(ident, t), t)
    sent_total = fulls = 0
    for name in os.listdir(logdir):
        if not name.startswith("sent."):
            continue
        producer = int(name.split(".")[1][4:])
        by_key: dict[str, list[int]] = collections.defaultdict(list)
        for r in _read(os.path.join(logdir, name)):
            if r[0] == "full":
                fulls += 1
                continue
            ident = (producer << 32) | int(r[1])
            sent_total += 1
            assert ident in handled, f"message {r[1]} of producer {producer} was never handled"
            by_key[r[2]].append(ident)
            assert float(r[3]) <= 1.0 + SLACK, f"a send took {r[3]} s with a 1 s timeout"
        for key, ids in by_key.items():
            times = [first_pool[i] for i in ids]
            assert times == sorted(times), f"producer {producer}'s messages on {key} out of order"
    return sent_total, fulls, pool_finished, pool_extra


def _check_exchange(logdir: str, fan: list[str]) -> tuple[int, int]:
    """Exchange: each channel receives a message at most once; a publish that returned
    reached every channel it reported, and all of them unless a channel was being
    re-created meanwhile; a killed publisher's publish reached all or none likewise."""
    received: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for name in fan:
        seen: set[tuple[str, int]] = set()
        for r in _read(os.path.join(logdir, f"cons.{name}")):
            if r[0] == "got":
                ident = (r[1], int(r[2]))
                assert ident not in seen, f"{ident} received twice on {name}"
                seen.add(ident)
                received[ident].add(name)
            elif r[0] == "timing":
                assert float(r[2]) <= SLACK, f"recv(timeout=0.2) overran by {r[2]} s"
    windows = []
    for name in fan:
        began = None
        for r in _read(os.path.join(logdir, f"cons.{name}")):
            if r[0] == "recreate-begin":
                began = int(r[2])
            elif r[0] == "recreate-end" and began is not None:
                windows.append((began, int(r[2])))
                began = None
        if began is not None:
            windows.append((began, 1 << 62))
    published = partial = 0
    for fname in os.listdir(logdir):
        if not fname.startswith("pub."):
            continue
        publisher = fname.split(".")[1]
        began_at: dict[int, int] = {}
        ended_at: dict[int, int] = {}
        done: set[int] = set()
        for r in _read(os.path.join(logdir, fname)):
            n = int(r[1])
            if r[0] == "begin":
                began_at[n] = int(r[2])
            elif r[0] == "done":
                done.add(n)
                ended_at[n] = int(r[4])
                published += 1
                routed = set() if r[2] == "-" else set(r[2].split(","))
                got = received.get((publisher, n), set())
                assert routed <= got, f"publish {publisher}/{n} reported {routed}, got {got}"
                assert float(r[3]) <= 1.0 + SLACK, f"a publish took {r[3]} s with a 1 s timeout"
            elif r[0] == "failed":
                assert not received.get((publisher, n)), f"failed publish {n} was received"
        for n, t in began_at.items():
            got = received.get((publisher, n), set())
            # a publish whose publisher was killed is settled by the next one within ~3 s
            end = ended_at.get(n, t + 3_000_000_000)
            in_window = any(t <= e + MARGIN and b - MARGIN <= end for b, e in windows)
            if n not in done and got and len(got) != NCHANNELS:
                partial += 1
                assert in_window, (
                    f"publish {publisher}/{n} (publisher killed) reached only {sorted(got)}"
                )
            if n in done and not in_window:
                assert len(got) == NCHANNELS, f"publish {publisher}/{n} reached only {got}"
    return published, partial


def test_soak_executor_pool_exchange_under_kills(
    tmp_path: Any, new_chan_name: Any, capsys: Any
) -> None:
    logdir = str(tmp_path)
    rng = random.Random(int(os.environ.get("SHMCHAN_SOAK_SEED", "0")) or None)
    chaos = _Chaos(rng)
    pool_chan = new_chan_name()
    fan = [new_chan_name() for _ in range(NCHANNELS)]
    exchange = new_chan_name()
    stop_at = time.monotonic() + SOAK_SECONDS
    timings: collections.Counter[str] = collections.Counter()
    overruns: list[str] = []

    def timed(what: str, timeout: float, t0: float) -> None:
        over = time.monotonic() - t0 - timeout
        timings[what] += 1
        if over > SLACK:
            overruns.append(f"{what} overran its {timeout} s timeout by {over:.1f} s")

    shmchan.Channel.create(pool_chan, capacity=256 << 10).close()
    for name in fan:
        shmchan.Channel.create(name, capacity=256 << 10).close()
    ex = shmchan.Exchange.create(exchange, kind="fanout")
    for name in fan:
        ex.bind(name)
    recreate = {name: CTX.Event() for name in fan}
    consumers = [
        CTX.Process(target=consumer_main, args=(name, 256 << 10, logdir, stop_at, recreate[name]))
        for name in fan
    ]
    producers: list[Any] = []
    publishers: list[Any] = []
    nprod = collections.Counter[str]()

    def start_producer(kind: str) -> None:
        nprod[kind] += 1
        ident = f"{kind}{nprod[kind]}"
        if kind == "prod":
            p = CTX.Process(target=producer_main, args=(pool_chan, ident, logdir, stop_at))
            producers.append(p)
        else:
            p = CTX.Process(target=publisher_main, args=(exchange, ident, logdir, stop_at))
            publishers.append(p)
        p.start()

    with contextlib.ExitStack() as stack:
        stack.enter_context(_cleanup([pool_chan, *fan], exchange, consumers))
        stack.enter_context(_cleanup([], exchange, producers))
        stack.enter_context(_cleanup([], exchange, publishers))
        for p in consumers:
            p.start()
        pool = shmchan.KeyedPool(pool_chan, pool_handler, processes=2, mp_context=CTX)
        stack.callback(pool.terminate)
        executor = shmchan.KeyedExecutor(max_workers=3, mp_context=CTX, max_attempts=20)
        stack.enter_context(executor)
        for _ in range(2):
            start_producer("prod")
            start_producer("pub")

        futures: dict[int, tuple[str, Future[int]]] = {}
        stop_submitting = threading.Event()

        def submitter() -> None:
            i = 0
            while not stop_submitting.is_set():
                key = EXEC_KEYS[i % 7 if i % 5 else 7]
                futures[i] = (key, executor.submit(exec_task, logdir, i, key, keys=(key,)))
                i += 1
                if i % 32 == 0:
                    # keep the backlog bounded: wait for the oldest of the last batch
                    with contextlib.suppress(Exception):
                        t0 = time.monotonic()
                        futures[i - 32][1].exception(timeout=10)
                        timed("future.exception", 10, t0)

        sub = threading.Thread(target=submitter, daemon=True)
        sub.start()

        view_errors: list[str] = []
        stop_view = threading.Event()

        def view() -> None:
            while not stop_view.is_set():
                for name in [pool_chan, *fan]:
                    t0 = time.monotonic()
                    try:
                        with shmchan.Channel.open(name) as c:
                            c.stats()
                            c.held()
                            c.waiting(top=5)
                    except (shmchan.ChannelNotFound, shmchan.ChannelRemoved):
                        pass
                    except Exception as exc:  # noqa: BLE001 - reported by the test
                        view_errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    timed("view", 10, t0)  # no timeout: must not block (10 s: a loaded machine)
                t0 = time.monotonic()
                subprocess.run(
                    [sys.executable, "-m", "shmchan", "ls"],
                    capture_output=True,
                    timeout=30,
                    env=child_env(),
                )
                timed("ls", 25, t0)  # a Python start-up on a loaded machine
                time.sleep(0.2)

        viewer = threading.Thread(target=view, daemon=True)
        viewer.start()

        # -- chaos until the end of the soak
        recreations = 0
        last_recreation = time.monotonic()
        while time.monotonic() < stop_at - 1:
            time.sleep(rng.uniform(0.1, 0.4))
            choice = rng.random()
            if time.monotonic() - last_recreation > 5:
                choice = 1.0  # at least one re-creation every 5 s
            # (up to this draw, whom, what): workers are found by the logs they write
            targets = [
                (0.2, "exec.", "executor worker", chaos.kill),
                (0.3, "exec.", "executor worker", chaos.pause),
                (0.45, "pool.", "pool worker", chaos.kill),
                (0.55, "pool.", "pool worker", chaos.pause),
                (0.65, producers, "producer", chaos.kill),
                (0.7, producers, "producer", chaos.pause),
                (0.8, publishers, "publisher", chaos.kill),
                (0.95, publishers, "publisher", chaos.pause),
            ]
            for upto, whom, what, act in targets:
                if choice < upto:
                    if isinstance(whom, str):
                        pids = _recent_pids(logdir, whom)
                    else:
                        pids = [p.pid for p in whom if p.is_alive()]
                    if pids:
                        act(rng.choice(pids), what)
                        if act == chaos.kill and not isinstance(whom, str):
                            start_producer("prod" if whom is producers else "pub")
                    break
            else:
                recreate[rng.choice(fan)].set()
                recreations += 1
                last_recreation = time.monotonic()
        chaos.resume_all()
        stop_submitting.set()
        sub.join(30)
        assert not sub.is_alive(), "submit blocked for more than 30 s"

        # -- drain: every future ends, the pool's channel empties, the consumers finish
        outcomes: collections.Counter[str] = collections.Counter()
        for i, (_key, fut) in list(futures.items()):
            t0 = time.monotonic()
            try:
                assert fut.result(timeout=60) == i * 2
                outcomes["done"] += 1
            except shmchan.WorkerDied:
                outcomes["WorkerDied"] += 1
            timed("future.result", 60, t0)
        for p in producers + publishers:
            p.join(30)
            assert not p.is_alive(), "a producer or publisher did not stop by itself"
        with shmchan.Channel.open(pool_chan) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = c.stats()
                if st.queued == 0 and st.inflight == 0:
                    break
                time.sleep(0.1)
            st = c.stats()
            assert st.queued == 0 and st.inflight == 0, f"the pool did not drain: {st}"
            c.shutdown()
        pool.join(30)
        for p in consumers:
            p.join(30)
            assert not p.is_alive(), "a consumer did not stop by itself"
        stop_view.set()
        viewer.join(30)
        executor.shutdown(wait=True)

    # -- the checks, from the logs
    assert not view_errors, view_errors[:5]

    exec_finished, exec_extra = _check_executor(logdir, futures, chaos.killed)
    sent_total, fulls, pool_finished, pool_extra = _check_pool(logdir, chaos.killed)
    published, partial = _check_exchange(logdir, fan)
    assert not overruns, overruns[:5]
    with capsys.disabled():
        print(
            f"\nsoak {SOAK_SECONDS:.0f} s: {dict(chaos.counts)}; recreations {recreations}; "
            f"tasks {len(futures)} ({dict(outcomes)}, finished runs {exec_finished}, "
            f"runs again after a kill {exec_extra}); pool messages sent {sent_total} "
            f"(Full {fulls}), handled {pool_finished}, again after a kill {pool_extra}; "
            f"publishes {published} to {NCHANNELS} channels, "
            f"partial during a re-creation {partial}; calls timed {sum(timings.values())}"
        )
    assert outcomes["done"] > 0 and sent_total > 0 and published > 0
    assert sum(chaos.counts.values()) > 0 and recreations > 0
