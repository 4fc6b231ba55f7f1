"""KeyedExecutor and KeyedPool: key order across processes, crashes, timeouts, clean-up."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from procs import held_by_another_thread, take_receiver_seat

import shmchan
from shmchan import liveness

WAIT = 60  # seconds any single future or join may take before the test fails
METHODS = ["fork", "spawn", "forkserver"]


def _our_executor_channels() -> list[str]:
    prefix = f"kx-{liveness.current_token():x}-"
    return [n for n in shmchan.list_channels() if n.startswith(prefix)]


def _helper(proc: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (they outlive every pool by design)."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def _workers_alive() -> list[psutil.Process]:
    alive = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and not _helper(c):
                alive.append(c)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Every test leaves no worker process and no executor channel behind."""
    yield
    deadline = time.monotonic() + 10
    while alive := _workers_alive():
        if time.monotonic() > deadline:
            for c in alive:
                c.kill()
            pytest.fail(f"worker processes left running: {[c.pid for c in alive]}")
        time.sleep(0.05)
    left = _our_executor_channels()
    for name in left:
        shmchan.unlink(name)
    assert not left, f"executor channels left in /dev/shm: {left}"


# ------------------------------------------------------------------ task functions
# (module level: tasks travel to the workers by pickling)


def square(x: int) -> int:
    return x * x


def add(a: int, b: int, *, c: int = 0) -> int:
    return a + b + c


def fail(message: str) -> None:
    raise KeyError(message)


def slow(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


def gated(gate: str, value: Any = None) -> Any:
    """Return `value` once the file `gate` exists (at most WAIT seconds)."""
    deadline = time.monotonic() + WAIT
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def _until(condition: Callable[[], bool]) -> None:
    """Wait until condition() holds; fail the test after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def echo_size(blob: bytes) -> tuple[int, int]:
    return len(blob), sum(blob[:: 1 << 12])


def make_blob(size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


def append_line(path: str, line: str) -> str:
    with open(path, "a") as f:
        f.write(line + "\n")
    return Path(path).read_text()


def count_and_kill(path: str) -> None:
    with open(path, "a") as f:
        f.write("x")
    os.kill(os.getpid(), signal.SIGKILL)


def count_and_exit(path: str, code: int) -> None:
    with open(path, "a") as f:
        f.write("x")
    os._exit(code)


def count_and_sleep(path: str, seconds: float) -> None:
    with open(path, "a") as f:
        f.write("x")
    time.sleep(seconds)


def my_pid() -> int:
    return os.getpid()


# ------------------------------------------------------------------ the bank oracle
# Each account is a JSON file {"balance": b, "applied": {tid: accepted}}. A transfer
# reads and writes both accounts' files with no lock of its own: only the keys make that
# safe. It is idempotent (it records what it applied), so that a worker killed halfway
# and the task run again still gives the serial result.

INITIAL = 100


def _load(directory: str, account: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(directory, f"{account}.json").read_text())
    return data


def _store(directory: str, account: int, data: dict[str, Any]) -> None:
    tmp = Path(directory, f"{account}.json.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, Path(directory, f"{account}.json"))


def transfer(directory: str, tid: int, src: int, dst: int, amount: int, nap: float) -> bool:
    time.sleep(nap)
    key = str(tid)
    s = _load(directory, src)
    if key in s["applied"]:
        accepted = bool(s["applied"][key])
    else:
        accepted = s["balance"] >= amount  # the overdraft rule: order matters
        if accepted:
            s["balance"] -= amount
        s["applied"][key] = accepted
        _store(directory, src, s)
    if accepted:
        d = _load(directory, dst)
        if key not in d["applied"]:
            time.sleep(nap / 2)
            d["balance"] += amount
            d["applied"][key] = True
            _store(directory, dst, d)
    return accepted


def _bank(tmp_path: Path, accounts: int) -> str:
    for a in range(accounts):
        _store(str(tmp_path), a, {"balance": INITIAL, "applied": {}})
    return str(tmp_path)


def _transfers(n: int, accounts: int, seed: int) -> list[tuple[int, int, int, int, float]]:
    rng = random.Random(seed)
    out = []
    for tid in range(n):
        src, dst = rng.sample(range(accounts), 2)
        out.append((tid, src, dst, rng.randint(1, 80), rng.random() * 0.003))
    return out


def _serial(
    transfers: list[tuple[int, int, int, int, float]], accounts: int
) -> tuple[list[bool], list[int]]:
    balances = [INITIAL] * accounts
    decisions = []
    for _tid, src, dst, amount, _nap in transfers:
        ok = balances[src] >= amount
        if ok:
            balances[src] -= amount
            balances[dst] += amount
        decisions.append(ok)
    return decisions, balances


def _run_bank(
    tmp_path: Path, killer: Callable[[shmchan.KeyedExecutor], None] | None, **kwargs: Any
) -> None:
    accounts, n = 6, 300
    directory = _bank(tmp_path, accounts)
    transfers = _transfers(n, accounts, seed=7)
    with shmchan.KeyedExecutor(4, **kwargs) as ex:
        futures = [
            ex.submit(transfer, directory, *t, keys=(f"acct:{t[1]}", f"acct:{t[2]}"))
            for t in transfers
        ]
        if killer is not None:
            killer(ex)
        decisions = [f.result(timeout=WAIT) for f in futures]
    expected_decisions, expected_balances = _serial(transfers, accounts)
    assert decisions == expected_decisions
    assert [_load(directory, a)["balance"] for a in range(accounts)] == expected_balances
    assert not all(decisions) and any(decisions)  # the overdraft rule fired: order mattered


# ------------------------------------------------------------------ KeyedExecutor


def test_submit_returns_results_and_passes_kwargs() -> None:
    with shmchan.KeyedExecutor(2) as ex:
        assert ex.submit(square, 7, keys=("a",)).result(timeout=WAIT) == 49
        assert ex.submit(add, 1, 2, c=3).result(timeout=WAIT) == 6
        assert ex.submit(add, 1, 2, keys="single key").result(timeout=WAIT) == 3


def test_an_exception_keeps_its_type_and_the_remote_traceback() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        fut = ex.submit(fail, "no such account", keys=("k",))
        with pytest.raises(KeyError, match="no such account") as info:
            fut.result(timeout=WAIT)
        cause = info.value.__cause__
        assert isinstance(cause, shmchan.RemoteTraceback)
        assert "in fail" in str(cause) and "KeyError" in str(cause)
        assert ex.submit(square, 3, keys=("k",)).result(timeout=WAIT) == 9  # key freed


def test_map_gives_results_in_input_order_lazily() -> None:
    with shmchan.KeyedExecutor(3) as ex:
        assert list(ex.map(square, range(500), keys=lambda x: x % 7)) == [x * x for x in range(500)]
        assert list(ex.map(add, [1, 2, 3], [10, 20, 30], keys=lambda t: (t[0],))) == [11, 22, 33]
        chunked = ex.map(square, range(100), keys=lambda x: (x % 5,), chunksize=8)
        assert list(chunked) == [x * x for x in range(100)]


def test_map_timeout_raises_timeout_error(tmp_path: Path) -> None:
    gate = str(tmp_path / "gate")
    with shmchan.KeyedExecutor(1) as ex:
        results = ex.map(gated, [gate, gate], timeout=0.2)
        with pytest.raises(TimeoutError):
            next(results)
        results.close()  # cancels what has not started
        Path(gate).touch()


def test_map_with_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with shmchan.KeyedExecutor(2) as ex:
        assert list(ex.map(square, range(50), progress=True)) == [x * x for x in range(50)]
    assert "50/50" in capsys.readouterr().err


def test_submit_after_shutdown_raises_runtime_error() -> None:
    ex = shmchan.KeyedExecutor(1)
    ex.shutdown()
    with pytest.raises(RuntimeError):
        ex.submit(square, 2)
    with pytest.raises(RuntimeError):
        ex.map(square, [1])


def test_an_unpicklable_function_fails_at_submit() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        with pytest.raises(shmchan.TaskNotPicklable, match="pickl") as info:
            ex.submit(lambda: 1)
        assert isinstance(info.value, pickle.PicklingError)
        with pytest.raises(shmchan.TaskNotPicklable):
            ex.submit(square, threading.Lock())
        assert ex.submit(square, 4).result(timeout=WAIT) == 16


def test_bad_keys_fail_at_submit() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        with pytest.raises(TypeError):
            ex.submit(square, 1, keys=(1.5,))
        assert ex.submit(square, 5).result(timeout=WAIT) == 25


def test_concurrent_results_equal_a_serial_replay(tmp_path: Path) -> None:
    _run_bank(tmp_path, None)


def test_serial_replay_holds_with_workers_killed_at_random(tmp_path: Path) -> None:
    kills = []

    def killer(ex: shmchan.KeyedExecutor) -> None:
        rng = random.Random(3)
        for _ in range(6):
            time.sleep(rng.uniform(0.05, 0.15))
            busy = [w.pid for w in ex.stats().workers if w.state == "busy" and w.pid]
            if busy:
                pid = rng.choice(busy)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)
                except ProcessLookupError:
                    pass

    _run_bank(tmp_path, killer, max_attempts=50)
    assert kills  # workers really died during the run


def test_a_task_that_kills_its_worker_fails_after_max_attempts(tmp_path: Path) -> None:
    counter = str(tmp_path / "runs")
    log = str(tmp_path / "log")
    with shmchan.KeyedExecutor(2, max_attempts=3) as ex:
        doomed = ex.submit(count_and_kill, counter, keys=("acct:1",))
        after = ex.submit(append_line, log, "after", keys=("acct:1",))
        with pytest.raises(shmchan.WorkerDied) as info:
            doomed.result(timeout=WAIT)
        message = str(info.value)
        assert "count_and_kill" in message and "acct:1" in message
        assert "killed by signal SIGKILL" in message
        assert Path(counter).read_text() == "xxx"  # ran exactly max_attempts times
        # the key is free again, and the task behind it ran only after the last attempt
        assert after.result(timeout=WAIT) == "after\n"
        assert ex.submit(square, 6, keys=("acct:1",)).result(timeout=WAIT) == 36
        assert ex.stats().failed >= 1


def test_worker_died_names_the_exit_code(tmp_path: Path) -> None:
    with shmchan.KeyedExecutor(1, max_attempts=2) as ex:
        fut = ex.submit(count_and_exit, str(tmp_path / "runs"), 3, keys=("k",))
        with pytest.raises(shmchan.WorkerDied, match="exited with code 3"):
            fut.result(timeout=WAIT)
        assert (tmp_path / "runs").read_text() == "xx"
        assert ex.submit(square, 2, keys=("k",)).result(timeout=WAIT) == 4


def test_task_timeout_kills_the_worker_and_raises_task_timeout(tmp_path: Path) -> None:
    counter = str(tmp_path / "runs")
    with shmchan.KeyedExecutor(1, task_timeout=0.3, max_attempts=2) as ex:
        fut = ex.submit(count_and_sleep, counter, 30, keys=("k",))
        with pytest.raises(shmchan.TaskTimeout, match="task_timeout"):
            fut.result(timeout=WAIT)
        assert isinstance(fut.exception(), shmchan.WorkerDied)
        assert Path(counter).read_text() == "xx"
        assert ex.submit(square, 3, keys=("k",)).result(timeout=WAIT) == 9


def test_large_arguments_and_results() -> None:
    blob = make_blob(6 << 20)
    with shmchan.KeyedExecutor(2) as ex:
        assert ex.submit(echo_size, blob).result(timeout=WAIT) == echo_size(blob)
        assert ex.submit(make_blob, 5 << 20).result(timeout=WAIT) == make_blob(5 << 20)


def test_shutdown_cancel_futures_cancels_what_has_not_started(tmp_path: Path) -> None:
    gate = str(tmp_path / "gate")
    ex = shmchan.KeyedExecutor(1)
    first = ex.submit(gated, gate, "first", keys=("k",))
    rest = [ex.submit(square, i, keys=("k",)) for i in range(20)]
    _until(first.running)
    ex.shutdown(wait=False, cancel_futures=True)
    # The manager cancels at its next look; only then may `first` end (were the gate
    # opened at once, an idle worker could be taking up rest[0] by then, and that one
    # runs, as with ProcessPoolExecutor).
    _until(lambda: all(f.cancelled() for f in rest))
    Path(gate).touch()
    ex.shutdown(wait=True)
    assert first.result(timeout=0) == "first"
    assert all(f.cancelled() for f in rest)


def test_max_tasks_per_child_recycles_workers() -> None:
    with shmchan.KeyedExecutor(1, max_tasks_per_child=2) as ex:
        pids = [ex.submit(my_pid).result(timeout=WAIT) for _ in range(6)]
    assert len(set(pids)) == 3


def test_stats_report_tasks_and_workers(tmp_path: Path) -> None:
    gate = str(tmp_path / "gate")
    with shmchan.KeyedExecutor(2) as ex:
        blocker = ex.submit(gated, gate, keys=("k",))
        waiting = ex.submit(square, 2, keys=("k",))
        _until(lambda: any(w.state == "busy" for w in ex.stats().workers))
        st = ex.stats()
        assert st.running == 1 and st.queued == 1
        assert st.held_keys == 1
        assert len(st.workers) == 2 and all(w.pid for w in st.workers)
        assert {w.state for w in st.workers} == {"busy", "idle"}
        Path(gate).touch()
        blocker.result(timeout=WAIT)
        waiting.result(timeout=WAIT)
        assert ex.stats().done == 2


@pytest.mark.parametrize("method", METHODS)
def test_every_start_method_works(method: str, tmp_path: Path) -> None:
    log = str(tmp_path / "log")
    with shmchan.KeyedExecutor(2, mp_context=method) as ex:
        assert list(ex.map(square, range(20), keys=lambda x: x % 3)) == [x * x for x in range(20)]
        lines = [ex.submit(append_line, log, str(i), keys=("log",)) for i in range(10)]
        assert lines[-1].result(timeout=WAIT).split() == [str(i) for i in range(10)]
        with pytest.raises(shmchan.TaskNotPicklable):
            ex.submit(lambda x: x, 1)
        with pytest.raises(shmchan.WorkerDied):
            ex.submit(count_and_exit, str(tmp_path / "runs"), 1).result(timeout=WAIT)


def test_an_abandoned_executor_cleans_up() -> None:
    ex = shmchan.KeyedExecutor(1)
    fut = ex.submit(square, 3)
    manager = ex._manager.thread
    del ex  # never shut down: its manager finishes the work, then cleans up
    assert fut.result(timeout=WAIT) == 9
    manager.join(WAIT)
    assert not manager.is_alive()


# ------------------------------------------------------------------ KeyedPool


def fail_once_then_log(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    key, index = payload
    marker = Path(directory, f"seen-{key}-{index}")
    if not marker.exists():
        marker.touch()
        raise ValueError(f"first attempt of {payload}")
    with open(Path(directory, "log"), "a") as f:
        f.write(f"{key} {index}\n")


def die_once_then_log(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    key, index = payload
    marker = Path(directory, f"seen-{key}-{index}")
    if index == 3 and not marker.exists():
        marker.touch()
        os._exit(9)
    with open(Path(directory, "log"), "a") as f:
        f.write(f"{key} {index}\n")


def sleepy_handler(payload: Any, keys: tuple[Any, ...]) -> None:
    time.sleep(0.2)


class _Handler:
    """A picklable handler bound to a directory (functools.partial would do as well)."""

    def __init__(self, fn: Callable[..., None], directory: str) -> None:
        self.fn = fn
        self.directory = directory

    def __call__(self, payload: Any, keys: tuple[Any, ...]) -> None:
        self.fn(self.directory, payload, keys)


def _send_keyed(ch: shmchan.Channel, keys: int, per_key: int) -> list[tuple[str, int]]:
    tx = ch.sender()
    sent = []
    for index in range(per_key):
        for k in range(keys):
            key = f"k{k}"
            tx.send((key, index), keys=(key,))
            sent.append((key, index))
    return sent


def _log_by_key(directory: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for line in (directory / "log").read_text().splitlines():
        key, index = line.split()
        out.setdefault(key, []).append(int(index))
    return out


def test_pool_retries_a_failing_handler_in_key_order(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    ch = make_channel(max_attempts=5)
    sent = _send_keyed(ch, keys=4, per_key=10)
    with shmchan.KeyedPool(
        ch.name, _Handler(fail_once_then_log, str(tmp_path)), processes=3
    ) as pool:
        ch.shutdown()  # the pool ends once everything was handed out and handled
        pool.join(WAIT)
        st = pool.stats()
    assert _log_by_key(tmp_path) == {f"k{k}": list(range(10)) for k in range(4)}
    assert st.failed == len(sent) and st.handled == len(sent)
    assert ch.stats().dead_letters == 0


def test_pool_redelivers_the_message_of_a_dead_worker(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    ch = make_channel(max_attempts=3)
    _send_keyed(ch, keys=2, per_key=6)
    with shmchan.KeyedPool(
        ch.name, _Handler(die_once_then_log, str(tmp_path)), processes=2
    ) as pool:
        ch.shutdown()
        pool.join(WAIT)
    assert _log_by_key(tmp_path) == {"k0": list(range(6)), "k1": list(range(6))}
    assert ch.stats().redelivered >= 2


def test_only_one_pool_per_channel(make_channel: Callable[..., shmchan.Channel]) -> None:
    ch = make_channel()
    with shmchan.KeyedPool(ch.name, sleepy_handler, processes=1):
        with pytest.raises(shmchan.ReceiverBusy):
            shmchan.KeyedPool(ch.name, sleepy_handler, processes=1)


def test_pool_terminate_gives_messages_back(make_channel: Callable[..., shmchan.Channel]) -> None:
    ch = make_channel()
    tx = ch.sender()
    for i in range(6):
        tx.send(i, keys=(f"k{i}",))
    pool = shmchan.KeyedPool(ch.name, sleepy_handler, processes=2)
    _until(lambda: pool.stats().running > 0)
    pids = [w.pid for w in pool.stats().workers]
    pool.terminate()
    assert pool.join(WAIT)
    assert not [
        p for p in pids if p and psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
    # everything not handled goes to the next receiver
    rx = ch.receiver()
    got = []
    while True:
        h = rx.try_recv()
        if h is None:
            break
        got.append(h.payload)
        h.release()
    rx.close()
    assert len(got) + pool.stats().handled == 6


def test_pool_close_finishes_what_it_holds(make_channel: Callable[..., shmchan.Channel]) -> None:
    ch = make_channel()
    pool = shmchan.KeyedPool(ch.name, sleepy_handler, processes=2)
    ch.sender().send("x", keys=("a",))
    _until(lambda: pool.stats().running == 1)
    pool.close()
    pool.join(WAIT)
    assert pool.stats().handled == 1
    assert ch.stats().inflight == 0


_STATE: dict[str, Any] = {}


def remember(value: str) -> None:
    _STATE["value"] = value


def recall() -> Any:
    return _STATE.get("value")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_initializer_runs_in_every_worker(method: str) -> None:
    with shmchan.KeyedExecutor(2, mp_context=method, initializer=remember, initargs=("hi",)) as ex:
        assert [ex.submit(recall).result(timeout=WAIT) for _ in range(4)] == ["hi"] * 4


def gated_append(log: str, line: str, gate: str) -> None:
    """Append `line`; line "1" first waits until the file `gate` exists."""
    deadline = time.monotonic() + WAIT
    while line == "1" and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    append_line(log, line)


def test_closing_a_map_cancels_what_has_not_started(tmp_path: Path) -> None:
    log, gate = str(tmp_path / "log"), str(tmp_path / "gate")
    n = 50
    with shmchan.KeyedExecutor(2) as ex:
        # every item on key "k": item 2 cannot start before item 1, held at the gate, ends
        results = ex.map(
            gated_append, [log] * n, [str(i) for i in range(n)], [gate] * n, keys=lambda t: "k"
        )
        next(results)
        results.close()
        Path(gate).touch()
        ex.submit(square, 1, keys="k").result(timeout=WAIT)  # behind every item on "k"
    # Item 1 runs if a worker had started it when the map was closed, else never.
    assert Path(log).read_text().split() in (["0"], ["0", "1"])


def test_pool_logs_the_handlers_exception(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ch = make_channel(max_attempts=5)
    _send_keyed(ch, keys=1, per_key=1)
    # spawn: a fresh interpreter whose logging is not pytest's (a forked worker would
    # log through the parent's handlers, which is right for an application)
    handler = _Handler(fail_once_then_log, str(tmp_path))
    with shmchan.KeyedPool(ch.name, handler, processes=1, mp_context="spawn") as pool:
        ch.shutdown()
        assert pool.join(WAIT)
    err = capfd.readouterr().err
    assert "ValueError: first attempt of ('k0', 0)" in err and "Traceback" in err


def test_chunks_keep_every_keys_items_in_input_order() -> None:
    from shmchan.pool.executor import _chunks

    rng = random.Random(5)
    for _ in range(200):
        key_lists = [
            tuple(rng.sample(range(6), rng.randint(0, 2))) for _ in range(rng.randint(1, 60))
        ]
        chunks = _chunks(key_lists, rng.randint(1, 7))
        assert sorted(i for c in chunks for i in c) == list(range(len(key_lists)))
        for chunk in chunks:
            assert len({frozenset(key_lists[i]) for i in chunk}) == 1
            assert chunk == sorted(chunk)
        for key in range(6):
            seen = [i for c in chunks for i in c if key in key_lists[i]]
            assert seen == sorted(seen)


def _one_key_chunks_model(raw: list[Any], size: int) -> list[list[int]] | None:
    """What csrc/pool/chunks.c's one_key_chunks must give, in plain Python."""
    if not all(type(k) in (int, str, bytes) for k in raw):
        return None
    groups: dict[tuple[type, Any], list[int]] = {}
    for i, k in enumerate(raw):
        groups.setdefault((type(k), k), []).append(i)
    cuts = [[g[j : j + size] for j in range(0, len(g), size)] for g in groups.values()]
    return [c for rnd in itertools.zip_longest(*cuts) for c in rnd if c is not None]


def test_single_key_chunks_keep_every_keys_items_in_input_order() -> None:
    from _shmchan_chunks import one_key_chunks

    rng = random.Random(7)
    for _ in range(300):
        raw = [rng.choice([0, 1, 2, 300, "a", "b", b"a", 2**70]) for _ in range(rng.randint(0, 80))]
        size = rng.randint(1, 9)
        chunks = one_key_chunks(raw, size)
        assert chunks == _one_key_chunks_model(raw, size)
        assert chunks is not None
        assert sorted(i for c in chunks for i in c) == list(range(len(raw)))
        for chunk in chunks:
            assert 1 <= len(chunk) <= size and chunk == sorted(chunk)
            assert len({(type(raw[i]), raw[i]) for i in chunk}) == 1
        for key in set(raw):
            seen = [i for c in chunks for i in c if raw[i] == key and type(raw[i]) is type(key)]
            assert seen == sorted(seen)
    # anything but one plain key per item takes the general way (_chunks)
    assert one_key_chunks([1, (1, 2)], 2) is None
    assert one_key_chunks([1, True], 2) is None
    assert one_key_chunks([1, None], 2) is None
    with pytest.raises(ValueError, match="size must be at least 1"):
        one_key_chunks([1], 0)
    with pytest.raises(TypeError):
        one_key_chunks((1, 2), 2)  # a list, not any sequence


def test_chunk_pick_and_scatter_check_every_index() -> None:
    from _shmchan_chunks import pick, scatter

    items = ["a", "b", "c", "d"]
    assert pick(items, [3, 0, 0]) == ("d", "a", "a")
    assert pick(items, []) == ()
    results: list[Any] = [None] * 4
    scatter(results, [2, 0], ["x", "y"])
    assert results == ["y", None, "x", None]
    for bad in ([4], [-1], [2**70]):
        with pytest.raises((IndexError, OverflowError)):
            pick(items, bad)
        with pytest.raises((IndexError, OverflowError)):
            scatter(results, [0, *bad], [1, 2])
        assert results == ["y", None, "x", None]  # a bad index changes nothing
    with pytest.raises(TypeError, match="indices must be ints"):
        pick(items, ["0"])
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        scatter(results, [0, 1], [1])


def nap_pid(seconds: float, item: int) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_tasks_freed_one_at_a_time_spread_over_every_worker() -> None:
    """Few keys, cycling: each result frees one key and its next task follows alone.
    Each must go to the least loaded worker. They all went to the first worker with
    room (up to 32 queued there, the others idle): 2 000 such 2 ms tasks on 8 workers
    took 3.1 s instead of 0.53 s, and a Spark task of process_keyed ran nearly serially."""
    with shmchan.KeyedExecutor(4) as ex:
        pids = list(ex.map(nap_pid, [0.01] * 120, range(120), keys=lambda t: (t[1] % 8,)))
        counts = sorted(pids.count(p) for p in set(pids))
    assert len(counts) == 4 and counts[0] >= 12, counts  # an even share is 30 each


def test_map_in_chunks_of_several_iterables_and_without_keys() -> None:
    with shmchan.KeyedExecutor(2) as ex:
        assert list(ex.map(add, range(10), range(10, 20), chunksize=3)) == list(range(10, 30, 2))
        assert list(ex.map(square, range(10), chunksize=4)) == [x * x for x in range(10)]
        got = ex.map(add, range(30), range(30), keys=lambda t: (t[0] % 3, "all"), chunksize=4)
        assert list(got) == list(range(0, 60, 2))


class Unpicklable(Exception):
    def __init__(self, x: int) -> None:
        super().__init__(x)
        self.lock = threading.Lock()


def raise_unpicklable_on_three(x: int) -> int:
    if x == 3:
        raise Unpicklable(x)
    return x


def test_map_in_chunks_sends_back_an_unpicklable_exception_as_a_stand_in() -> None:
    with shmchan.KeyedExecutor(1) as ex:
        results = ex.map(raise_unpicklable_on_three, range(6), keys=lambda x: "k", chunksize=6)
        assert [next(results) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(shmchan.Error, match="Unpicklable"):
            next(results)


def test_map_in_chunks_equals_a_serial_replay(tmp_path: Path) -> None:
    accounts, n = 5, 200
    directory = _bank(tmp_path, accounts)
    transfers = _transfers(n, accounts, seed=11)
    columns = [list(c) for c in zip(*transfers, strict=True)]
    with shmchan.KeyedExecutor(3) as ex:
        decisions = list(
            ex.map(
                transfer,
                [directory] * n,
                *columns,
                keys=lambda t: (f"acct:{t[2]}", f"acct:{t[3]}"),
                chunksize=4,
            )
        )
    expected_decisions, expected_balances = _serial(transfers, accounts)
    assert decisions == expected_decisions
    assert [_load(directory, a)["balance"] for a in range(accounts)] == expected_balances


def fail_on_seven(x: int) -> int:
    if x == 7:
        raise ValueError("seven")
    return x


def test_map_in_chunks_raises_an_items_exception_in_its_place() -> None:
    with shmchan.KeyedExecutor(2) as ex:
        results = ex.map(fail_on_seven, range(20), keys=lambda x: x % 3, chunksize=5)
        assert [next(results) for _ in range(7)] == list(range(7))
        with pytest.raises(ValueError, match="seven") as info:
            next(results)
        assert isinstance(info.value.__cause__, shmchan.RemoteTraceback)


def _executor_then_hang(ready: Any) -> None:
    ex = shmchan.KeyedExecutor(2)
    ex.submit(square, 2).result(timeout=WAIT)
    ready.put([w.pid for w in ex.stats().workers])
    time.sleep(WAIT)


def test_a_killed_executors_workers_exit_and_its_channels_are_reaped() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    owner = ctx.Process(target=_executor_then_hang, args=(ready,))
    owner.start()
    try:
        pids = ready.get(timeout=WAIT)
        token = liveness.token_of(owner.pid)
        prefix = f"kx-{token:x}-"
        assert [n for n in shmchan.list_channels() if n.startswith(prefix)]
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(WAIT)
        deadline = time.monotonic() + WAIT
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            assert time.monotonic() < deadline, "the dead executor's workers did not exit"
            time.sleep(0.1)
        with shmchan.KeyedExecutor(1) as ex:  # starting one removes the dead one's channels
            assert not [n for n in shmchan.list_channels() if n.startswith(prefix)]
            assert ex.submit(square, 3).result(timeout=WAIT) == 9
    finally:
        if owner.is_alive():
            owner.kill()
        owner.join(WAIT)


def test_a_task_too_large_for_the_channel_fails_at_submit() -> None:
    with shmchan.KeyedExecutor(1, capacity=1 << 20) as ex:
        with pytest.raises(shmchan.MessageTooLarge, match="capacity="):
            ex.submit(echo_size, bytes(2 << 20))
        assert ex.submit(echo_size, bytes(100_000)).result(timeout=WAIT) == (100_000, 0)


class Doubler:
    """A callable object that compares by value (so it cannot be hashed)."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Doubler) and other.factor == self.factor

    __hash__ = None  # type: ignore[assignment]

    def __call__(self, x: int) -> int:
        return x * self.factor


def test_callable_objects_are_sent_with_their_state() -> None:
    fn = Doubler(2)
    with shmchan.KeyedExecutor(1) as ex:
        assert ex.submit(fn, 5).result(timeout=WAIT) == 10
        fn.factor = 3  # pickled again at every submit: the new state travels
        assert ex.submit(fn, 5).result(timeout=WAIT) == 15
        assert list(ex.map(fn, [1, 2])) == [3, 6]


# ------------------------------------------------------------------ KeyedPool: failures


def failing_initializer() -> None:
    raise RuntimeError("no database today")


@pytest.mark.timeout(90)
def test_a_pool_whose_initializer_fails_charges_no_attempt_and_join_raises(
    make_channel: Callable[..., shmchan.Channel],
) -> None:
    """No worker ever ran a message: none may be charged an attempt (let alone reach
    the dead letters), and the pool fails as the executor does."""
    ch = make_channel(max_attempts=2)
    sent = _send_keyed(ch, keys=3, per_key=2)
    pool = shmchan.KeyedPool(ch.name, sleepy_handler, processes=2, initializer=failing_initializer)
    try:
        with pytest.raises(shmchan.InitializerFailed, match="initializer"):
            pool.join(20)
    finally:
        pool.terminate()
        with pytest.raises(shmchan.InitializerFailed):  # every join says why it stopped
            pool.join(WAIT)
    st = ch.stats()
    assert st.dead_letters == 0 and st.queued == len(sent) and st.inflight == 0
    rx = take_receiver_seat(ch)
    try:
        got = []
        while (h := rx.try_recv()) is not None:
            got.append((h.payload, h.attempt))
            h.release()
    finally:
        rx.close()
    assert sorted(got) == sorted((m, 1) for m in sent)


def gated_log(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    """Log `payload` once the file `gate` in `directory` exists (bounded wait)."""
    deadline = time.monotonic() + WAIT
    while not os.path.exists(os.path.join(directory, "gate")) and time.monotonic() < deadline:
        time.sleep(0.01)
    append_line(os.path.join(directory, "log"), repr(payload))


@pytest.mark.timeout(90)
def test_a_worker_that_dies_after_close_does_not_hang_join(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    """close() lets the workers finish what the pool holds; one of them dies meanwhile:
    join() still ends, and the dead worker's message is handled all the same."""
    ch = make_channel(max_attempts=3)
    tx = ch.sender()
    for i in range(2):
        tx.send(i, keys=(f"k{i}",))
    pool = shmchan.KeyedPool(ch.name, _Handler(gated_log, str(tmp_path)), processes=2)
    try:
        _until(lambda: [w.state for w in pool.stats().workers] == ["busy", "busy"])
        pool.close()
        victim = next(w.pid for w in pool.stats().workers if w.state == "busy")
        os.kill(victim, signal.SIGKILL)
        _until(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie")
        (tmp_path / "gate").touch()
        assert pool.join(20), "join() hung after a worker died past close()"
    finally:
        pool.terminate()
        pool.join(WAIT)
    assert sorted((tmp_path / "log").read_text().split()) == ["0", "1"]
    assert ch.stats().inflight == 0 and ch.stats().queued == 0


# ------------------------------------------------------------------ orphaned workers


def _pool_past_its_stop_marks(name: str, directory: str, ready: Any) -> None:
    """Serve `name` with two workers, each stuck in a handler; hand both their stop
    mark (what close() and max tasks send); report their pids; wait to be killed."""
    pool = shmchan.KeyedPool(name, _Handler(gated_log, directory), processes=2)
    _until(lambda: [w.state for w in pool.stats().workers] == ["busy", "busy"])
    for w in pool._workers.live():
        pool._workers.stop(w)
    ready.put([w.pid for w in pool.stats().workers])
    time.sleep(WAIT)


def big_after_gate(gate: str) -> bytes:
    deadline = time.monotonic() + WAIT
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    return b"x" * (700 << 10)


def _executor_with_results_to_come(gate: str, ready: Any) -> None:
    """One worker, three tasks whose 700 KiB results cannot all fit in the 1 MiB result
    channel unless someone reads them; report the worker's pid; wait to be killed."""
    ex = shmchan.KeyedExecutor(1, capacity=1 << 20)
    for _ in range(3):
        ex.submit(big_after_gate, gate)
    _until(lambda: ex.stats().workers[0].state == "busy")
    ready.put([w.pid for w in ex.stats().workers])
    time.sleep(WAIT)


def _kill_owner_then_wait_for_workers(owner: Any, ready: Any, then: Callable[[], None]) -> None:
    """SIGKILL the process owning a pool once it reported its workers' pids; then();
    each worker must exit within 10 s (none is left running either way)."""
    pids: list[int] = []
    token = None
    try:
        pids = ready.get(timeout=WAIT)
        token = liveness.token_of(owner.pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(WAIT)
        then()
        deadline = time.monotonic() + 10
        while alive := [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]:
            assert time.monotonic() < deadline, f"orphaned workers still running: {alive}"
            time.sleep(0.05)
    finally:
        if owner.is_alive():
            owner.kill()
        owner.join(WAIT)
        for p in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(p).kill()
        for n in shmchan.list_channels():  # the dead executor's channels
            if token is not None and n.startswith(f"kx-{token:x}-"):
                shmchan.unlink(n)


@pytest.mark.timeout(90)
def test_orphaned_pool_workers_past_their_stop_mark_exit(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    import multiprocessing

    ch = make_channel()
    tx = ch.sender()
    for i in range(2):
        tx.send(i, keys=(f"k{i}",))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    owner = ctx.Process(target=_pool_past_its_stop_marks, args=(ch.name, str(tmp_path), ready))
    owner.start()
    _kill_owner_then_wait_for_workers(owner, ready, lambda: None)


@pytest.mark.timeout(90)
def test_orphaned_executor_worker_blocked_sending_a_result_exits(tmp_path: Path) -> None:
    import multiprocessing

    gate = str(tmp_path / "gate")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    owner = ctx.Process(target=_executor_with_results_to_come, args=(gate, ready))
    owner.start()
    _kill_owner_then_wait_for_workers(owner, ready, lambda: Path(gate).touch())


def _nothing() -> None:
    pass


@pytest.mark.timeout(60)
def test_a_child_forked_while_an_executors_lock_is_held_exits() -> None:
    """A forked child inherits the parent's executors as copies, locks included, held
    or not; at its exit it must not try to shut them down (and hang on such a lock)."""
    import multiprocessing

    with shmchan.KeyedExecutor(1) as ex:
        with held_by_another_thread(ex._manager.lock):
            child = multiprocessing.get_context("fork").Process(target=_nothing)
            child.start()
        child.join(10)
        try:
            assert child.exitcode == 0, "the forked child hung at exit on an inherited lock"
        finally:
            if child.exitcode is None:
                child.kill()
                child.join(WAIT)
