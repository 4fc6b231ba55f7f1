"""shmchan.pool.current(): a handler or task learns the seq, attempt, keys and lease
deadline of the message it runs on (and nothing else asks it)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_pool import WAIT, _Handler, no_leftovers  # noqa: F401 - no_leftovers is autouse

import shmchan
from shmchan.pool import Delivery, current


def record_then_fail_first(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    """Log what current() says; the first attempt at each message raises (nack)."""
    d = current()
    left = d.time_left()
    with open(Path(directory, "log"), "a") as f:
        row = [payload, d.seq, d.attempt, list(d.keys), d.deadline is not None, left]
        f.write(json.dumps(row) + "\n")
    if d.attempt == 1:
        raise ValueError("first attempt")


def current_delivery() -> Delivery:
    return current()


def _serve(ch: shmchan.Channel, directory: Path, processes: int) -> list[list[Any]]:
    """Run a KeyedPool of record_then_fail_first over everything in `ch`; its log rows."""
    with shmchan.KeyedPool(
        ch.name, _Handler(record_then_fail_first, str(directory)), processes=processes
    ) as pool:
        ch.shutdown()
        assert pool.join(WAIT)
    return [json.loads(line) for line in (directory / "log").read_text().splitlines()]


def test_a_pool_handler_knows_the_seq_attempt_keys_and_lease_of_its_message(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    ch = make_channel(max_attempts=5, lease=600)
    tx = ch.sender()
    seqs = {name: tx.send(name, keys=(name, 7)) for name in ("a", "b", "c")}
    rows = _serve(ch, tmp_path, processes=2)
    assert sorted((r[0], r[2]) for r in rows) == [(n, a) for n in "abc" for a in (1, 2)]
    for payload, seq, _attempt, keys, has_deadline, left in rows:
        assert seq == seqs[payload] and keys == [payload, 7]
        assert has_deadline and 0 < left <= 600  # the lease, renewed as the handler starts


def test_without_a_lease_the_deadline_is_none(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    ch = make_channel(max_attempts=5)
    ch.sender().send("x", keys="k")
    rows = _serve(ch, tmp_path, processes=1)
    assert [(r[2], r[4], r[5]) for r in rows] == [(1, False, None), (2, False, None)]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_executor_task_knows_its_message(method: str) -> None:
    with shmchan.KeyedExecutor(1, mp_context=method) as ex:
        d = ex.submit(current_delivery, keys=("acct:1", 2)).result(timeout=WAIT)
        again = ex.submit(current_delivery).result(timeout=WAIT)
    assert isinstance(d, Delivery)
    assert (d.attempt, d.keys, d.deadline, d.time_left()) == (1, ("acct:1", 2), None, None)
    assert again.seq > d.seq and again.keys == ()


def test_current_outside_a_worker_says_where_it_works() -> None:
    with pytest.raises(shmchan.NotInWorker, match="inside a KeyedPool handler") as info:
        current()
    assert isinstance(info.value, shmchan.Error) and isinstance(info.value, RuntimeError)


def test_a_delivery_is_frozen() -> None:
    d = Delivery(seq=1, attempt=1, keys=("k",), deadline=time.monotonic() + 5)
    with pytest.raises(AttributeError):
        d.attempt = 2  # type: ignore[misc]
    left = d.time_left()
    assert left is not None and 0 < left <= 5
