"""`--plot FILE.png`: one panel per workload family (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shmchan.bench.common import COPY, FFIFO, MPQ, NAIVE, SEMAPHORE, SHMCHAN, ZEROQ, ZMQ
from shmchan.bench.registry import groups
from shmchan.bench.report import target_text

COLORS = {
    SHMCHAN: "#1f77b4",
    MPQ: "#ff7f0e",
    FFIFO: "#2ca02c",
    NAIVE: "#d62728",
    ZEROQ: "#9467bd",
    ZMQ: "#8c564b",
    COPY: "#7f7f7f",
    SEMAPHORE: "#7f7f7f",
}


def curve(ax: Any, rows: list[dict[str, Any]], prefix: str) -> bool:
    """Draw the rows whose workload is `prefix` + a number as one line per system, x being
    that number (median, with min - max as error bars); False if there is none."""
    lines: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in rows:
        if r["workload"].startswith(prefix):
            lines.setdefault(r["system"], []).append((int(r["workload"][len(prefix) :]), r))
    for system, pts in lines.items():
        pts.sort()
        ax.errorbar(
            [p for p, _ in pts],
            [r["median"] for _, r in pts],
            yerr=[
                [r["median"] - r["min"] for _, r in pts],
                [r["max"] - r["median"] for _, r in pts],
            ],
            marker="o",
            capsize=3,
            label=system,
            color=COLORS.get(system),
        )
    if lines:
        ax.set_xticks(sorted({p for pts in lines.values() for p, _ in pts}))
        ax.legend(fontsize=8)
        ax.set_yscale("log")
    return bool(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """A PNG with one panel per workload family (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"]]

    def rows(pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for r in results if pred(r)]

    def bars(
        ax: Any, sel: list[dict[str, Any]], title: str, ylabel: str, log: bool = False
    ) -> None:
        if not sel:
            ax.set_visible(False)
            return
        xs = range(len(sel))
        med = [r["median"] for r in sel]
        err = [[r["median"] - r["min"] for r in sel], [r["max"] - r["median"] for r in sel]]
        ax.bar(xs, med, yerr=err, capsize=3, color=[COLORS.get(r["system"], "#999") for r in sel])
        ax.set_xticks(list(xs), [_short(r) for r in sel], rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")

    # Six fixed panels, then one per registered group that ran and draws one (registry.py).
    extra = [g.panel for g in groups() if g.panel is not None and g.name in report["workloads"]]
    nrows = 2 + (len(extra) + 2) // 3
    fig, axes = plt.subplots(nrows, 3, figsize=(15, 4.5 * nrows), squeeze=False)
    for i, panel in enumerate(extra):
        panel(axes[2 + i // 3][i % 3], results)
    for i in range(len(extra), (nrows - 2) * 3):
        axes[2 + i // 3][i % 3].set_visible(False)
    ax = axes[0][0]
    sel = rows(lambda r: r["workload"] in ("unbatched_p1", "batched"))
    bars(ax, sel, "64 B payloads, 1 producer (msg/s)", "messages / s", log=True)

    ax = axes[0][1]
    curve(ax, results, "unbatched_p")
    ax.set_title("64 B unbatched: aggregate rate vs producers", fontsize=10)
    ax.set_xlabel("producer processes")
    ax.set_ylabel("messages / s")

    bars(axes[0][2], rows(lambda r: r["workload"] == "1mib"), "1 MiB payloads (MiB/s)", "MiB / s")
    bars(
        axes[1][0],
        rows(lambda r: r["workload"] in ("dispatch_free", "dispatch_parked")),
        "free-key dispatch cost, no backlog vs 100k parked",
        "µs / message",
        log=True,
    )
    bars(
        axes[1][1],
        rows(lambda r: r["workload"] in ("latency_median", "latency_p99")),
        "idle consumer wake-up latency",
        "µs",
    )
    ax = axes[1][2]
    ax.axis("off")
    text = ["Targets (this run)"]
    for t in report["targets"]:
        if t["measured"] is None:
            text.append(f"{t['name']}: not measured")
            continue
        shown, goal = target_text(t, compact=True)
        text.append(
            f"{t['name']}: {shown} ({t['comparison']} {goal}) {'met' if t['met'] else 'NOT met'}"
        )
    m = report["machine"]
    text += ["", f"{m['cpu_model']}, {m['usable_cpus']} CPUs, Python {m['python']}"]
    ax.text(0, 1, "\n".join(text), va="top", fontsize=8, family="monospace", wrap=True)
    fig.suptitle(
        f"shmchan bench ({'quick' if report['quick'] else 'full'} run, {report['started']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(r: dict[str, Any]) -> str:
    w = r["workload"]
    suffix = {
        "batched": " batched",
        "unbatched_p1": "",
        "dispatch_free": " none",
        "dispatch_parked": " parked",
        "latency_median": " p50",
        "latency_p99": " p99",
    }.get(w, "")
    return str(r["system"]) + suffix
