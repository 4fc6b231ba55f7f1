"""The worker processes as their manager sees them (shared by KeyedExecutor and
KeyedPool): starting, feeding (hand_over through a pipe), watching and stopping them.
What runs inside a worker is worker.py; the words it publishes are in protocol.py."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from ..channel import Handle, hand_over
from .common import PREFETCH, STOP_GRACE, oom_kills
from .protocol import (
    FINISHED,
    READY,
    RUNNING,
    SLOT,
    STARTED,
)
from .stats import WorkerStats


class WorkerProcess:
    """One worker process as its manager sees it."""

    __slots__ = (
        "index",
        "process",
        "conn",
        "given",
        "taken",
        "finished",
        "oom",
        "stopping",
        "ready",
    )

    def __init__(self, index: int, process: Any, conn: Any) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        # Unfinished handles, in the order given: [handle, id]. The executor voids an
        # entry (handle None) that it took back before the worker adopted it.
        self.given: collections.deque[list[Any]] = collections.deque()
        self.taken = 0  # handles given, ever
        self.finished = 0  # of those, finished (the worker's FINISHED word, or results)
        self.oom = oom_kills()
        self.stopping = False
        self.ready = False  # its initializer returned (the READY word, seen once)

    def catch_up(self, finished: int, done: list[Handle]) -> None:
        """The worker finished its first `finished` handles: move those to `done`."""
        if finished > self.finished:
            given = self.given
            for _ in range(min(finished, self.taken) - self.finished):
                h = given.popleft()[0]
                if h is not None:
                    done.append(h)
            self.finished = min(finished, self.taken)


class WorkerSet:
    """The worker processes: start, hand out, notice deaths, replace, stop."""

    def __init__(
        self,
        ctx: Any,
        size: int,
        target: Callable[..., None],
        args: tuple[Any, ...],
        max_tasks: int | None,
        prefetch: int = PREFETCH,
        ready_first: bool = False,
    ) -> None:
        self.ctx = ctx
        self.target = target
        self.args = args  # after (conn, words, index)
        self.max_tasks = max_tasks
        self.prefetch = prefetch  # handles a worker may have in hand at once
        # Hand a worker nothing before its initializer returned (its READY word): what
        # a worker whose initializer fails was given would be charged an attempt.
        self.ready_first = ready_first
        self.words = ctx.RawArray("q", SLOT * size)
        self.slots: list[WorkerProcess | None] = [None] * size
        self.by_pid: dict[int, WorkerProcess] = {}

    def start(self, index: int) -> WorkerProcess:
        base = SLOT * index
        for k in range(SLOT):
            self.words[base + k] = 0
        reader, writer = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(
            target=self.target,
            args=(reader, self.words, index, *self.args),
            name=f"shmchan-worker-{index}",
        )
        try:
            p.start()
        finally:
            reader.close()
        w = WorkerProcess(index, p, writer)
        self.slots[index] = w
        self.by_pid[p.pid] = w
        return w

    def start_all(self) -> None:
        for i in range(len(self.slots)):
            self.start(i)

    def live(self) -> list[WorkerProcess]:
        return [w for w in self.slots if w is not None]

    def budget(self, w: WorkerProcess) -> int:
        """How many more handles `w` may be given now."""
        if w.stopping:
            return 0
        if self.ready_first and not w.ready:
            if not self.words[SLOT * w.index + READY]:
                return 0
            w.ready = True
        room = self.prefetch - (w.taken - w.finished)
        if self.max_tasks is not None:
            room = min(room, self.max_tasks - w.taken)
        return max(room, 0)

    def refresh(self) -> list[Handle]:
        """Catch up with the workers' FINISHED words; the handles they finished."""
        words = self.words
        done: list[Handle] = []
        for w in self.slots:
            if w is not None:
                w.catch_up(words[SLOT * w.index + FINISHED], done)
        return done

    def outstanding(self) -> int:
        return sum(w.taken - w.finished for w in self.slots if w is not None)

    def capacity(self) -> int:
        return sum(self.budget(w) for w in self.slots if w is not None)

    def give(
        self,
        batch: list[Any],
        record: Callable[[list[list[Any]], bytes], None] | None = None,
    ) -> list[Any]:
        """Hand each (handle, task id) to a worker: evenly over those with room, the
        least loaded first, in runs (one pipe write per worker). Returns those no worker
        had room for. Each entry is [handle, id]; `record(entries, data)` is called with
        the bytes of each hand-over (see channel.hand_over) right after it is made.

        Least loaded first: tasks often come one at a time (each result frees a key,
        and the next task on it follows), and each must go where it runs soonest, not to
        the first worker with room, which would queue them all behind one another there
        while the other workers sit idle."""
        todo = batch
        while todo:
            open_ = [(b, w) for w in self.slots if w is not None and (b := self.budget(w)) > 0]
            if not open_:
                return todo  # a worker died since the room was counted
            open_.sort(key=lambda bw: bw[0], reverse=True)  # most room first (stable)
            share = -(-len(todo) // len(open_))  # ceil
            for room, w in open_:
                items, todo = todo[: min(share, room)], todo[min(share, room) :]
                if items:
                    self._send(w, items, record)
        return []

    def _send(
        self,
        w: WorkerProcess,
        items: list[Any],
        record: Callable[[list[list[Any]], bytes], None] | None,
    ) -> None:
        w.given.extend(items)
        w.taken += len(items)
        data = hand_over([item[0] for item in items])  # one core call for the batch
        if record is not None:
            record(items, data)
        try:
            w.conn.send_bytes(data)
        except OSError:
            pass  # it died: reap() gives its handles back
        if self.max_tasks is not None and w.taken >= self.max_tasks:
            self.stop(w)

    def stop(self, w: WorkerProcess) -> None:
        """Ask `w` to exit once it has finished what it holds."""
        if not w.stopping:
            w.stopping = True
            try:
                w.conn.send_bytes(b"")
            except OSError:
                pass

    def running(self, w: WorkerProcess) -> tuple[int, int] | None:
        """(seq, started ns) of the handle `w` is running, or None."""
        base = SLOT * w.index
        seq = self.words[base + RUNNING]
        started = self.words[base + STARTED]
        if seq == 0 or seq != self.words[base + RUNNING]:
            return None
        return seq - 1, started

    def ended(self) -> list[tuple[WorkerProcess, int | None, int | None]]:
        """Workers that exited since the last call: (worker, exitcode, seq it was running)."""
        out = []
        for w in self.slots:
            if w is None or w.process.exitcode is None:
                continue
            w.catch_up(self.words[SLOT * w.index + FINISHED], [])
            run = self.running(w)
            out.append((w, w.process.exitcode, None if run is None else run[0]))
            self.slots[w.index] = None
            self.by_pid.pop(w.process.pid, None)
            w.conn.close()
            w.process.join(0)
        return out

    def shut(self, kill: bool) -> None:
        """Stop every worker (kill: at once) and wait for them; never leaves one running."""
        workers = self.live()
        for w in workers:
            if kill:
                w.process.kill()
            else:
                self.stop(w)
        deadline = time.monotonic() + STOP_GRACE
        for w in workers:
            w.process.join(max(deadline - time.monotonic(), 0))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join(STOP_GRACE)
            w.conn.close()

    def stats(self) -> tuple[WorkerStats, ...]:
        now = time.monotonic_ns()
        out = []
        for w in self.slots:
            if w is None:
                continue
            run = self.running(w)
            dead = w.process.exitcode is not None
            state = "dead" if dead else "stopping" if w.stopping else "busy" if run else "idle"
            out.append(
                WorkerStats(
                    pid=w.process.pid,
                    state=state,
                    finished=int(self.words[SLOT * w.index + FINISHED]),
                    started=None if run is None else max(now - run[1], 0) / 1e9,
                )
            )
        return tuple(out)
