"""The workload groups `--only NAME` selects, and how a module adds one.

A workload group is a function that runs one family of workloads and appends `Result`
rows to `run.results`. Every module of this package is imported when the package is
(see `__init__.py`), so adding a group takes one new module and no edit elsewhere:

    # shmchan/bench/mything.py
    from shmchan.bench.harness import Run
    from shmchan.bench.registry import register
    from shmchan.bench.report import Result

    def _run_mything(run: Run) -> None:
        n = 1_000 if run.quick else 100_000   # run.sizes holds the shared sizes
        ...                                   # spawn producers (producers.Producers), time,
        run.results.append(Result("mything", "what a reader sees", "shmchan", "msg/s",
                                  True, samples))
        run.progress.step("mything: done")    # as many steps as `steps` announced

    register("mything", _run_mything, steps=lambda sizes, nsys: 1, default=False)

`python -m shmchan bench --only mything` then runs it (repeatable `--only`). A group
registered with `default=True` also runs in a plain `python -m shmchan bench`; keep that for
groups that take seconds, not minutes. `targets` adds performance targets (checked only
when the group ran) and `panel` draws the group's figure into its own panel of `--plot`.
Rows must follow report.Result's conventions (one sample per repetition, all > 0) and clean
up every segment and process they start, even when they fail (raise BenchError).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmchan.bench.common import Sizes
    from shmchan.bench.harness import Run
    from shmchan.bench.report import Result, Target


@dataclass(frozen=True)
class WorkloadGroup:
    """One `--only NAME` choice."""

    name: str
    run: Callable[[Run], None]
    # Progress steps the group will report, from the run's sizes and the number of systems.
    steps: Callable[[Sizes, int], int]
    order: float  # position in the run and in the report (built-in groups: 10 ... 50)
    default: bool  # runs when no --only is given
    targets: Callable[[list[Result]], list[Target]] | None
    # Draws into one matplotlib Axes from the report's result rows (dicts).
    panel: Callable[[Any, list[dict[str, Any]]], None] | None


_GROUPS: dict[str, WorkloadGroup] = {}


def register(
    name: str,
    run: Callable[[Run], None],
    *,
    steps: Callable[[Sizes, int], int],
    order: float = 100.0,
    default: bool = True,
    targets: Callable[[list[Result]], list[Target]] | None = None,
    panel: Callable[[Any, list[dict[str, Any]]], None] | None = None,
) -> None:
    """Make `run` selectable as `--only name` (see the module docstring)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"bench workload group name {name!r}: letters, digits, - and _ only")
    if name in _GROUPS:
        raise ValueError(f"bench workload group {name!r} is registered twice")
    _GROUPS[name] = WorkloadGroup(name, run, steps, order, default, targets, panel)


def unregister(name: str) -> None:
    """Remove a group (tests register throwaway groups)."""
    del _GROUPS[name]


def groups() -> list[WorkloadGroup]:
    """Every registered group, in run order."""
    return sorted(_GROUPS.values(), key=lambda g: (g.order, g.name))


def group(name: str) -> WorkloadGroup:
    return _GROUPS[name]


def default_workloads() -> tuple[str, ...]:
    """What a run without --only runs."""
    return tuple(g.name for g in groups() if g.default)
