"""The `footprint` group: how much shared memory channels hold, idle and after a burst.

Memory is measured as the filesystem sees it: the allocated blocks of each segment's file
in /dev/shm (`st_blocks * 512`), which is what counts against a container's /dev/shm limit.

* an idle default channel (`Channel.create(name)`: a 64 MiB capacity), with its receiver
  and a sender attached and one message through;
* the same channel after a burst that queued N bytes (1 KiB messages with a key, none
  received yet): the figure is the footprint over 1.1 N + 2 MiB, at most 1 by target;
* an idle `KeyedExecutor(max_workers=2)` after one task: its two channels together;
* the tables' share: a channel filled with small records (64-byte payloads) to several
  fills, the receiver polling as they come but holding no more than a hot key's handle;
  at each fill, the receiver's tables' committed bytes over the ring's (`Stats.table_bytes`
  / `Stats.ring_committed_bytes`), by how the records are keyed: one key for all,
  a distinct key each, a backlog on a held hot key, and that backlog bringing a new key
  each. The figure is the worst share over the fills, at most 10 % by target.
"""

from __future__ import annotations

import os

import shmchan
from shmchan import liveness
from shmchan.bench.common import MIB, SHMCHAN, Sizes, unique
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, find_result

_DEV_SHM = "/dev/shm"


def _allocated(entry: str) -> int:
    return os.stat(os.path.join(_DEV_SHM, entry)).st_blocks * 512


def _segments() -> set[str]:
    """This process's executors' segments (other processes may make some meanwhile)."""
    ours = f"shmchan.kx-{liveness.current_token():x}-"
    return {n for n in os.listdir(_DEV_SHM) if n.startswith(ours)}


def _idle_and_burst(burst: int) -> tuple[float, float, float]:
    """(idle MiB, burst MiB, N MiB queued) of one default channel."""
    name = unique("footprint")
    ch = shmchan.Channel.create(name)
    try:
        tx, rx = ch.sender(), ch.receiver()
        tx.send(b"x" * 64, keys=("k",))
        rx.recv(timeout=10).release()
        idle = _allocated(f"shmchan.{name}")
        payload = b"b" * 1024
        for i in range(burst // 1024):
            tx.send(payload, keys=(i % 1000,), timeout=10)
        queued = ch.stats().used_bytes
        held = _allocated(f"shmchan.{name}")
        while (h := rx.try_recv()) is not None:
            h.release()
        tx.close()
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(name)
    return idle / MIB, held / MIB, queued / MIB


def _executor_idle() -> float:
    before = _segments()
    with shmchan.KeyedExecutor(max_workers=2) as ex:
        ex.submit(abs, -1, keys=("k",)).result(timeout=60)
        mine = _segments() - before
        return sum(_allocated(n) for n in mine) / MIB


_SHARE_FILLS = (0.002, 0.03, 0.2, 0.6)
_SHARE_KINDS = {
    "one": "one key for all",
    "distinct": "a distinct key each",
    "hot": "a backlog on a held hot key",
    "hot_new": "a hot-key backlog, a new key each",
}


def _share_keys(kind: str, i: int) -> tuple[str, ...]:
    if kind == "one":
        return ("k",)
    if kind == "distinct":
        return (f"u{i}",)
    if kind == "hot":
        return ("hot",)
    return ("hot", f"u{i}")


def _tables_share(kind: str, capacity: int) -> list[float]:
    """The tables' share of the committed ring (%) at each of _SHARE_FILLS."""
    name = unique("footprint-tables")
    ch = shmchan.Channel.create(name, capacity=capacity)
    shares = []
    try:
        tx, rx = ch.sender(), ch.receiver()
        hot = None
        if kind.startswith("hot"):
            tx.send(b"h", keys=("hot",))
            hot = rx.recv(timeout=10)
        sent = 0
        for fill in _SHARE_FILLS:
            while ch.stats().used_bytes < fill * capacity:
                batch = [(b"x" * 64, _share_keys(kind, sent + j)) for j in range(500)]
                tx.send_many(batch, timeout=10)
                sent += len(batch)
                h = rx.try_recv()  # a poll: the receiver takes in or parks what came
                if h is not None:
                    h.release()
            st = ch.stats()
            shares.append(100.0 * st.table_bytes / max(st.ring_committed_bytes, 1))
        if hot is not None:
            hot.release()
        tx.close()
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(name)
    return shares


def _run_footprint(run: Run) -> None:
    sz = run.sizes
    burst = (8 if run.quick else 32) * MIB
    idle, held, ratio, executor = [], [], [], []
    note_n = 0.0
    for _ in range(sz.reps):
        i, h, n = _idle_and_burst(burst)
        idle.append(i)
        held.append(h)
        ratio.append(h / (1.1 * n + 2))
        note_n = n
        run.progress.step("footprint: a default channel")
        executor.append(_executor_idle())
        run.progress.step("footprint: an idle KeyedExecutor")
    capacity = (16 if run.quick else 64) * MIB
    for kind, label in _SHARE_KINDS.items():
        per_fill = [_tables_share(kind, capacity) for _ in range(sz.reps)]
        worst = [max(shares) for shares in per_fill]
        at = ", ".join(
            f"{fill:.1%}: {max(p[i] for p in per_fill):.1f}%" for i, fill in enumerate(_SHARE_FILLS)
        )
        run.results.append(
            Result(
                f"footprint_tables_{kind}",
                f"tables / committed ring, 64 B records, {label}",
                SHMCHAN,
                "%",
                False,
                worst,
                note=f"worst over fills of a {capacity // MIB} MiB channel ({at})",
            )
        )
        run.progress.step(f"footprint: the tables' share, {label}")
    run.results += [
        Result(
            "footprint_idle",
            "idle default channel (64 MiB capacity)",
            SHMCHAN,
            "MiB",
            False,
            idle,
            note="allocated blocks of its /dev/shm segment",
        ),
        Result(
            "footprint_burst",
            f"default channel after a {note_n:.1f} MiB burst",
            SHMCHAN,
            "MiB",
            False,
            held,
            note="1 KiB messages with a key, queued, none received",
        ),
        Result(
            "footprint_burst_ratio", "burst footprint / (1.1 N + 2 MiB)", SHMCHAN, "x", False, ratio
        ),
        Result(
            "footprint_executor",
            "idle KeyedExecutor(max_workers=2), both channels",
            SHMCHAN,
            "MiB",
            False,
            executor,
        ),
    ]


def _steps_footprint(sizes: Sizes, nsys: int) -> int:
    return 2 * sizes.reps + len(_SHARE_KINDS)


def _median(results: list[Result], workload: str) -> float | None:
    r = find_result(results, workload, SHMCHAN)
    return None if r is None else r.median


def _targets_footprint(results: list[Result]) -> list[Target]:
    return [
        Target(
            "idle default channel MiB",
            _median(results, "footprint_idle"),
            2.0,
            "<=",
            "/dev/shm held by an idle channel with every default",
        ),
        Target(
            "burst footprint / (1.1 N + 2 MiB)",
            _median(results, "footprint_burst_ratio"),
            1.0,
            "<=",
            "/dev/shm held after a burst that queued N bytes",
        ),
        Target(
            "idle KeyedExecutor MiB",
            _median(results, "footprint_executor"),
            4.0,
            "<=",
            "/dev/shm held by an idle executor's two channels",
        ),
        Target(
            "tables' share of the committed ring %",
            _worst_share(results),
            10.0,
            "<=",
            "worst over fills and keyings of small records, no handles held but a hot key's",
        ),
    ]


def _worst_share(results: list[Result]) -> float | None:
    medians = [_median(results, f"footprint_tables_{kind}") for kind in _SHARE_KINDS]
    known = [m for m in medians if m is not None]
    return max(known) if known else None


register(
    "footprint",
    _run_footprint,
    steps=_steps_footprint,
    order=85,
    default=False,
    targets=_targets_footprint,
)
