"""The demo: concurrent transfers through the channel equal a serial replay, and it cleans up."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from argparse import Namespace

import pytest
from procs import child_env, run_shmchan

import shmchan
from shmchan import demo

TIMEOUT = 120  # seconds; a 2000-message run normally takes a few


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return run_shmchan("demo", *args, timeout=TIMEOUT)


def channel_name(output: str) -> str:
    match = re.search(r"^channel: (\S+)$", output, re.M)
    assert match, output
    return match.group(1)


# --------------------------------------------------------------------------- end to end


def test_fifo_demo_equals_serial_replay_in_seq_order() -> None:
    result = run_demo("--messages", "2000")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "OK: concurrent result equals serial replay in seq order" in out
    messages = re.search(r"^messages:\s+(\d+) \(accepted (\d+), rejected (\d+)\)$", out, re.M)
    assert messages, out
    assert int(messages.group(1)) == 2000
    assert int(messages.group(3)) > 0  # the overdraft rule fired, so order mattered
    assert re.search(r"^elapsed:\s+\d+\.\d+ s$", out, re.M)
    assert re.search(r"^throughput:\s+[\d,]+ msgs/s$", out, re.M)
    assert channel_name(out) not in shmchan.list_channels()


def test_fifo_demo_under_heavy_contention() -> None:
    # Two accounts: nearly every message conflicts with the one before it.
    result = run_demo("--messages", "2000", "--accounts", "2", "--producers", "2", "--workers", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: concurrent result equals serial replay in seq order" in result.stdout


def test_eager_demo_equals_serial_replay_in_hand_out_order() -> None:
    result = run_demo("--messages", "2000", "--order", "eager", "--accounts", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: concurrent result equals serial replay in hand-out order" in result.stdout
    assert channel_name(result.stdout) not in shmchan.list_channels()


def test_demo_rejects_bad_options() -> None:
    result = run_demo("--accounts", "1")
    assert result.returncode == 2
    assert "at least 2" in result.stderr


def test_ctrl_c_stops_the_demo_and_removes_its_channel() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmchan", "demo", "--messages", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the banner
        name = channel_name(proc.stdout.readline())
        assert name in shmchan.list_channels()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert "Traceback" not in err
    assert name not in shmchan.list_channels()


# --------------------------------------------------------------------------- the checker


def test_apply_enforces_the_overdraft_rule() -> None:
    balances = [100, 100]
    assert not demo.apply(balances, (demo.WITHDRAW, 0, -1, 150, 0, 0))
    assert demo.apply(balances, (demo.TRANSFER, 0, 1, 60, 0, 1))
    assert not demo.apply(balances, (demo.TRANSFER, 0, 1, 50, 0, 2))
    assert demo.apply(balances, (demo.DEPOSIT, 0, -1, 10, 0, 3))
    assert balances == [50, 160]


def test_make_ops_is_deterministic_and_keys_name_every_account_touched() -> None:
    ops = demo.make_ops(1, 500, 7, seed=3)
    assert ops == demo.make_ops(1, 500, 7, seed=3)
    assert {op[0] for op in ops} == {demo.TRANSFER, demo.DEPOSIT, demo.WITHDRAW}
    for op in ops:
        touched = {op[1]} | ({op[2]} if op[0] == demo.TRANSFER else set())
        assert set(demo.keys_of(op)) == {f"acct:{a}" for a in touched}


def test_compare_catches_a_different_schedule() -> None:
    ops = list(enumerate(demo.make_ops(0, 300, 3, seed=0)))
    balances, decisions = demo.replay(ops, 3)
    assert demo.compare(balances, decisions, balances, decisions) == []
    other_balances, other_decisions = demo.replay(reversed(ops), 3)
    problems = demo.compare(balances, decisions, other_balances, other_decisions)
    assert any("replay" in p and "workers" in p for p in problems)


Done = list[tuple[int, int, int, bool]]  # (seq, producer, index, accepted)


def _outcome(log: list[tuple[int, demo.Op]], done: Done, balances: list[int]) -> demo._Outcome:
    """What a run would report if it handed messages out in the order of `log`."""
    handout = [(seq, demo.keys_of(op)) for seq, op in log]
    return demo._Outcome({0: log}, done, handout, balances, elapsed=1.0, stats=None)


def _problems(outcome: demo._Outcome, order: str, messages: int, accounts: int) -> list[str]:
    args = Namespace(messages=messages, accounts=accounts, order=order, no_keys=False)
    return demo._check(outcome, args)[0]


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_check_accepts_a_correct_run_and_rejects_broken_ones(order: str) -> None:
    ops = demo.make_ops(0, 200, 4, seed=1)
    log = [(10 + i, op) for i, op in enumerate(ops)]
    balances, decisions = demo.replay(log, 4)
    done = [(seq, op[4], op[5], decisions[seq]) for seq, op in log]

    def problems(done: Done, balances: list[int]) -> list[str]:
        return _problems(_outcome(log, done, balances), order, 200, 4)

    assert problems(done, balances) == []
    assert any("never processed" in p for p in problems(done[1:], balances))
    assert any("processed twice" in p for p in problems([*done, done[0]], balances))
    flipped = [*done[:-1], (*done[-1][:3], not done[-1][3])]
    assert any(f"seq {done[-1][0]}:" in p for p in problems(flipped, balances))
    skewed = [balances[0] + 1, *balances[1:]]
    assert any("account 0" in p for p in problems(done, skewed))


def test_check_flags_a_fifo_hand_out_out_of_seq_order() -> None:
    ops = [(demo.DEPOSIT, 0, -1, 5, 0, i) for i in range(3)]
    log = list(enumerate(ops))
    balances, decisions = demo.replay(log, 2)
    done = [(seq, op[4], op[5], decisions[seq]) for seq, op in log]
    outcome = _outcome(log, done, balances)
    outcome.handout = [(1, ("acct:0",)), (0, ("acct:0",)), (2, ("acct:0",))]
    assert any("handed out after" in p for p in _problems(outcome, "fifo", 3, 2))
    assert _problems(outcome, "eager", 3, 2) == []  # eager makes no such promise
