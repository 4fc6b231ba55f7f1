"""The operators' commands, run as an operator runs them, against a live channel: a key held
by another process, multi-key messages waiting behind it, and a dead letter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from procs import CTX, WAIT, child_env, run_shmchan, running

import shmchan

TIMEOUT = 60


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_shmchan(*args, timeout=TIMEOUT)


def hold_first(name: str, ready: Any, done: Any) -> None:
    """Child: become the receiver, take one message and hold it until `done`."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    h = rx.recv(timeout=WAIT)
    ready.set()
    done.wait(WAIT)
    h.release()
    rx.close()


def create_and_leave(name: str) -> None:
    """Child: make a channel, send to it, and exit without removing it (a leftover)."""
    ch = shmchan.Channel.create(name, capacity=1 << 16)
    ch.sender().send(b"left behind", keys=("x",))


@dataclass
class Scene:
    ch: shmchan.Channel
    holder: int  # pid of the process holding seq 2 (key acct:1)
    seqs: dict[str, int]


@pytest.fixture
def scene(make_channel: Callable[..., shmchan.Channel]) -> Iterator[Scene]:
    """seq 1: a dead letter (acct:9); seq 2 (acct:1) held by another process; seq 3 (acct:1,
    acct:2) and seq 4 (acct:2, acct:3) waiting behind it."""
    ch = make_channel(max_attempts=1)
    tx = ch.sender()
    seqs = {"dead": tx.send(b"bad", keys=("acct:9",))}
    rx = ch.receiver()
    rx.recv(timeout=WAIT).nack()
    rx.close()
    seqs["held"] = tx.send({"deposit": 5}, keys=("acct:1",))
    ready, done = CTX.Event(), CTX.Event()
    p = CTX.Process(target=hold_first, args=(ch.name, ready, done))
    with running(p):
        assert ready.wait(WAIT)
        seqs["first"] = tx.send({"transfer": 1}, keys=("acct:1", "acct:2"))
        seqs["second"] = tx.send({"transfer": 2}, keys=("acct:2", "acct:3"))
        assert p.pid is not None
        yield Scene(ch, p.pid, seqs)
        done.set()


def test_stat_json_reports_held_keys_lines_producers_and_dead_letters(scene: Scene) -> None:
    result = run_cli("stat", scene.ch.name, "--json")
    assert result.returncode == 0, result
    sample = json.loads(result.stdout)
    assert {"stats", "held", "waiting", "producers", "dead_letters"} <= set(sample)
    assert sample["stats"]["inflight"] == 1
    assert sample["stats"]["dead_letters"] == 1
    [held] = sample["held"]
    assert {k: held[k] for k in ("key", "seq", "pid", "attempt")} == {
        "key": "acct:1",
        "seq": scene.seqs["held"],
        "pid": scene.holder,
        "attempt": 1,
    }
    assert 0 <= held["age"] < WAIT
    first, second = scene.seqs["first"], scene.seqs["second"]
    assert sample["waiting"] == [
        {"key": "acct:2", "depth": 2, "head_seq": first},
        {"key": "acct:1", "depth": 1, "head_seq": first},
        {"key": "acct:3", "depth": 1, "head_seq": second},
    ]
    assert {"pid": os.getpid(), "sent": 4} in sample["producers"]
    assert sample["dead_letters"] == [
        {
            "seq": scene.seqs["dead"],
            "keys": ["acct:9"],
            "attempts": 1,
            "reason": "attempts",
            "size": 3,
        }
    ]
    assert set(sample["rates"]) >= {"sent", "delivered", "released"}


def test_stat_text_shows_the_holder_and_the_lines(scene: Scene) -> None:
    result = run_cli("stat", scene.ch.name)
    assert result.returncode == 0, result
    out = result.stdout
    assert re.search(rf"^\s+acct:1\s+{scene.seqs['held']}\s+{scene.holder}\s+1\s", out, re.M)
    assert re.search(rf"^\s+acct:2\s+2\s+{scene.seqs['first']}$", out, re.M)
    assert "dead letters: 1" in out


def test_stat_why_explains_the_chain_in_a_sentence(scene: Scene) -> None:
    s = scene.seqs
    result = run_cli("stat", scene.ch.name, "--why", str(s["second"]))
    assert result.returncode == 0, result
    assert re.fullmatch(
        rf"seq {s['second']} waits on key acct:2 behind seq {s['first']}, which waits on key "
        rf"acct:1 behind seq {s['held']}, held by pid {scene.holder} for [0-9.]+ s, attempt 1\n",
        result.stdout,
    ), result.stdout
    held = run_cli("stat", scene.ch.name, "--why", str(s["held"]))
    assert f"in flight, held by pid {scene.holder}" in held.stdout
    unknown = run_cli("stat", scene.ch.name, "--why", "999999")
    assert unknown.stdout.startswith("seq 999999 is unknown: not sent yet")
    as_json = json.loads(run_cli("stat", scene.ch.name, "--why", str(s["first"]), "--json").stdout)
    assert as_json["state"] == "waiting"
    assert [(w["key"], w["seq"], w["pid"]) for w in as_json["chain"]] == [
        ("acct:1", s["held"], scene.holder)
    ]


def test_stat_prometheus_prints_openmetrics(scene: Scene) -> None:
    result = run_cli("stat", scene.ch.name, "--prometheus")
    assert result.returncode == 0, result
    name = scene.ch.name
    assert f'shmchan_held_keys{{channel="{name}"}} 1.0' in result.stdout
    assert f'shmchan_line_depth_messages{{channel="{name}",key="acct:2"}} 2.0' in result.stdout
    assert f'shmchan_dead_letters{{channel="{name}"}} 1.0' in result.stdout
    assert result.stdout.endswith("# EOF\n")


def test_metrics_collector_reads_a_channel(scene: Scene) -> None:
    from prometheus_client import CollectorRegistry

    from shmchan.metrics import ChannelCollector

    registry = CollectorRegistry()
    registry.register(ChannelCollector([scene.ch.name]))
    labels = {"channel": scene.ch.name}
    assert registry.get_sample_value("shmchan_inflight_messages", labels) == 1
    assert registry.get_sample_value("shmchan_sent_messages_total", labels) == 4
    assert registry.get_sample_value("shmchan_receiver_up", labels) == 1
    age = registry.get_sample_value("shmchan_oldest_held_seconds", labels)
    assert age is not None and age >= 0


def test_ls_shows_the_receiver_and_who_uses_it(scene: Scene) -> None:
    result = run_cli("ls")
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "NAME", "CAPACITY", "COMMITTED", "USED", "QUEUED", "INFLIGHT", "PRODUCERS", "RECEIVER",
        "PAUSED", "AGE", "IN", "USE",
    ]  # fmt: skip
    row = next(line for line in lines if line.split()[0] == scene.ch.name)
    at = lines[0].index("QUEUED")
    assert row[at:].split()[:4] == ["2", "1", "1", str(scene.holder)]
    assert "yes: 2 pids" in row  # this process and the holder map it


def test_rm_refuses_a_channel_in_use_and_names_the_pids(scene: Scene) -> None:
    name = scene.ch.name
    result = run_cli("rm", name)
    assert result.returncode == 1, result
    assert f"pid {scene.holder} (maps it, receiver, holds seq {scene.seqs['held']})" in (
        result.stderr
    )
    assert "--force" in result.stderr
    assert name in shmchan.list_channels()
    forced = run_cli("rm", name, "--force")
    assert forced.returncode == 0, forced
    assert name not in shmchan.list_channels()


def test_rm_stale_removes_leftovers_only(scene: Scene, new_chan_name: Callable[[], str]) -> None:
    leftover = new_chan_name()
    p = CTX.Process(target=create_and_leave, args=(leftover,))
    with running(p):
        p.join(WAIT)
    assert p.exitcode == 0
    assert leftover in shmchan.list_channels()
    listed = run_cli("ls")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(leftover + " "))
    assert row.endswith("no: leftover")
    result = run_cli("rm", "--stale")
    assert result.returncode == 0, result
    assert f"removed {leftover}" in result.stdout
    assert leftover not in shmchan.list_channels()
    assert scene.ch.name in shmchan.list_channels()  # in use: kept
    assert scene.ch.name not in result.stdout


def test_rm_usage_errors_exit_2(scene: Scene) -> None:
    assert run_cli("rm").returncode == 2
    assert run_cli("rm", scene.ch.name, "--stale").returncode == 2


def test_dead_lists_and_resends_a_dead_letter(scene: Scene) -> None:
    name, dead = scene.ch.name, scene.seqs["dead"]
    listing = run_cli("dead", name)
    assert listing.returncode == 0, listing
    header, row = listing.stdout.splitlines()
    assert header.split() == ["SEQ", "KEYS", "ATTEMPTS", "SIZE", "PAYLOAD"]
    assert row.split() == [str(dead), "acct:9", "1", "3", "b'bad'"]
    assert run_cli("dead", name, "--resend", "12345").returncode == 1
    result = run_cli("dead", name, "--resend", str(dead))
    assert result.returncode == 0, result
    match = re.fullmatch(rf"resent dead letter seq {dead} as seq (\d+)\n", result.stdout)
    assert match, result.stdout
    assert scene.ch.dead_letters() == []
    # The receiver (the holder) is not polling: the discard is not reclaimed yet, and
    # still every view of the channel counts no dead letter.
    assert scene.ch.stats().dead_letters == 0
    sample = json.loads(run_cli("stat", name, "--json").stdout)
    assert sample["stats"]["dead_letters"] == 0
    assert sample["dead_letters"] == []
    text = run_cli("stat", name).stdout
    assert re.search(r"^dead_letters +0$", text, re.M), text
    assert "dead letters: 0" in text
    new = int(match.group(1))
    assert scene.ch.why_waiting(new).state == "ready"  # acct:9 is free: it goes next
    assert run_cli("dead", name).stdout == f"no dead letters in {name}\n"


def test_dead_drop_discards_it(scene: Scene) -> None:
    result = run_cli("dead", scene.ch.name, "--drop", str(scene.seqs["dead"]))
    assert result.returncode == 0, result
    assert result.stdout == f"dropped dead letter seq {scene.seqs['dead']}\n"
    assert scene.ch.dead_letters() == []


def test_rm_stale_removes_a_leftover_exchange_and_keeps_one_in_use(
    scene: Scene, new_chan_name: Callable[[], str]
) -> None:
    leftover, kept = new_chan_name(), new_chan_name()
    make = f"import shmchan; shmchan.Exchange.create({leftover!r})"  # then its maker exits
    subprocess.run([sys.executable, "-c", make], check=True, timeout=TIMEOUT, env=child_env())
    ex = shmchan.Exchange.create(kept)
    try:
        result = run_cli("rm", "--stale")
        assert result.returncode == 0, result
        assert f"removed exchange {leftover}" in result.stdout
        assert leftover not in shmchan.list_exchanges()
        assert kept in shmchan.list_exchanges()  # this process has it open
    finally:
        ex.close()
        ex.unlink()
