"""`--runs N`: the same selection run N times back to back, and how far it moved.

One run's figures are medians over its repetitions, and the min / max beside them show
the spread within that run. A shared machine also drifts between runs (other tenants,
frequency, page cache), which a single run cannot show. With `--runs N` the whole
selection runs N times; the last run is printed in full, followed by the spread of every
row's median and of every target's measured value over the N runs, and how many runs
met each target.
"""

from __future__ import annotations

import statistics
from typing import Any

from shmchan.bench.report import number, target_text


def spread(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every row's median and every target's value, per run (None where not measured)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    targets: dict[str, dict[str, Any]] = {}
    for i, report in enumerate(reports):
        for r in report["results"]:
            row = rows.setdefault(
                (r["workload"], r["system"]),
                {
                    "workload": r["workload"],
                    "label": r["label"],
                    "system": r["system"],
                    "unit": r["unit"],
                    "medians": [None] * len(reports),
                },
            )
            row["medians"][i] = r["median"]
        for t in report["targets"]:
            entry = targets.setdefault(
                t["name"],
                {
                    "name": t["name"],
                    "target": t["target"],
                    "comparison": t["comparison"],
                    "measured": [None] * len(reports),
                    "met": [None] * len(reports),
                },
            )
            entry["measured"][i] = t["measured"]
            entry["met"][i] = t["met"]
    return {"runs": len(reports), "rows": list(rows.values()), "targets": list(targets.values())}


def format_spread(s: dict[str, Any]) -> str:
    """The spread as text: each row's median over the runs [min - max], then the targets."""
    lines = [f"Spread over {s['runs']} runs (each run's median; median of them [min - max]):", ""]
    last = None
    table: list[tuple[str, ...]] = []
    for row in s["rows"]:
        seen = [v for v in row["medians"] if v is not None]
        if not seen:
            continue
        unit = row["unit"]
        label = row["label"] if row["label"] != last else ""
        last = row["label"]
        table.append(
            (
                label,
                row["system"],
                number(statistics.median(seen), unit),
                number(min(seen), unit),
                number(max(seen), unit),
                unit,
                f"{len(seen)} of {s['runs']}" if len(seen) < s["runs"] else "",
            )
        )
    header = ("workload", "system", "median", "min", "max", "unit", "")
    widths = [max(len(x[i]) for x in [header, *table]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths[:-1]) + ("",), *table]:
        cells = [
            row[i].rjust(widths[i]) if i in (2, 3, 4) else row[i].ljust(widths[i])
            for i in range(len(row))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append(f"Targets over {s['runs']} runs (the value each run measured):")
    measured_targets = [t for t in s["targets"] if any(m is not None for m in t["met"])]
    shown = {
        t["name"]: [
            "-" if v is None else target_text({**t, "measured": v}, compact=True)[0]
            for v in t["measured"]
        ]
        for t in measured_targets
    }
    tw = max((len(t["name"]) for t in measured_targets), default=0)
    vw = max((len(v) for vs in shown.values() for v in vs), default=0)
    for t in measured_targets:
        values = " ".join(v.rjust(vw) for v in shown[t["name"]])
        met = sum(1 for m in t["met"] if m)
        measured = sum(1 for m in t["met"] if m is not None)
        goal = target_text({**t, "measured": None})[1]
        lines.append(
            f"  {t['name']:<{tw}}  {values}  target {t['comparison']} {goal:<12}"
            f"  met in {met} of {measured}"
        )
    return "\n".join(lines)
