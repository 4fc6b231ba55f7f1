"""KeyedPool's statistics: counts that survive the replacement of the workers."""

from __future__ import annotations

import os
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
