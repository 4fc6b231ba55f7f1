"""KeyedPool's statistics: counts that survive the replacement of the workers."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from test_pool import WAIT, _Handler, no_leftovers  # noqa: F401 - no_leftovers is autouse

import shmchan


def die_once_on_minus_one(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    """Raise on odd payloads; the first time payload -1 comes, kill this worker."""
    if payload == -1:
        marker = Path(directory, "died")
        if not marker.exists():
            marker.touch()
            os._exit(9)
    elif payload % 2:
        raise ValueError(payload)


def test_pool_stats_keep_the_counts_of_replaced_workers(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    ch = make_channel(max_attempts=2)
    tx = ch.sender()
    # 20 before the death, the death (-1, handled on its second attempt), 20 after:
    # with one worker, the first worker's counts are those of the first 20
    for i in [*range(20), -1, *range(20, 40)]:
        tx.send(i, keys=("k",))
    with shmchan.KeyedPool(
        ch.name, _Handler(die_once_on_minus_one, str(tmp_path)), processes=1
    ) as pool:
        ch.shutdown()
        assert pool.join(WAIT)
        st = pool.stats()
    # odd payloads fail twice (max_attempts=2) and go to the dead letters
    assert (st.handled, st.failed, st.redelivered) == (21, 40, 1)
    chan = ch.stats()  # the channel's own account agrees
    assert (chan.released, chan.dead_letters) == (st.handled, 20)
    assert chan.delivered == st.handled + st.failed + st.redelivered


def note_payload(directory: str, payload: Any, keys: tuple[Any, ...]) -> None:
    with open(Path(directory, "seen"), "a") as f:
        f.write(f"{payload}\n")


def test_pool_is_awaited_from_an_event_loop_without_blocking_it(
    make_channel: Callable[..., shmchan.Channel], tmp_path: Path
) -> None:
    """join_async waits for the pool's end on the loop (a heartbeat keeps beating), times
    out with False while the pool runs, a cancelled one leaves the pool running, and
    `async with` closes and awaits the end."""
    ch = make_channel()
    tx = ch.sender()

    async def main() -> tuple[bool, float, bool]:
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        async with shmchan.KeyedPool(
            ch.name, _Handler(note_payload, str(tmp_path)), processes=2
        ) as pool:
            early = await pool.join_async(timeout=0.2)  # running: not ended
            waiter = asyncio.create_task(pool.join_async())
            await asyncio.sleep(0.05)
            waiter.cancel()  # a cancelled await leaves the pool serving
            for i in range(200):
                await tx.send_async(i, keys=(f"k{i % 7}",), timeout=WAIT)
            ch.shutdown()
            ended = await pool.join_async(timeout=WAIT)
        beat.cancel()
        return early, max(gaps), ended

    early, worst_gap, ended = asyncio.run(asyncio.wait_for(main(), 2 * WAIT))
    assert early is False
    assert ended is True
    seen = sorted(int(x) for x in Path(tmp_path, "seen").read_text().split())
    assert seen == list(range(200))
    # the loop never waited on the pool: generous bound, far below the time join takes
    assert worst_gap < 5.0, worst_gap
