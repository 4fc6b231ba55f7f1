"""Fan-out: one exchange publish to 1, 2, 4 and 8 channels, next to one send per channel.

What is timed is the publisher's side, in this process: N messages of 64 B (one key
each) published through a fanout `Exchange` bound to k channels (all or nothing, see
csrc/exchange.c), and the same N messages sent by hand with one `Sender.send` per
channel (no atomicity: a publisher killed between two sends leaves some copies). The
figure is copies per second: k x N / elapsed. The channels are drained between rounds,
untimed, and every copy is checked there (index and check bytes, each exactly once per
channel, in order).
"""

from __future__ import annotations

import contextlib
import struct
import time

import shmchan
from shmchan.bench.common import SHMCHAN, BenchError, Sizes, no_gc, unique
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, median_ratio

FANOUTS = (1, 2, 4, 8)
BY_HAND = "send per channel"
ROUND = 4000  # messages per timed round; the channels hold a round's copies
_HEAD = struct.Struct("<Q")


def _payload(i: int) -> bytes:
    return _HEAD.pack(i) + bytes([i % 251]) * 56  # 64 B


def _drain_and_check(receivers: list[shmchan.Receiver], first: int, n: int) -> None:
    for rx in receivers:
        want = first
        while want < first + n:
            try:
                hs = rx.recv_many(256, timeout=5.0)
            except shmchan.Empty:
                raise BenchError(f"fanout: copy {want} never arrived") from None
            for h in hs:
                body = bytes(h.data)
                (i,) = _HEAD.unpack_from(body)
                if i != want or body != _payload(i):
                    raise BenchError(f"fanout: expected copy {want}, got a wrong one ({i})")
                want += 1
            rx.release_many(hs)


def _one_round(
    how: str, ex: shmchan.Exchange, senders: list[shmchan.Sender], first: int, n: int
) -> float:
    payloads = [_payload(i) for i in range(first, first + n)]
    keys = [(f"k{i % 1024}",) for i in range(first, first + n)]
    with no_gc():
        t0 = time.perf_counter()
        if how == SHMCHAN:
            publish = ex.publish
            for p, k in zip(payloads, keys, strict=True):
                publish(p, keys=k)
        else:
            for p, k in zip(payloads, keys, strict=True):
                for tx in senders:
                    tx.send(p, keys=k)
        return time.perf_counter() - t0


def _run_fanout(run: Run) -> None:
    messages = 4_000 if run.quick else 20_000
    for k in FANOUTS:
        with contextlib.ExitStack() as stack:
            chans = []
            for _ in range(k):
                ch = shmchan.Channel.create(unique(f"fan{k}"), capacity=8 << 20)
                stack.callback(ch.close)
                stack.callback(ch.unlink)  # (callbacks run last first)
                chans.append(ch)
            ex = shmchan.Exchange.create(unique(f"fanx{k}"), kind="fanout")
            stack.callback(ex.close)
            stack.callback(ex.unlink)
            for ch in chans:
                ex.bind(ch.name)
            senders = [ch.sender() for ch in chans]
            receivers = [ch.receiver() for ch in chans]
            for rx in receivers:
                stack.callback(rx.close)
            samples: dict[str, list[float]] = {SHMCHAN: [], BY_HAND: []}
            for rep in range(run.sizes.reps + 1):  # the first is a warm-up
                for how in (SHMCHAN, BY_HAND):
                    n = messages if rep else messages // 4
                    elapsed = 0.0
                    for first in range(0, n, ROUND):
                        m = min(ROUND, n - first)
                        elapsed += _one_round(how, ex, senders, first, m)
                        _drain_and_check(receivers, first, m)
                    if rep:
                        samples[how].append(k * n / elapsed)
                    run.progress.step(f"fanout to {k}: {how}")
            label = f"fan-out to {k} channel{'s' if k > 1 else ''}, 64 B"
            for system, note in (
                (SHMCHAN, "Exchange.publish, all or nothing; copies per second"),
                (BY_HAND, "one Sender.send per channel, by hand: no atomicity"),
            ):
                run.results.append(
                    Result(
                        f"fanout_{k}",
                        label,
                        system,
                        "msg/s",
                        True,
                        samples[system],
                        note=note,
                        checked=k * messages * run.sizes.reps,
                    )
                )


def _steps(sizes: Sizes, nsys: int) -> int:
    return len(FANOUTS) * (sizes.reps + 1) * 2


def _targets(results: list[Result]) -> list[Target]:
    return [
        Target(
            "fan-out to 4: publish / 4 sends",
            median_ratio(results, ("fanout_4", SHMCHAN), ("fanout_4", BY_HAND)),
            0.5,
            ">=",
            "Exchange.publish to 4 bound channels (all or nothing) vs 4 Sender.send by hand",
        )
    ]


register("fanout", _run_fanout, steps=_steps, order=60, default=False, targets=_targets)
