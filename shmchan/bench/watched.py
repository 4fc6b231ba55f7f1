"""The operators' view beside a busy receiver: 64 B unbatched, 1 producer, with and without
`python -m shmchan stat NAME --watch 0.1 --json` running in another process.

The watcher reads the held keys, the deepest lines, producers and dead letters of the very
channel being measured, ten times a second (csrc/inspect.c: seqlock reads that never make
the receiver wait). It is started once and paused (SIGSTOP) during the unwatched
repetitions, resumed (SIGCONT) during the watched ones, which are interleaved with them;
the samples it printed while resumed are counted, so the figure shows it really ran.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from shmchan.bench.common import (
    PAYLOAD,
    SHMCHAN,
    TIMEOUT,
    BenchError,
    Sizes,
    no_gc,
    warmup_count,
)
from shmchan.bench.endpoints import ShmchanEnd
from shmchan.bench.harness import Run
from shmchan.bench.producers import Job, Producers
from shmchan.bench.registry import register
from shmchan.bench.report import Result

WATCHED = "shmchan + stat --watch"
INTERVAL = "0.1"


class _Watcher:
    """`python -m shmchan stat NAME --watch 0.1 --json` in a child; counts its samples."""

    def __init__(self, name: str) -> None:
        self.samples = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmchan", "stat", name, "--watch", INTERVAL, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._first = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._first.wait(TIMEOUT):
            self.close()
            raise BenchError(f"stat --watch printed nothing within {TIMEOUT:g} s")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:  # one JSON object per sample
            self.samples += 1
            self._first.set()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.resume()
            self.proc.terminate()
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(TIMEOUT)
        self._reader.join(TIMEOUT)


# Messages per repetition: enough for several of the watcher's samples on a fast machine.
MESSAGES = 1_000_000
QUICK_MESSAGES = 100_000


def _run_watched(run: Run) -> None:
    n = QUICK_MESSAGES if run.quick else MESSAGES
    label = "64 B unbatched, 1 producer, watched"
    samples: dict[str, list[float]] = {SHMCHAN: [], WATCHED: []}
    seen = 0  # watcher samples taken while a watched repetition ran
    with contextlib.ExitStack() as stack:
        end = ShmchanEnd()
        stack.callback(end.close)
        group = Producers(run.ctx, SHMCHAN, [(Job(SHMCHAN, "msg", 0, n), end.transport())])
        stack.callback(group.close)
        group.wait_ready()
        watcher = _Watcher(end.name)
        stack.callback(watcher.close)
        watcher.pause()
        run.progress.step(f"{label}: started")
        for rep in range(-1, run.sizes.reps):
            count = warmup_count(n) if rep < 0 else n
            for system in (SHMCHAN, WATCHED):
                before = watcher.samples
                if system == WATCHED:
                    watcher.resume()
                    time.sleep(0.05)  # let it get going: it is beside the receiver throughout
                with no_gc():
                    t0 = time.perf_counter()
                    group.go(count)
                    end.consume("msg", count, 1, 1, PAYLOAD)
                    elapsed = time.perf_counter() - t0
                if system == WATCHED:
                    watcher.pause()
                    seen += watcher.samples - before
                group.wait_done()
                if rep >= 0:
                    samples[system].append(count / elapsed)
                run.progress.step(f"{label}: {system}")
    # The watched row stands where a peer would: "vs best peer" on the shmchan row reads
    # unwatched / watched (1.00x: the watcher costs the receiver nothing measurable).
    plain = Result("watched", label, SHMCHAN, "msg/s", True, samples[SHMCHAN])
    plain.note = "send / recv / payload / release, nothing beside it"
    watched = Result(
        "watched",
        label,
        WATCHED,
        "msg/s",
        True,
        samples[WATCHED],
        note=f"the same, stat --watch {INTERVAL} beside it ({seen} samples while timed)",
    )
    checked = n * run.sizes.reps + warmup_count(n)
    plain.checked = watched.checked = checked
    run.results += [plain, watched]


def _steps(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * 2


register("watched", _run_watched, steps=_steps, order=60)
