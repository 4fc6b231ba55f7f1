"""One run: the machine's description, every selected workload group, the report."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import multiprocessing
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import shmchan
from shmchan.bench.common import (
    FFIFO,
    FULL,
    MPQ,
    NAIVE,
    QUICK,
    SCHEMA,
    SHMCHAN,
    ZEROQ,
    ZMQ,
    Sizes,
)
from shmchan.bench.harness import Run
from shmchan.bench.progress import Progress
from shmchan.bench.registry import default_workloads, groups
from shmchan.bench.report import core_targets, rank


def _revision() -> str | None:
    """The git commit shmchan runs from (+ "-dirty" if its sources differ), if in a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    if not os.path.isdir(os.path.join(root, ".git")):
        return None
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "csrc", "shmchan"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    versions = {"shmchan": shmchan.__version__}
    for dist in ("faster-fifo", "zeroq", "pyzmq", "posix-ipc", "cffi"):
        with contextlib.suppress(Exception):
            import importlib.metadata

            versions[dist] = importlib.metadata.version(dist)
    return {
        "revision": _revision(),
        "cpu_model": model or platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "versions": versions,
    }


def _importable(module: str) -> bool:
    """Whether an optional peer imports here (a failing import counts as missing)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def available_systems() -> tuple[list[str], list[dict[str, str]]]:
    """shmchan and the peers that import here (in report order), and a skipped note for
    each optional peer that does not."""
    systems = [SHMCHAN, MPQ]
    skipped = []
    for system, module in ((FFIFO, "faster_fifo"), (ZEROQ, "zeroq"), (ZMQ, "zmq")):
        if _importable(module):
            systems.append(system)
        else:
            why = "not installed (pip install 'shmchan[bench]')"
            skipped.append({"system": system, "reason": why})
    if FFIFO in systems:
        # Importing it lets spawned processes receive faster-fifo queues. No stubs.
        import faster_fifo_reduction  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    return [*systems, NAIVE], skipped


def run(
    quick: bool = False,
    workloads: Sequence[str] | None = None,
    reps: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark; returns the report (what --json prints). `workloads` names
    registered groups (default: every group registered with default=True)."""
    if workloads is None:
        workloads = default_workloads()
    selected = [g for g in groups() if g.name in workloads]
    unknown = set(workloads) - {g.name for g in selected}
    if unknown:
        raise ValueError(f"unknown bench workload group(s): {', '.join(sorted(unknown))}")
    sizes = QUICK if quick else FULL
    if reps is not None:
        sizes = Sizes(**{**sizes.__dict__, "reps": reps})
    systems, skipped = available_systems()
    started = datetime.datetime.now(datetime.UTC)
    load = [round(x, 2) for x in os.getloadavg()]  # before we add any load of our own
    bar = Progress(sum(g.steps(sizes, len(systems)) for g in selected), progress)
    state = Run(sizes, systems, multiprocessing.get_context("spawn"), bar, quick=quick)
    t0 = time.monotonic()
    try:
        for g in selected:
            g.run(state)
    finally:
        bar.close()
    rank(state.results)
    targets = core_targets(state.results)
    for g in selected:
        if g.targets is not None:
            targets += g.targets(state.results)
    return {
        "schema": SCHEMA,
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 1),
        "quick": quick,
        "repetitions": sizes.reps,
        "machine": machine() | {"loadavg_at_start": load},
        "sizes": sizes.__dict__ | {"producers": list(sizes.producers)},
        "workloads": [g.name for g in selected],
        "systems": systems,
        "skipped": skipped,
        "results": [r.as_dict() for r in state.results],
        "targets": [t.as_dict() for t in targets],
    }
