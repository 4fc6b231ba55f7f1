"""Result rows, the ranking against the best peer, the performance targets, the table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shmchan.bench.common import COPY, SEMAPHORE, SHMCHAN


@dataclass
class Result:
    """One row: one system's figure for one workload, over the repetitions."""

    workload: str  # machine-readable workload key, e.g. "unbatched_p1"
    label: str  # what a reader sees, e.g. "64 B unbatched, 1 producer"
    system: str
    unit: str  # "msg/s", "MiB/s", "us", "us/msg"
    higher_is_better: bool
    samples: list[float]  # one per repetition
    reference: bool = False  # a ceiling or floor, not a peer
    note: str = ""
    vs_best_peer: float | None = None
    out_of_order: int = 0  # messages received after a later one of the same producer
    checked: int = 0  # messages whose payload, exactly-once delivery and order were checked

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "label": self.label,
            "system": self.system,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "samples": self.samples,
            "reference": self.reference,
            "vs_best_peer": self.vs_best_peer,
            "note": self.note,
            "checked": self.checked,
            "out_of_order": self.out_of_order,
        }


def _goodness(r: Result, value: float) -> float:
    return value if r.higher_is_better else 1.0 / value


def rank(results: list[Result]) -> None:
    """Set vs_best_peer: each row's median relative to the best peer's, > 1 = better."""
    by_workload: dict[str, list[Result]] = {}
    for r in results:
        by_workload.setdefault(r.workload, []).append(r)
    for rows in by_workload.values():
        peers = [r for r in rows if r.system != SHMCHAN and not r.reference]
        if not peers:
            continue
        best = max(_goodness(r, r.median) for r in peers)
        for r in rows:
            if not r.reference:
                r.vs_best_peer = _goodness(r, r.median) / best


@dataclass
class Target:
    name: str
    measured: float | None
    target: float
    comparison: str  # ">=" or "<="
    detail: str

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        if self.comparison == ">=":
            return self.measured >= self.target
        return self.measured <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "target": self.target,
            "comparison": self.comparison,
            "met": self.met,
            "detail": self.detail,
        }


def find_result(results: list[Result], workload: str, system: str) -> Result | None:
    for r in results:
        if r.workload == workload and r.system == system:
            return r
    return None


def best_peer(results: list[Result], workload: str) -> Result | None:
    """The best peer's row of a workload (not shmchan, not a reference), if any ran."""
    rows = [r for r in results if r.workload == workload]
    peers = [r for r in rows if r.system != SHMCHAN and not r.reference]
    return max(peers, key=lambda r: _goodness(r, r.median), default=None)


def median_ratio(results: list[Result], a: tuple[str, str], b: tuple[str, str]) -> float | None:
    """The median of row a = (workload, system) over that of row b; None if either is
    missing (not measured in this run)."""
    ra, rb = find_result(results, *a), find_result(results, *b)
    return None if ra is None or rb is None or rb.median == 0 else ra.median / rb.median


def core_targets(results: list[Result]) -> list[Target]:
    def med(workload: str, system: str) -> float | None:
        r = find_result(results, workload, system)
        return None if r is None else r.median

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    out = []
    for name, workload, goal, what in (
        ("unbatched", "unbatched_p1", 1.2, "send(1 key)/recv/payload/release, 1 producer"),
        ("batched", "batched", 3.0, "send_many of (payload, key)/recv_many/release_many"),
    ):
        peer = best_peer(results, workload)
        out.append(
            Target(
                f"64 B {name}: shmchan / best peer",
                ratio(med(workload, SHMCHAN), None if peer is None else peer.median),
                goal,
                ">=",
                f"{what} vs the best peer of the case"
                + ("" if peer is None else f" (this run: {peer.system})"),
            )
        )
    shm_batched = med("batched", SHMCHAN)
    out.append(
        Target(
            "64 B batched: shmchan msg/s",
            shm_batched,
            2e6,
            ">=",
            "absolute rate with send_many/recv_many",
        )
    )
    out.append(
        Target(
            "1 MiB: shmchan / memcpy ceiling",
            ratio(med("1mib", SHMCHAN), med("1mib", COPY)),
            0.5,
            ">=",
            "bandwidth vs a plain copy into shared memory, same run",
        )
    )
    out.append(
        Target(
            "100k parked: cost / no backlog",
            ratio(med("dispatch_parked", SHMCHAN), med("dispatch_free", SHMCHAN)),
            1.2,
            "<=",
            "send->recv->release of a free-key message, 100k parked on a held key vs none",
        )
    )
    out.append(
        Target(
            "idle wake-up median: shmchan / semaphore",
            ratio(med("latency_median", SHMCHAN), med("latency_median", SEMAPHORE)),
            2.0,
            "<=",
            "send->recv of an idle consumer vs a bare posix_ipc semaphore ping-pong",
        )
    )
    return out


def number(value: float, unit: str) -> str:
    if unit == "msg/s":
        if value >= 1e6:
            return f"{value / 1e6:.2f} M"
        if value >= 1e3:
            return f"{value / 1e3:.1f} k"
        return f"{value:.0f}"
    if unit == "MiB/s":
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def target_text(t: dict[str, Any], compact: bool = False) -> tuple[str, str]:
    """A target's measured value and goal as shown: a rate for names ending in "msg/s",
    a percentage for names ending in "%", microseconds for " us", else a ratio."""

    def show(v: float, fmt: str) -> str:
        if t["name"].endswith("msg/s"):
            return f"{v / 1e6:{fmt}} M/s" if compact else number(v, "msg/s") + " msg/s"
        if t["name"].endswith("%"):
            return f"{v:{fmt}} %"
        if t["name"].endswith(" us"):  # an absolute latency
            return number(v, "us") + " us"
        return f"{v:{fmt}}x"

    measured = "not measured" if t["measured"] is None else show(t["measured"], ".2f")
    return measured, show(t["target"], "g")


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: machine, results table, targets."""
    m = report["machine"]
    lines = [
        f"shmchan bench ({'quick' if report['quick'] else 'full'} run, "
        f"{report['repetitions']} repetitions each; median [min - max]; {report['seconds']} s)",
        f"machine: {m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} "
        f"logical CPUs, {m['implementation']} {m['python']}, Linux {m['kernel']}",
    ]
    if m.get("revision"):
        lines.append(f"shmchan {m['versions']['shmchan']} at {m['revision']}")
    load = m["loadavg_at_start"][0]
    if load > 0.5 * max(m["usable_cpus"], 1):
        lines.append(
            f"WARNING: load average {load:.2f} at start on {m['usable_cpus']} CPUs: other work "
            "was running, so figures and ratios may be noisy. Re-run on an idle machine."
        )
    for s in report["skipped"]:
        lines.append(f"note: {s['system']} skipped: {s['reason']}")
    lines.append("")
    header = ("workload", "system", "median", "min", "max", "unit", "vs best peer", "notes")
    rows: list[tuple[str, ...]] = []
    last = None
    for r in report["results"]:
        label = r["label"] if r["label"] != last else ""
        last = r["label"]
        rows.append(
            (
                label,
                r["system"] + (" (ref)" if r["reference"] else ""),
                number(r["median"], r["unit"]),
                number(r["min"], r["unit"]),
                number(r["max"], r["unit"]),
                r["unit"],
                _ratio(r["vs_best_peer"]),
                r["note"],
            )
        )
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4, 6}

    def fmt(row: Sequence[str]) -> str:
        cells = [
            row[i].rjust(widths[i]) if i in right else row[i].ljust(widths[i])
            for i in range(len(row))
        ]
        return "  ".join(cells).rstrip()

    lines.append(fmt(header))
    lines.append(fmt(["-" * w for w in widths]))
    for i, row in enumerate(rows):
        if row[0] and i:
            lines.append("")
        lines.append(fmt(row))
    lines.append("")
    lines.append(
        "vs best peer: the row's median over the best peer's (every system but shmchan and "
        "the (ref) rows) for that workload; > 1 means better (faster, or lower latency / cost)."
    )
    checked = sum(r["checked"] for r in report["results"])
    lines.append(
        f"Verified: {checked:,} messages arrived exactly once with intact payloads "
        "(index, producer, check bytes)."
    )
    for r in report["results"]:
        if r["out_of_order"]:
            lines.append(
                f"order: {r['system']} handed out {r['out_of_order']:,} of {r['checked']:,} "
                f"messages in '{r['label']}' after a later message of the same producer"
            )
    if any(r["out_of_order"] for r in report["results"]):
        lines.append(
            "  (with several producers sharing keys this is allowed: a message waits behind "
            "another producer's earlier message on its key while its successor's key is free)"
        )
    lines.append("")
    lines.append("Targets (ratios of medians from this run):")
    tw = max(len(t["name"]) for t in report["targets"]) if report["targets"] else 0
    for t in report["targets"]:
        value, goal = target_text(t)
        verdict = "" if t["measured"] is None else "met" if t["met"] else "NOT met"
        lines.append(
            f"  {t['name']:<{tw}}  {value:>13}  target {t['comparison']} {goal:<12} {verdict:<8}"
            f"  ({t['detail']})"
        )
    return "\n".join(lines)
