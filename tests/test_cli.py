"""The command line, run as a user runs it: `python -m shmchan ls / stat / rm / bench`."""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from procs import child_env, run_shmchan

import shmchan
from shmchan import cli, inspect

TIMEOUT = 60  # seconds; generous, a command normally takes well under one


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_shmchan(*args, timeout=TIMEOUT)


@pytest.fixture
def channel(make_channel: Callable[..., shmchan.Channel]) -> shmchan.Channel:
    """A 1 MiB channel holding three queued messages (removed by conftest's fixtures)."""
    ch = make_channel()
    with ch.sender() as tx:
        for i in range(3):
            tx.send(b"x" * 10, keys=(f"k{i}",))
    return ch


def assert_user_error(result: subprocess.CompletedProcess[str], words: str) -> None:
    assert result.returncode == 1, result
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------------------- usage


def test_help_lists_every_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result
    for command in ("ls", "stat", "rm", "demo", "bench"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command


def test_missing_command_is_a_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_unknown_command_is_a_usage_error() -> None:
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


# --------------------------------------------------------------------------- ls


def assert_ls_ok(result: subprocess.CompletedProcess[str], name: str) -> None:
    """`ls` succeeded for `name`; other people's channels may fail to open (exit code 1)."""
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        assert result.returncode == 1, result
        assert name not in result.stderr, result


def test_ls_shows_capacity_used_and_queued(channel: shmchan.Channel) -> None:
    result = run_cli("ls")
    assert_ls_ok(result, channel.name)
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["NAME", "CAPACITY", "COMMITTED", "USED", "QUEUED"]
    row = next(line for line in lines if line.split()[0] == channel.name)
    assert cli._human_bytes(channel.capacity) in row
    queued = lines[0].index("QUEUED")
    assert row[queued:].split()[0] == "3"
    used = channel.stats().used_bytes
    assert used > 0
    assert cli._human_bytes(used) in row


def test_ls_age_is_the_time_since_the_channel_was_created(channel: shmchan.Channel) -> None:
    # Writing to the segment changes its file times; the age must not follow them.
    old = time.time() - 3 * 3600
    os.utime(inspect.segment_path(channel.name), (old, old))
    with channel.sender() as tx:
        tx.send(b"y", keys=("k",))
    assert time.time() - channel.created < 60
    result = run_cli("ls")
    assert_ls_ok(result, channel.name)
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.split()[0] == channel.name)
    age = row[lines[0].index("AGE") :].split()
    assert age[1] == "s", row  # seconds, not the 3 hours the file's times say


def test_ls_shows_the_committed_bytes_of_the_segment(channel: shmchan.Channel) -> None:
    result = run_cli("ls")
    assert_ls_ok(result, channel.name)
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.split()[0] == channel.name)
    committed = os.stat(inspect.segment_path(channel.name)).st_blocks * 512
    start = lines[0].index("COMMITTED")
    assert row[start:].split()[:2] == cli._human_bytes(committed).split()


def test_rm_removes_an_exchange(chan_name: str) -> None:
    shmchan.Exchange.create(chan_name).close()
    gc.collect()
    result = run_cli("rm", chan_name)
    assert result.returncode == 0, result
    assert result.stdout == f"removed exchange {chan_name}\n"
    assert chan_name not in shmchan.list_exchanges()


def test_rm_refuses_an_exchange_in_use(chan_name: str) -> None:
    ex = shmchan.Exchange.create(chan_name)
    try:
        assert_user_error(run_cli("rm", chan_name), "still open in live processes")
        assert chan_name in shmchan.list_exchanges()
        assert run_cli("rm", "--exchange", "--force", chan_name).returncode == 0
        assert chan_name not in shmchan.list_exchanges()
    finally:
        ex.close()


def test_rm_of_a_name_that_is_both_asks_which(channel: shmchan.Channel) -> None:
    name = channel.name
    shmchan.Exchange.create(name).close()
    try:
        result = run_cli("rm", name)
        assert_user_error(result, "names both a channel and an exchange")
        assert f"shmchan rm --exchange {name}" in result.stderr
        assert name in shmchan.list_exchanges() and name in shmchan.list_channels()
        assert run_cli("rm", "--exchange", name).returncode == 0
        assert name not in shmchan.list_exchanges()
        assert name in shmchan.list_channels()
    finally:
        if name in shmchan.list_exchanges():
            shmchan.unlink_exchange(name)


def test_creating_over_a_leftover_names_the_command_that_removes_it(chan_name: str) -> None:
    code = f"import shmchan, os; shmchan.Channel.create({chan_name!r}); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT, env=child_env())
    with pytest.raises(shmchan.ChannelExists, match=f"leftover.*shmchan rm {chan_name}"):
        shmchan.Channel.create(chan_name)


def test_creating_a_name_in_use_does_not_call_it_a_leftover(channel: shmchan.Channel) -> None:
    with pytest.raises(shmchan.ChannelExists) as info:
        shmchan.Channel.create(channel.name)
    assert "leftover" not in str(info.value)
    assert "Channel.open" in str(info.value)


def test_unlink_after_close_points_to_unlink_by_name(chan_name: str) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=1 << 16)
    ch.close()
    with pytest.raises(shmchan.Closed, match=rf"shmchan\.unlink\('{chan_name}'\)"):
        ch.unlink()
    shmchan.unlink(chan_name)


def test_ls_stops_listing_a_removed_channel(channel: shmchan.Channel) -> None:
    channel.unlink()
    result = run_cli("ls")
    assert_ls_ok(result, channel.name)
    assert channel.name not in result.stdout


# --------------------------------------------------------------------------- stat


def test_stat_json_reports_the_channels_stats(channel: shmchan.Channel) -> None:
    result = run_cli("stat", channel.name, "--json")
    assert result.returncode == 0, result
    sample = json.loads(result.stdout)
    data = sample["stats"]
    field_names = {f.name for f in dataclasses.fields(shmchan.Stats)}
    assert set(data) == field_names
    assert sample["name"] == channel.name
    assert data["capacity"] == channel.capacity
    assert data["queued"] == 3
    assert data["sent"] == 3
    assert data["inflight"] == 0


def test_stat_text_shows_every_field(channel: shmchan.Channel) -> None:
    result = run_cli("stat", channel.name)
    assert result.returncode == 0, result
    assert re.search(rf"^channel\s+{re.escape(channel.name)}$", result.stdout, re.M)
    for field in dataclasses.fields(shmchan.Stats):
        assert re.search(rf"^{field.name}\s+\S", result.stdout, re.M), field.name
    assert re.search(r"^queued\s+3$", result.stdout, re.M)


def test_stat_watch_samples_until_interrupted(channel: shmchan.Channel) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmchan", "stat", channel.name, "--json", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the first sample (or exit)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err  # interrupted, as every command
    samples = [json.loads(line) for line in (first + rest).splitlines()]
    assert len(samples) >= 2
    assert all(s["stats"]["queued"] == 3 and s["name"] == channel.name for s in samples)
    assert samples[-1]["time"] > samples[0]["time"]
    assert "Traceback" not in err


def test_stat_watch_stops_when_the_channel_is_removed(channel: shmchan.Channel) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmchan", "stat", channel.name, "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # it is watching
        channel.unlink()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "was removed" in err
    assert "Traceback" not in err


def test_stat_watch_of_a_file_backed_channel_keeps_watching(tmp_path, chan_name: str) -> None:
    path = tmp_path / "chan"
    ch = shmchan.Channel.create(chan_name, capacity=1 << 16, path=path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmchan", "stat", chan_name, "--path", str(path)]
        + ["--json", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # three samples, not an exit
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ch.close()
        shmchan.unlink(chan_name, path=path)
    assert all(json.loads(line)["name"] == chan_name for line in lines), (lines, err)
    assert proc.returncode == 130, err
    assert "Traceback" not in err


@pytest.mark.parametrize("interval", ["inf", "nan", "-1", "1e400"])
def test_stat_watch_rejects_an_interval_that_is_not_a_finite_positive_number(
    channel: shmchan.Channel, interval: str
) -> None:
    result = run_cli("stat", channel.name, "--watch", interval)
    assert result.returncode == 2, result
    assert "must be positive" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["stat", "rm"])
def test_an_invalid_channel_name_is_bad_usage(command: str) -> None:
    result = run_cli(command, "no/slashes")
    assert result.returncode == 2, result
    assert "invalid channel name" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_stat_watch_rejects_a_non_positive_interval(channel: shmchan.Channel) -> None:
    result = run_cli("stat", channel.name, "--watch", "0")
    assert result.returncode == 2
    assert "must be positive" in result.stderr


def test_stat_of_a_missing_channel_fails_cleanly(chan_name: str) -> None:
    assert_user_error(run_cli("stat", chan_name), "no channel named")


# --------------------------------------------------------------------------- rm


def test_rm_removes_the_channel(channel: shmchan.Channel) -> None:
    name = channel.name
    channel.close()  # a channel this process still maps is in use: rm would refuse it
    gc.collect()  # (the mapping goes with the last view of it)
    result = run_cli("rm", name)
    assert result.returncode == 0, result
    assert name not in shmchan.list_channels()
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(name)


def test_rm_of_a_missing_channel_fails_cleanly(chan_name: str) -> None:
    assert_user_error(run_cli("rm", chan_name), "no channel named")


def test_main_returns_the_exit_code_in_process(
    chan_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = chan_name
    assert cli.main(["rm", name]) == 1
    assert cli.main(["stat", name, "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count(f"no channel named {name!r}") == 2


# --------------------------------------------------------------------------- bench


def test_bench_hands_its_arguments_to_the_benchmark() -> None:
    result = run_cli("bench", "--help")  # arguments after `bench` belong to the benchmark
    assert result.returncode == 0, result
    assert "usage:" in result.stdout
    assert "--report" in result.stdout


# --------------------------------------------------------------------------- install


def test_console_script_points_at_cli_main() -> None:
    try:
        dist = importlib.metadata.distribution("shmchan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("shmchan is not installed (running in place); `pip install .` adds the script")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts.get("shmchan") == "shmchan.cli:main"


def test_creating_an_existing_exchange_names_the_command_that_removes_it(chan_name: str) -> None:
    ex = shmchan.Exchange.create(chan_name)
    try:
        with pytest.raises(shmchan.ExchangeExists, match=f"shmchan rm --exchange {chan_name}"):
            shmchan.Exchange.create(chan_name)
    finally:
        ex.close()
        ex.unlink()
