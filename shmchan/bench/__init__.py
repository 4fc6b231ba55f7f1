"""`python -m shmchan bench`: shmchan side by side with its peers, in one run.

Every workload runs, in one process tree and one run, through shmchan and through its
peers on the same machine: `multiprocessing.Queue`, `faster-fifo`, `zeroq` (a lock-free
shared-memory queue of fixed-size slots) and `pyzmq` (PUSH/PULL over ipc://) -- each of
these three optional, skipped with a note when it is not installed -- and a naive keyed
dispatcher: the obvious design that scans its whole backlog for the first message whose
keys are free, which is what shmchan's per-key wait lines exist to beat. The run ends
with a table of absolute figures, each row's ratio to the best peer of its case, and
shmchan's performance targets with the measured ratio and whether it is met.

How the numbers are taken (so they can be trusted and reproduced):

* Producers are spawned processes that build their payloads, attach, and report ready
  before any clock starts; process start-up is never timed. The consumer is this
  process. A repetition starts when the producers are told to go and ends when the
  consumer has received, verified and released the last message.
* Each figure is the median of several repetitions (min and max shown); one smaller
  warm-up repetition per system comes first and is discarded. Repetitions of the
  systems are interleaved (rep 1 of every system, then rep 2, ...) so slow drift of the
  machine hits every system alike.
* Every payload carries its message index and producer number (struct-packed) and a
  check byte; the consumer checks them, and per-producer order, on every message.
  shmchan and the naive dispatcher release every message. shmchan's consumer reads
  64 B payloads with `h.payload` (a bytes object, as the peers hand out) and 1 MiB
  payloads with the zero-copy `h.data`.
* The cyclic garbage collector is paused during timed sections, for every system alike.
* Latencies use `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: one
  clock for all processes of the machine.

Nothing here is a hard-coded number: a target that was not measured in this run is
reported as "not measured", never assumed.

The package, one concern per module:

* common.py    sizes of a run, system names, payload layout, BenchError
* producers.py the spawned producer processes
* endpoints.py a system's receiving end; shmchan's
* peers.py     mp.Queue, faster-fifo, the naive keyed dispatcher, the bare semaphore
* fastpeers.py zeroq and pyzmq
* check.py     the vectorized payload check of batched workloads
* harness.py   the run's state and the interleaved throughput harness
* throughput.py, dispatch.py, latency.py, ...  workload groups, one family per module
* registry.py  how a module registers a group that `--only NAME` selects (read it first)
* report.py    result rows, ranking, targets, the table; plot.py the chart
* markdown.py  --report DIR: the run as Markdown tables, plot and JSON for the docs
* spread.py    --runs N: the spread of every figure and target over N runs
* runner.py    one run: machine description, the selected groups, the report

Every module of the package is imported here, so a new workload group is one new module
that calls `registry.register(...)` at import; nothing else needs editing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pkgutil
import sys

from shmchan.bench.common import (
    COPY,
    FFIFO,
    FULL,
    MPQ,
    NAIVE,
    QUICK,
    SCHEMA,
    SEMAPHORE,
    SHMCHAN,
    ZEROQ,
    ZMQ,
    BenchError,
    Sizes,
)
from shmchan.bench.markdown import write_report
from shmchan.bench.peers import NaiveKeyedDispatcher
from shmchan.bench.plot import plot
from shmchan.bench.registry import default_workloads, groups, register
from shmchan.bench.report import Result, Target, format_table
from shmchan.bench.runner import machine, run
from shmchan.bench.spread import format_spread, spread

__all__ = [
    "main",
    "build_parser",
    "run",
    "register",
    "NaiveKeyedDispatcher",
    "BenchError",
    "Result",
    "Target",
    "Sizes",
    "machine",
    "format_table",
    "plot",
    "SCHEMA",
    "FULL",
    "QUICK",
    "WORKLOADS",
    "SHMCHAN",
    "MPQ",
    "FFIFO",
    "ZEROQ",
    "ZMQ",
    "NAIVE",
    "COPY",
    "SEMAPHORE",
]

# Import every module of the package: each workload module registers its groups.
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")

WORKLOADS: tuple[str, ...] = default_workloads()  # what a run without --only runs


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m shmchan bench` (also rendered in the docs)."""
    p = argparse.ArgumentParser(
        prog="python -m shmchan bench",
        description=(
            "Measure shmchan against multiprocessing.Queue, faster-fifo, zeroq, pyzmq and a "
            "naive keyed dispatcher, side by side in one run, and check the performance "
            "targets against the best peer of each case."
        ),
        epilog=(
            "Exit status: 0 the run completed (targets met or not), 1 the run failed, 2 bad usage."
        ),
    )
    p.add_argument(
        "--quick", action="store_true", help="a short run (smaller sizes, 3 repetitions)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    p.add_argument("--plot", metavar="FILE.png", help="also write a chart (needs matplotlib)")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="also write the run into DIR for the documentation: results.md (the machine, "
        "the date, the command, the tables), bench.png and report.json (needs matplotlib)",
    )
    p.add_argument(
        "--only",
        metavar="WORKLOAD",
        action="append",
        choices=[g.name for g in groups()],
        help="run only this workload group (repeatable): "
        + ", ".join(g.name + ("" if g.default else " (only when asked)") for g in groups()),
    )
    p.add_argument(
        "--reps", type=int, metavar="N", help="repetitions per figure (default 5, quick 3)"
    )
    p.add_argument(
        "--runs",
        type=int,
        metavar="N",
        default=1,
        help="run the whole selection N times; print the last run, then the spread of every "
        "figure and target over the N runs (default 1)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress display (default: on when stderr is a terminal)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m shmchan bench`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if args.reps is not None and args.reps < 1:
        print("bench: --reps must be >= 1", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("bench: --runs must be >= 1", file=sys.stderr)
        return 2
    if (args.plot or args.report) and importlib.util.find_spec("matplotlib") is None:
        print(
            "bench: --plot and --report need matplotlib (pip install 'shmchan[bench]')",
            file=sys.stderr,
        )
        return 2
    workloads = [g.name for g in groups() if g.name in args.only] if args.only else WORKLOADS
    show = not args.no_progress and sys.stderr.isatty()
    reports = []
    try:
        for _ in range(args.runs):
            reports.append(
                run(quick=args.quick, workloads=workloads, reps=args.reps, progress=show)
            )
    except BenchError as e:
        print(f"bench: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    report = reports[-1]
    if args.json:
        # One run: its report. Several: {"runs": [report, ...], "spread": ...}.
        shown = report if len(reports) == 1 else {"runs": reports, "spread": spread(reports)}
        print(json.dumps(shown, indent=2))
    else:
        print(format_table(report))
        if len(reports) > 1:
            print("\n" + format_spread(spread(reports)))
    if args.plot:
        plot(report, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    if args.report:
        written = write_report(report, args.report, argv)
        if not args.json:
            print(f"\nreport written to {', '.join(written)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
