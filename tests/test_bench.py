"""`python -m shmchan bench`: runs end to end and reports well-formed figures.

These tests check the benchmark's output, never its speed: a benchmark is not a timed
test. One `--quick --json --plot` run (a few seconds on 2 cores) is shared by the tests
that read its report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shmchan
from shmchan import bench
from shmchan.bench import registry

RUN_TIMEOUT = 900  # seconds; a quick run takes 1-2 min on 2 idle cores (6 at load 13): a hang
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 30)  # the shared run counts toward one test
HAS_FASTER_FIFO = importlib.util.find_spec("faster_fifo") is not None
HAS_ZEROQ = importlib.util.find_spec("zeroq") is not None
HAS_ZMQ = importlib.util.find_spec("zmq") is not None
# The optional peers this machine has, as the report names them.
OPTIONAL = [
    system
    for system, present in (
        (bench.FFIFO, HAS_FASTER_FIFO),
        (bench.ZEROQ, HAS_ZEROQ),
        (bench.ZMQ, HAS_ZMQ),
    )
    if present
]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _env() -> dict[str, str]:
    """Make the child import the same shmchan as this test process (installed or in place)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _leftovers(pid: int) -> list[str]:
    """/dev/shm entries (segments, semaphores) the bench process `pid` left behind."""
    tag = f"bench-{pid}-"
    return [n for n in os.listdir("/dev/shm") if tag in n]


class QuickRun:
    def __init__(self, report: dict[str, Any], pid: int, plot: Path, stderr: str) -> None:
        self.report = report
        self.pid = pid
        self.plot = plot
        self.stderr = stderr
        self.docs = plot.parent / "docs"  # --report DIR


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    plot = tmp_path_factory.mktemp("bench") / "bench.png"
    args = [sys.executable, "-m", "shmchan", "bench", "--quick", "--json"]
    if HAS_MATPLOTLIB:
        args += ["--plot", str(plot), "--report", str(plot.parent / "docs")]
    report, pid, err = _run_json(args)
    return QuickRun(report, pid, plot, err)


def _run_json(args: list[str]) -> tuple[dict[str, Any], int, str]:
    """Run a `bench ... --json` command, bounded: (its report, its pid, its stderr)."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args[1:])} did not finish in {RUN_TIMEOUT} s\n{err}")
    assert proc.returncode == 0, err
    return json.loads(out), proc.pid, err


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# --------------------------------------------------------------------------- the report


def test_quick_json_report_has_its_sections(quick_run: QuickRun) -> None:
    r = quick_run.report
    assert r["schema"] == bench.SCHEMA
    assert r["quick"] is True
    assert r["repetitions"] == bench.QUICK.reps
    for key in (
        "started",
        "seconds",
        "machine",
        "sizes",
        "systems",
        "skipped",
        "results",
        "targets",
    ):
        assert key in r, key
    assert r["workloads"] == list(bench.WORKLOADS)


def test_machine_description_names_cpu_cores_and_python(quick_run: QuickRun) -> None:
    m = quick_run.report["machine"]
    assert m["cpu_model"]
    assert m["usable_cpus"] >= 1 and m["logical_cpus"] >= m["usable_cpus"]
    assert m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert len(m["loadavg_at_start"]) == 3


def test_every_result_row_is_well_formed(quick_run: QuickRun) -> None:
    with_peers = {
        row["workload"]
        for row in quick_run.report["results"]
        if row["system"] != bench.SHMCHAN and not row["reference"]
    }
    for row in quick_run.report["results"]:
        assert row["unit"] in ("msg/s", "MiB/s", "us", "us/msg", "%", "ns"), row
        assert len(row["samples"]) == bench.QUICK.reps, row
        assert all(_positive(x) for x in row["samples"]), row
        assert row["min"] <= row["median"] <= row["max"], row
        assert _positive(row["median"]), row
        assert isinstance(row["out_of_order"], int) and row["out_of_order"] >= 0
        if row["reference"] or row["workload"] not in with_peers:
            assert row["vs_best_peer"] is None
        else:
            assert _positive(row["vs_best_peer"]), row


def test_every_workload_ran_through_shmchan_and_its_peers(quick_run: QuickRun) -> None:
    rows = {(row["workload"], row["system"]) for row in quick_run.report["results"]}
    peers = [bench.MPQ, *OPTIONAL]
    for n in bench.QUICK.producers:
        for system in [bench.SHMCHAN, bench.NAIVE, *peers]:
            assert (f"unbatched_p{n}", system) in rows
    for system in [bench.SHMCHAN, bench.NAIVE, *peers]:
        assert ("batched", system) in rows
    for system in [bench.SHMCHAN, bench.COPY, *peers]:
        assert ("1mib", system) in rows
    for workload in ("dispatch_free", "dispatch_parked"):
        assert (workload, bench.SHMCHAN) in rows and (workload, bench.NAIVE) in rows
    for workload in ("latency_median", "latency_p99"):
        for system in [bench.SHMCHAN, bench.SEMAPHORE, *peers]:
            assert (workload, system) in rows
    for n in bench.QUICK.fill_producers:
        for system in [bench.SHMCHAN] + ([bench.FFIFO] if HAS_FASTER_FIFO else []):
            assert (f"fill_p{n}", system) in rows
    for workload in ("channel_small", "channel_big", "idle_cpu"):
        assert (workload, bench.SHMCHAN) in rows
    fast = [p for p in (bench.ZEROQ, bench.ZMQ) if p in OPTIONAL]
    for system in [bench.SHMCHAN, bench.COPY, *fast]:
        assert ("batch_api", system) in rows
    for case in ("unbatched_p1",):  # what --quick runs busy
        for system in [bench.SHMCHAN, *peers]:
            for suffix in ("", "_busy", "_retained"):
                assert (f"contention_{case}{suffix}", system) in rows
    for workload in ("percall_send", "percall_recv"):
        for system in [bench.SHMCHAN, *peers]:
            assert (workload, system) in rows
    assert ("percall_floor", "3 trivial C calls") in rows


def test_best_peer_of_each_workload_has_ratio_one(quick_run: QuickRun) -> None:
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for row in quick_run.report["results"]:
        if row["system"] != bench.SHMCHAN and not row["reference"]:
            by_workload.setdefault(row["workload"], []).append(row)
    for workload, peers in by_workload.items():
        assert max(p["vs_best_peer"] for p in peers) == pytest.approx(1.0), workload


def test_each_optional_peer_is_run_or_skipped_with_a_note(quick_run: QuickRun) -> None:
    r = quick_run.report
    skipped = {s["system"] for s in r["skipped"]}
    for system in (bench.FFIFO, bench.ZEROQ, bench.ZMQ):
        assert (system in r["systems"]) == (system in OPTIONAL)
        assert (system in skipped) == (system not in OPTIONAL)


@pytest.mark.skipif(
    not (HAS_ZEROQ and HAS_ZMQ), reason="zeroq or pyzmq not installed (pip install .[bench])"
)
def test_zeroq_and_pyzmq_are_ranked_as_peers(quick_run: QuickRun) -> None:
    """With them installed, the best peer of the unbatched case is one of the runs' peers
    and shmchan's ratio is taken against it, whichever it is."""
    rows = [r for r in quick_run.report["results"] if r["workload"] == "unbatched_p1"]
    best = max((r for r in rows if r["system"] != bench.SHMCHAN), key=lambda r: r["median"])
    shm = next(r for r in rows if r["system"] == bench.SHMCHAN)
    assert shm["vs_best_peer"] == pytest.approx(shm["median"] / best["median"])
    target = next(
        t for t in quick_run.report["targets"] if t["name"] == "64 B unbatched: shmchan / best peer"
    )
    assert f"this run: {best['system']}" in target["detail"]


def test_the_bench_runs_with_every_optional_peer_missing() -> None:
    """A machine without faster-fifo, zeroq and pyzmq: their imports fail, the run still
    completes, names each of them as not installed, and ranks against mp.Queue."""
    code = (
        "import sys; sys.modules.update(faster_fifo=None, zeroq=None, zmq=None); "
        "from shmchan.bench import main; "
        "raise SystemExit(main(sys.argv[1:]))"
    )
    args = [sys.executable, "-c", code, "--quick", "--reps", "1", "--json"]
    report, pid, _ = _run_json([*args, "--only", "unbatched", "--only", "percall"])
    assert report["systems"] == [bench.SHMCHAN, bench.MPQ, bench.NAIVE]
    assert {s["system"]: s["reason"] for s in report["skipped"]} == {
        system: "not installed (pip install 'shmchan[bench]')"
        for system in (bench.FFIFO, bench.ZEROQ, bench.ZMQ)
    }
    assert {r["system"] for r in report["results"]} <= {
        bench.SHMCHAN,
        bench.MPQ,
        bench.NAIVE,
        "3 trivial C calls",
        "empty loop",
    }
    text = bench.format_table(report)
    for system in (bench.FFIFO, bench.ZEROQ, bench.ZMQ):
        assert f"note: {system} skipped: not installed" in text
    assert _leftovers(pid) == []


def test_every_target_is_measured_with_a_verdict(quick_run: QuickRun) -> None:
    targets = quick_run.report["targets"]
    names = [t["name"] for t in targets]
    assert len(names) == len(set(names))
    for name in (
        "64 B unbatched: shmchan / best peer",
        "64 B batched: shmchan / best peer",
        "per call: recv+release / best peer's get",
        "busy machine, 64 B unbatched, 1 producer: kept / best peer's",
        "idle wake-up p99: shmchan / semaphore",
        "full ring: fewest of 2/4/8 producers / 1",
        "big channel / small channel",
        "idle receiver CPU %",
        "64 B batch API: shmchan msg/s",
        "64 B batch API / unbatched",
        "64 B send_many/recv_many: msg/s",
    ):
        assert name in names
    for t in targets:
        assert _positive(t["measured"]), t
        assert _positive(t["target"]), t
        assert t["comparison"] in (">=", "<=")
        expected = (
            t["measured"] >= t["target"]
            if t["comparison"] == ">="
            else (t["measured"] <= t["target"])
        )
        assert t["met"] is expected


def test_the_run_leaves_no_channels_or_semaphores_behind(quick_run: QuickRun) -> None:
    assert _leftovers(quick_run.pid) == []


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="--plot needs matplotlib")
def test_plot_is_a_png(quick_run: QuickRun) -> None:
    assert quick_run.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="--report draws its chart with matplotlib")
def test_report_dir_holds_the_tables_the_chart_and_the_json(quick_run: QuickRun) -> None:
    page = (quick_run.docs / "results.md").read_text()
    r = quick_run.report
    assert f"| date | {r['started']} |" in page
    assert "| command | `python -m shmchan bench --quick --json --plot " in page
    for row in r["results"]:
        assert f"| {row['system']}" in page
    for t in r["targets"]:
        assert f"| {t['name']} |" in page
    assert "![Benchmark chart of this run](bench.png)" in page
    assert (quick_run.docs / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((quick_run.docs / "report.json").read_text())
    assert saved["results"] == r["results"]
    assert "revision" not in saved["machine"]


def test_table_shows_every_row_and_target_verdict(quick_run: QuickRun) -> None:
    text = bench.format_table(quick_run.report)
    assert "vs best peer" in text
    for t in quick_run.report["targets"]:
        assert t["name"] in text
    assert text.count("NOT met") + text.count(" met ") >= len(quick_run.report["targets"])
    for system in quick_run.report["systems"]:
        assert system in text


# --------------------------------------------------------------------------- cold start


def test_cold_group_reports_first_messages_and_after_burst_pings_beside_its_peers() -> None:
    args = [sys.executable, "-m", "shmchan", "bench", "--quick", "--only", "cold", "--json"]
    report, pid, _err = _run_json(args)
    assert report["workloads"] == ["cold"]
    rows = {(r["workload"], r["system"]): r for r in report["results"]}
    peers = [bench.SHMCHAN, bench.MPQ] + ([bench.FFIFO] if HAS_FASTER_FIFO else [])
    workloads = ("cold_import", "cold_first", "burst_pause", "burst_nopause")
    expected = {(w, s) for w in workloads for s in peers}
    expected.add(("burst_pause", bench.SEMAPHORE))  # the floor, after the same pause
    assert set(rows) == expected
    for row in rows.values():
        assert row["unit"] == "us"
        assert len(row["samples"]) == bench.QUICK.reps, row
        assert all(_positive(x) for x in row["samples"]), row
        assert row["reference"] is (row["system"] == bench.SEMAPHORE), row
        # Plausible: under the 30 s any blocking call may take (an unsynchronised clock
        # or a unit slip would be off by orders of magnitude).
        assert max(row["samples"]) < 30e6, row
    for s in peers:
        assert _positive(rows["cold_first", s]["vs_best_peer"])
        # The burst of every repetition (and the warm-up) plus its ping were checked.
        for w in ("burst_pause", "burst_nopause"):
            burst = rows[w, s]
            assert burst["checked"] == (bench.QUICK.burst_messages + 1) * (bench.QUICK.reps + 1)
    assert "Channel.open + sender()" in rows["cold_first", bench.SHMCHAN]["note"]
    assert _leftovers(pid) == []


def test_onecpu_group_runs_every_system_on_one_cpu_paced_and_unpaced() -> None:
    args = [sys.executable, "-m", "shmchan", "bench", "--quick", "--only", "onecpu", "--json"]
    report, pid, _err = _run_json(args)
    assert report["workloads"] == ["onecpu"]
    rows = {(r["workload"], r["system"]): r for r in report["results"]}
    systems = [bench.SHMCHAN, bench.MPQ] + [
        s
        for s, present in (
            (bench.FFIFO, HAS_FASTER_FIFO),
            (bench.ZEROQ, HAS_ZEROQ),
            (bench.ZMQ, HAS_ZMQ),
        )
        if present
    ]
    workloads = ("onecpu_paced", "onecpu_unbatched")
    assert set(rows) == {(w, s) for w in workloads for s in systems}
    for w in workloads:
        checked = {rows[w, s]["checked"] for s in systems}
        assert len(checked) == 1 and checked.pop() > 0  # every system sent the same messages
        for s in systems:
            row = rows[w, s]
            assert row["unit"] == "msg/s"
            assert len(row["samples"]) == bench.QUICK.reps, row
            assert all(_positive(x) for x in row["samples"]), row
    assert "only" in rows["onecpu_paced", bench.SHMCHAN]["note"]  # names the CPU
    assert _leftovers(pid) == []


def test_one_cpu_pins_this_process_and_gives_its_cpus_back() -> None:
    from shmchan.bench.onecpu import _one_cpu

    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError), _one_cpu() as cpu:
        assert os.sched_getaffinity(0) == {cpu} and cpu in before
        raise RuntimeError("the group failed")
    assert os.sched_getaffinity(0) == before


# --------------------------------------------------------------------------- command line


def test_help_exits_zero_and_describes_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--quick", "--json", "--plot", "--only", "--reps"):
        assert option in out


def test_bad_usage_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--only", "no-such-workload"]) == 2
    assert bench.main(["--reps", "0"]) == 2
    assert bench.main(["--runs", "0"]) == 2
    capsys.readouterr()


@contextlib.contextmanager
def _extra_group(run_group: Callable[[Any], None]) -> Iterator[None]:
    """Register `run_group` as the group "extra-test" (not run by default), with one
    target "extra target": its first row's median <= 2; unregistered on exit."""

    def targets(results: list[bench.Result]) -> list[bench.Target]:
        return [bench.Target("extra target", results[0].median, 2.0, "<=", "test")]

    bench.register(
        "extra-test", run_group, steps=lambda sizes, nsys: 1, default=False, targets=targets
    )
    try:
        yield
    finally:
        registry.unregister("extra-test")


def test_a_registered_group_is_selected_by_only_and_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[bool] = []

    def run_group(run: Any) -> None:
        calls.append(run.quick)
        run.results.append(
            bench.Result("extra_w", "an extra group", bench.SHMCHAN, "us", False, [1.0] * 2)
        )
        run.progress.step("extra: done")

    with _extra_group(run_group):
        assert "extra-test" not in bench.WORKLOADS  # not run unless asked
        assert bench.main(["--only", "extra-test", "--quick", "--reps", "2", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    assert calls == [True]
    assert report["workloads"] == ["extra-test"]
    assert [r["workload"] for r in report["results"]] == ["extra_w"]
    assert report["targets"][-1]["name"] == "extra target"
    assert report["targets"][-1]["met"] is True


def test_runs_report_the_spread_of_every_figure_and_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    values = iter([3.0, 1.0, 2.0])  # one figure per run: the spread is 1.0 - 3.0

    def run_group(run: Any) -> None:
        run.results.append(
            bench.Result("extra_w", "an extra group", bench.SHMCHAN, "us", False, [next(values)])
        )
        run.progress.step("extra: done")

    with _extra_group(run_group):
        argv = ["--only", "extra-test", "--quick", "--reps", "1", "--runs", "3"]
        assert bench.main([*argv, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        values = iter([3.0, 1.0, 2.0])
        assert bench.main(argv) == 0
        text = capsys.readouterr().out
    assert [r["results"][0]["median"] for r in report["runs"]] == [3.0, 1.0, 2.0]
    (row,) = report["spread"]["rows"]
    assert row["medians"] == [3.0, 1.0, 2.0]
    target = next(t for t in report["spread"]["targets"] if t["name"] == "extra target")
    assert target["measured"] == [3.0, 1.0, 2.0]
    assert target["met"] == [False, True, True]
    assert "Spread over 3 runs" in text
    after = text.split("Spread over 3 runs", 1)[1]
    line = next(x for x in after.splitlines() if x.startswith("an extra group"))
    assert line.split()[-4:] == ["2.00", "1.00", "3.00", "us"]  # median, min, max
    assert "met in 2 of 3" in text


def test_registering_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        bench.register("latency", lambda run: None, steps=lambda sizes, nsys: 0)


# --------------------------------------------------------------------------- the naive peer


def test_naive_dispatcher_skips_messages_whose_keys_are_held() -> None:
    intake: queue.Queue[Any] = queue.Queue()
    for keys, payload in [(("a",), 1), (("a", "b"), 2), (("c",), 3)]:
        intake.put((keys, payload))
    d = bench.NaiveKeyedDispatcher(lambda t: intake.get(timeout=t))
    first = d.recv(1)
    assert first[1] == 1
    assert d.recv(1)[1] == 3  # message 2 waits for "a"; 3 is free
    d.release(first)
    assert d.recv(1)[1] == 2  # from the backlog, once "a" is free
    with pytest.raises(queue.Empty):
        d.recv(0.01)


def test_naive_dispatcher_recv_many_hands_out_only_non_conflicting_messages() -> None:
    batches: queue.Queue[Any] = queue.Queue()
    batches.put([(("a",), 1), (("a",), 2), (("b",), 3)])
    d = bench.NaiveKeyedDispatcher(lambda t: batches.get(timeout=t))
    got = d.recv_many(10, 1)
    assert [m[1] for m in got] == [1, 3]
    for m in got:
        d.release(m)
    assert [m[1] for m in d.recv_many(10, 1)] == [2]
