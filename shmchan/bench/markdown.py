"""`--report DIR`: a saved run for the documentation -- Markdown tables, the plot, the JSON.

DIR gets three files, all rewritten by every run:

* results.md   the machine, the date, the command that reproduces the run, the results
               table and the targets table (a Markdown fragment the performance page
               includes), and the plot below them;
* bench.png    the plot (the same as `--plot`);
* report.json  the whole report (the same as `--json`, less the git revision), for anyone
               who wants the samples.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from typing import Any

from shmchan.bench.report import number, target_text

RESULTS = "results.md"
PLOT = "bench.png"
JSON = "report.json"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _machine_lines(report: dict[str, Any], command: str) -> list[str]:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(m["versions"].items()))
    load = ", ".join(f"{x:g}" for x in m["loadavg_at_start"])
    kind = "quick" if report["quick"] else "full"
    return [
        "| | |",
        "| --- | --- |",
        f"| date | {report['started']} |",
        f"| command | `{command}` |",
        f"| run | {kind}, {report['repetitions']} repetitions per figure, {report['seconds']} s |",
        f"| CPU | {_cell(m['cpu_model'])}, {m['usable_cpus']} usable of "
        f"{m['logical_cpus']} logical CPUs |",
        f"| load average at start | {load} |",
        f"| Python | {m['implementation']} {m['python']} |",
        f"| kernel | Linux {m['kernel']} |",
        f"| versions | {versions} |",
    ]


def results_markdown(report: dict[str, Any], command: str) -> str:
    """The Markdown fragment: machine facts, results table, targets table, plot."""
    lines = [
        "<!-- Written by `python -m shmchan bench --report`; regenerate, do not edit. -->",
        "",
        "### The run",
        "",
        *_machine_lines(report, command),
    ]
    for s in report["skipped"]:
        lines += ["", f"{s['system']} was skipped: {s['reason']}."]
    lines += [
        "",
        "### Results",
        "",
        "Median of the repetitions, with the smallest and largest; *vs best peer* is the "
        "median over the best peer's for the same workload (above 1 is better).",
        "",
        "| workload | system | median | min | max | unit | vs best peer | notes |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    last = None
    for r in report["results"]:
        label = r["label"] if r["label"] != last else ""
        last = r["label"]
        ratio = "-" if r["vs_best_peer"] is None else f"{r['vs_best_peer']:.2f}x"
        system = r["system"] + (" (reference)" if r["reference"] else "")
        cells = [
            label,
            system,
            number(r["median"], r["unit"]),
            number(r["min"], r["unit"]),
            number(r["max"], r["unit"]),
            r["unit"],
            ratio,
            r["note"],
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if report["targets"]:
        lines += [
            "",
            "### Targets",
            "",
            "| target | measured | goal | verdict | what |",
            "| --- | ---: | --- | --- | --- |",
        ]
        for t in report["targets"]:
            value, goal = target_text(t)
            verdict = "-" if t["met"] is None else "met" if t["met"] else "**not met**"
            cells = [t["name"], value, f"{t['comparison']} {goal}", verdict, t["detail"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "### Chart", "", f"![Benchmark chart of this run]({PLOT})", ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], directory: str, argv: Sequence[str]) -> list[str]:
    """Write results.md, bench.png and report.json into `directory` (made if missing);
    returns the paths written. `argv` is the benchmark's own arguments, shown as the
    command that reproduces the run."""
    from shmchan.bench.plot import plot  # matplotlib: only when a report is asked for

    os.makedirs(directory, exist_ok=True)
    command = shlex.join(["python", "-m", "shmchan", "bench", *argv])
    paths = [os.path.join(directory, name) for name in (RESULTS, PLOT, JSON)]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(results_markdown(report, command))
    plot(report, paths[1])
    # The docs describe a version, not a checkout: the git revision stays out of them.
    saved = report | {"machine": {k: v for k, v in report["machine"].items() if k != "revision"}}
    with open(paths[2], "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
        f.write("\n")
    return paths
