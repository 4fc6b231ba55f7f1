"""Workloads under pressure: producers 1/2/4/8 on a ring that fills, a channel
with millions of slots against a small one, and the CPU an idle receiver burns.

* fill: 64 B unbatched into a `fill_capacity` ring (8 MiB) with several times that much
  sent per repetition, so producers spend most of the run waiting for space. shmchan and
  faster-fifo (bounded the same; mp.Queue is unbounded, it never fills) side by side;
  shmchan's note says how often its receiver woke a waiting sender per message.
* big channel: the same 1-producer workload into a `big_capacity` channel (1 GiB, four
  million slots) and a `fill_capacity` one, with messages that fit either ring: what a
  large message table costs the receiver (its upkeep must not scale with it). One
  repetition of each at a time, alternating, so that drift hits both alike.
* idle: a receiver of a `big_capacity` channel blocked in recv() on nothing; process CPU
  time over wall time, in percent of one core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any

import shmchan
from shmchan.bench.common import FFIFO, MIB, PAYLOAD, SHMCHAN, Sizes, no_gc, unique
from shmchan.bench.endpoints import Endpoint, ShmchanEnd
from shmchan.bench.harness import Run, throughput
from shmchan.bench.plot import curve
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, find_result, median_ratio


def _mib(n: int) -> str:
    return (
        f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    )


# --------------------------------------------------------------------------- a ring that fills


def _posts_note(total: int) -> Any:
    def after(ends: dict[str, Endpoint]) -> dict[str, str]:
        end = ends.get(SHMCHAN)
        if not isinstance(end, ShmchanEnd) or not total:
            return {}
        posts = end.sender_posts()
        return {
            SHMCHAN: f"receiver woke a waiting sender {posts:,} times ({posts / total:.4f}/msg)"
        }

    return after


def _run_fill(run: Run) -> None:
    sz = run.sizes
    systems = [s for s in (SHMCHAN, FFIFO) if s in run.systems]
    for nprod in sz.fill_producers:
        per = sz.fill_messages // nprod
        total = per * nprod * (sz.reps + 1)
        throughput(
            run,
            workload=f"fill_p{nprod}",
            label=f"64 B, {_mib(sz.fill_capacity)} ring that fills, {nprod} producer"
            + ("s" if nprod > 1 else ""),
            mode="msg",
            systems=systems,
            nprod=nprod,
            per_producer=per,
            batch=1,
            size=PAYLOAD,
            unit="msg/s",
            notes={FFIFO: f"max_size_bytes={_mib(sz.fill_capacity)}"},
            capacity=sz.fill_capacity,
            warmup=per,  # the warm-up fills the ring: every timed repetition starts full
            after=_posts_note(total),
        )


def _steps_fill(sizes: Sizes, nsys: int) -> int:
    return len(sizes.fill_producers) * (1 + (sizes.reps + 1) * min(nsys, 2))


def _targets_fill(results: list[Result]) -> list[Target]:
    one = find_result(results, "fill_p1", SHMCHAN)
    ratios = [
        r.median / one.median
        for n in (2, 4, 8)
        if one is not None and (r := find_result(results, f"fill_p{n}", SHMCHAN)) is not None
    ]
    return [
        Target(
            "full ring: fewest of 2/4/8 producers / 1",
            min(ratios) if ratios else None,
            0.8,
            ">=",
            "aggregate rate with more producers on a ring that fills, vs one producer",
        )
    ]


def _panel_fill(ax: Any, rows: list[dict[str, Any]]) -> None:
    curve(ax, rows, "fill_p")
    ax.set_title("64 B unbatched into a ring that fills", fontsize=10)
    ax.set_xlabel("producer processes")
    ax.set_ylabel("messages / s")


# --------------------------------------------------------------------------- a big channel

BIG_PAIRS = 3  # repetitions of each channel per repetition of the run


def _run_big(run: Run) -> None:
    sz = run.sizes
    # The small ring must hold a repetition's messages (a 64 B record with one key takes
    # 128 bytes; 160 leaves room), so that the producer never waits: receivers are compared.
    fit = -(-sz.big_messages * 160 // MIB) * MIB
    channels = [("channel_small", max(sz.fill_capacity, fit)), ("channel_big", sz.big_capacity)]
    # One repetition at a time, the two channels alternating (and which goes first), so
    # that a machine that slows down for a while slows both alike: the target is their
    # ratio. Each repetition starts its channel and producer afresh, after a warm-up.
    # (A repetition's rate is bimodal here, about 1.6 or 2.0 M msg/s on either channel,
    # whichever way the scheduler places the two processes.)
    # A repetition is short (50 000 messages: a few tens of ms), so a scheduler hiccup
    # moves it far: each of the run's repetitions is the median of BIG_PAIRS of them.
    one = dataclasses.replace(run, sizes=dataclasses.replace(sz, reps=1), results=[])
    for rep in range(sz.reps * BIG_PAIRS):
        for workload, cap in channels if rep % 2 == 0 else channels[::-1]:
            throughput(
                one,
                workload=workload,
                label=f"64 B unbatched, 1 producer, {_mib(cap)} channel",
                mode="msg",
                systems=[SHMCHAN],
                nprod=1,
                per_producer=sz.big_messages,
                batch=1,
                size=PAYLOAD,
                unit="msg/s",
                notes={
                    SHMCHAN: f"max_messages {min(max(cap // 256, 8192), 1 << 22):,}; "
                    f"each sample the median of {BIG_PAIRS} channels"
                },
                capacity=cap,
            )
    for workload, _cap in channels:
        parts = [r for r in one.results if r.workload == workload]
        rates = [x for r in parts for x in r.samples]
        run.results.append(
            dataclasses.replace(
                parts[0],
                # one sample per run repetition: the median of its BIG_PAIRS short ones
                samples=[
                    statistics.median(rates[i : i + BIG_PAIRS])
                    for i in range(0, len(rates), BIG_PAIRS)
                ],
                out_of_order=sum(r.out_of_order for r in parts),
                checked=sum(r.checked for r in parts),
            )
        )


def _steps_big(sizes: Sizes, nsys: int) -> int:
    return 2 * sizes.reps * BIG_PAIRS * (1 + 2)  # per throughput(): started, warm-up, 1 rep


def _targets_big(results: list[Result]) -> list[Target]:
    return [
        Target(
            "big channel / small channel",
            median_ratio(results, ("channel_big", SHMCHAN), ("channel_small", SHMCHAN)),
            0.95,
            ">=",
            "1-producer rate of a channel with millions of slots vs a small one",
        )
    ]


# --------------------------------------------------------------------------- an idle receiver


def _run_idle(run: Run) -> None:
    sz = run.sizes
    samples: list[float] = []
    name = unique("idle")
    ch = shmchan.Channel.create(name, sz.big_capacity)
    try:
        rx = ch.receiver()
        try:
            for rep in range(-1, sz.reps):
                with no_gc():
                    cpu0, wall0 = time.process_time(), time.monotonic()
                    with contextlib.suppress(shmchan.Empty):
                        rx.recv(timeout=sz.idle_seconds)
                    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
                if rep >= 0:
                    samples.append(max(cpu, 1e-9) / wall * 100.0)
                run.progress.step("idle receiver CPU")
        finally:
            rx.close()
    finally:
        ch.close()
        shmchan.unlink(name)
    run.results.append(
        Result(
            "idle_cpu",
            f"idle receiver CPU, {_mib(sz.big_capacity)} channel",
            SHMCHAN,
            "%",
            False,
            samples,
            note=f"process CPU time / wall time over {sz.idle_seconds:g} s of recv() on nothing",
        )
    )


def _steps_idle(sizes: Sizes, nsys: int) -> int:
    return sizes.reps + 1


def _targets_idle(results: list[Result]) -> list[Target]:
    r = find_result(results, "idle_cpu", SHMCHAN)
    return [
        Target(
            "idle receiver CPU %",
            None if r is None else r.median,
            0.5,
            "<=",
            "percent of one core a receiver blocked on an empty channel uses",
        )
    ]


register("fill", _run_fill, steps=_steps_fill, order=60, targets=_targets_fill, panel=_panel_fill)
register("bigchannel", _run_big, steps=_steps_big, order=70, targets=_targets_big)
register("idle", _run_idle, steps=_steps_idle, order=80, targets=_targets_idle)
