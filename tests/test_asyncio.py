"""asyncio: awaitable receive and send (shmchan/aio.py, csrc/hot/wake.c).

Every test runs its event loop under a time bound (asyncio.wait_for around the whole),
and the channel fixtures remove the segments; producer processes run under `running`."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any, TypeVar

import psutil
import pytest
from procs import CTX, WAIT, running

import shmchan
from shmchan import aio

T = TypeVar("T")
LIMIT = 60.0  # seconds any one test's event loop may run


def run(coro: Awaitable[T], limit: float = LIMIT) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


def _producer(name: str, me: int, count: int, nkeys: int, pace: float) -> None:
    tx = shmchan.Sender.open(name)
    for i in range(count):
        tx.send((me, i), keys=(f"k{(me * 7 + i) % nkeys}",), timeout=WAIT)
        if pace and i % 200 == 0:
            time.sleep(pace)


def _per_key(received: list[tuple[Any, tuple[Any, ...]]]) -> dict[Any, list[Any]]:
    lines: dict[Any, list[Any]] = defaultdict(list)
    for payload, keys in received:
        lines[keys].append(payload)
    return dict(lines)


def _check_order(
    received: list[tuple[Any, tuple[Any, ...]]], nprod: int, count: int, extra: int = 0
) -> None:
    """Every (producer, i) exactly once (producer nprod: `extra` messages); within a key,
    each producer's messages in order."""
    sent = [(m, i) for m in range(nprod) for i in range(count)]
    assert sorted(p for p, _ in received) == sent + [(nprod, i) for i in range(extra)]
    for line in _per_key(received).values():
        last: dict[int, int] = {}
        for m, i in line:
            assert last.get(m, -1) < i, f"key order broken for producer {m} at {i}"
            last[m] = i


def _collect_sync(rx: shmchan.Receiver, total: int) -> list[tuple[Any, tuple[Any, ...]]]:
    out = []
    while len(out) < total:
        h = rx.recv(timeout=WAIT)
        out.append((h.payload, h.keys))
        h.release()
    return out


def test_async_consumer_equals_the_synchronous_one_with_3_producer_processes(make_channel):
    nprod, count, nkeys = 3, 3334, 50
    results = []
    for mode in ("sync", "async"):
        ch = make_channel(capacity=1 << 16)  # small: producers also wait for space
        rx = ch.receiver()
        procs = [
            CTX.Process(target=_producer, args=(ch.name, m, count, nkeys, 0.001))
            for m in range(nprod)
        ]
        with running(*procs):
            if mode == "sync":
                got = _collect_sync(rx, nprod * count)
            else:

                async def consume(rx: shmchan.Receiver = rx) -> list[Any]:
                    out = []
                    while len(out) < nprod * count:
                        for h in await rx.recv_many_async(16, timeout=WAIT):
                            out.append((h.payload, h.keys))
                            await asyncio.sleep(0)  # other tasks run between messages
                            h.release()
                    return out

                got = run(consume())
            for p in procs:
                p.join(WAIT)
                assert p.exitcode == 0
        rx.close()
        _check_order(got, nprod, count)
        results.append({k: v for k, v in _per_key(got).items()})

    # Same per-key result: each producer's messages on a key, in that producer's order.
    def by_producer(lines: dict[Any, list[Any]]) -> dict[Any, dict[int, list[int]]]:
        return {
            k: {m: [i for mm, i in line if mm == m] for m in range(nprod)}
            for k, line in lines.items()
        }

    assert by_producer(results[0]) == by_producer(results[1])


def test_cancellation_storm_loses_nothing_and_holds_nothing(make_channel):
    ch = make_channel(capacity=1 << 18)
    rx, tx = ch.receiver(), ch.sender()
    nprod, count, nkeys = 2, 2000, 20
    procs = [
        CTX.Process(target=_producer, args=(ch.name, m, count, nkeys, 0.005)) for m in range(nprod)
    ]
    rng = random.Random(28)

    async def storm() -> tuple[list[Any], int, int]:
        got: list[Any] = []
        cancelled = 0
        sent = 0

        async def keep_flowing() -> None:
            # Messages from this loop too, until the storm is done: so all 1000
            # cancellations happen while messages flow, however fast the processes are.
            nonlocal sent
            while cancelled < 1000:
                await tx.send_async((nprod, sent), keys=(f"k{sent % nkeys}",), timeout=WAIT)
                sent += 1
                await asyncio.sleep(0.001)

        flow = asyncio.ensure_future(keep_flowing())
        while len(got) < nprod * count + sent or not flow.done():
            # A cancelled await by a timeout, or by task.cancel(): nothing is taken.
            how = rng.random()
            try:
                if how < 0.5:
                    handles = await asyncio.wait_for(
                        rx.recv_many_async(rng.choice((1, 2)), timeout=WAIT),
                        rng.choice((0, 0.0001, 0.001, 0.01)),
                    )
                else:
                    task = asyncio.ensure_future(rx.recv_many_async(rng.choice((1, 2)), WAIT))
                    await asyncio.sleep(rng.choice((0, 0, 0.0005, 0.002)))
                    task.cancel()
                    try:
                        handles = await task
                    except asyncio.CancelledError:
                        cancelled += 1
                        continue
            except TimeoutError:
                cancelled += 1
                continue
            for h in handles:
                got.append((h.payload, h.keys))
                h.release()
        await flow
        return got, cancelled, sent

    with running(*procs):
        got, cancelled, sent = run(storm())
        for p in procs:
            p.join(WAIT)
    assert cancelled >= 1000, f"only {cancelled} cancelled awaits"
    assert sent > 0
    _check_order(got, nprod, count, sent)
    assert ch.stats().inflight == 0  # no handle left out
    assert rx.try_recv() is None  # and nothing left behind


def test_the_event_loop_is_never_blocked(make_channel):
    ch = make_channel()
    rx, tx = ch.receiver(), ch.sender()

    async def main() -> float:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def consumer() -> None:
            for _ in range(20):
                h = await rx.recv_async(timeout=WAIT)  # each waits ~50 ms for its message
                h.release()

        async def producer() -> None:
            for i in range(20):
                await asyncio.sleep(0.05)
                await tx.send_async(i, keys=("k",))

        beat = asyncio.ensure_future(heartbeat())
        await asyncio.gather(consumer(), producer())
        stop.set()
        await beat
        assert len(gaps) >= 50  # the heartbeat ran throughout the ~1 s of waiting
        return max(gaps)

    # A blocked loop would show a gap of ~50 ms per receive (or hang); generous slack.
    assert run(main()) < 0.5


def _await_idle(name: str, ready: Any) -> None:
    async def main() -> None:
        rx = shmchan.Channel.open(name).receiver()
        ready.set()
        try:
            await rx.recv_async(timeout=60)
        except shmchan.Empty:
            pass

    asyncio.run(main())


def test_an_idle_awaiting_consumer_uses_almost_no_cpu(chan_name):
    ch = shmchan.Channel.create(chan_name, capacity=1 << 16)
    ready = CTX.Event()
    p = CTX.Process(target=_await_idle, args=(ch.name, ready))
    try:
        with running(p):
            assert ready.wait(WAIT)
            proc = psutil.Process(p.pid)
            time.sleep(0.5)
            cpu0 = sum(proc.cpu_times()[:2])
            time.sleep(2.0)
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            assert cpu < 0.1, f"an idle await used {cpu:.3f} s of CPU in 2 s"
            p.kill()
    finally:
        ch.close()
        shmchan.unlink(chan_name)


def test_two_channels_awaited_in_one_process_use_one_helper_thread(make_channel):
    a, b = make_channel(), make_channel()
    rxa, rxb = a.receiver(), b.receiver()
    txa, txb = a.sender(), b.sender()

    async def main() -> tuple[int, int, list[Any]]:
        ta = asyncio.ensure_future(rxa.recv_async(timeout=WAIT))
        tb = asyncio.ensure_future(rxb.recv_async(timeout=WAIT))
        await asyncio.sleep(0.2)  # both are waiting now
        threads = threading.active_count()
        helpers = aio.helper_threads()
        txb.send("b", keys=("x",))
        txa.send("a", keys=("x",))
        got = [h.payload for h in await asyncio.gather(ta, tb)]
        return threads, helpers, got

    before = threading.active_count() - aio.helper_threads()
    threads, helpers, got = run(main())
    assert got == ["a", "b"]
    assert helpers == 1
    assert threads == before + 1  # no thread per pending call


def _send_forever(name: str) -> None:
    tx = shmchan.Sender.open(name)
    i = 0
    while True:
        tx.send(b"x" * 100, keys=(f"k{i % 3}",), timeout=WAIT)
        i += 1


def test_a_producer_killed_mid_send_does_not_wedge_an_awaiting_consumer(make_channel):
    ch = make_channel(capacity=1 << 16)
    rx, tx = ch.receiver(), ch.sender()
    p = CTX.Process(target=_send_forever, args=(ch.name,))

    async def main() -> int:
        n = 0
        with running(p):
            while n < 200:  # it is sending
                h = await rx.recv_async(timeout=WAIT)
                h.release()
                n += 1
            os.kill(p.pid, signal.SIGKILL)  # most likely mid-send
            p.join(WAIT)
        # Whatever it left half-done, a later message on the same keys still arrives.
        while True:
            try:
                h = await rx.recv_async(timeout=0.5)
            except shmchan.Empty:
                break
            h.release()
        for i in range(3):
            await tx.send_async("after", keys=(f"k{i}",), timeout=WAIT)
        for _ in range(3):
            h = await rx.recv_async(timeout=WAIT)
            assert h.payload == "after"
            h.release()
        return n

    assert run(main()) == 200


def test_send_async_waits_for_space_and_a_cancelled_one_sends_nothing(make_channel):
    ch = make_channel(capacity=1 << 16)
    rx, tx = ch.receiver(), ch.sender()
    big = b"x" * 4000

    async def main() -> None:
        n = 0
        while True:  # fill the ring
            try:
                tx.send((n, big), keys=("k",), timeout=0)
            except shmchan.Full:
                break
            n += 1
        # An await that times out or is cancelled while the ring is full sends nothing.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(tx.send_async(("late", big), keys=("k",)), 0.1)
        task = asyncio.ensure_future(tx.send_async(("cancelled", big), keys=("k",)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(shmchan.Full):
            await tx.send_async(("full", big), keys=("k",), timeout=0.05)
        # A pending send completes once the consumer frees space.
        pending = asyncio.ensure_future(tx.send_async(("last", big), keys=("k",), timeout=WAIT))
        await asyncio.sleep(0.1)
        assert not pending.done()
        got = []
        while len(got) < n + 1:
            for h in await rx.recv_many_async(8, timeout=WAIT):
                got.append(h.payload[0])
                h.release()
        await pending
        assert got == [*range(n), "last"]  # each once, in order; nothing cancelled went in
        assert rx.try_recv() is None

    run(main())


def test_async_for_ends_when_the_channel_is_shut_down_and_drained(ch):
    rx, tx = ch.receiver(), ch.sender()

    async def main() -> list[int]:
        async def produce() -> None:
            for i in range(100):
                await tx.send_async(i, keys=(i % 3,))
                if i % 10 == 0:
                    await asyncio.sleep(0.001)
            ch.shutdown()

        prod = asyncio.ensure_future(produce())
        got = []
        async for h in rx:
            got.append(h.payload)
            h.release()
        await prod
        return got

    assert run(main()) == list(range(100))


def test_recv_async_times_out_with_empty_and_refuses_a_bad_timeout(rx):
    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(shmchan.Empty):
            await rx.recv_async(timeout=0.2)
        assert time.monotonic() - t0 < 10
        with pytest.raises(shmchan.InvalidArgument):
            await rx.recv_async(timeout=-1)
        with pytest.raises(shmchan.InvalidArgument):
            await rx.recv_many_async(0)

    run(main())


def _echo(request: str, reply: str, rounds: int) -> None:
    rx = shmchan.Channel.open(request).receiver()
    tx = shmchan.Sender.open(reply)
    for _ in range(rounds):
        h = rx.recv(timeout=WAIT)
        tx.send(h.payload, keys=("r",), timeout=WAIT)
        h.release()


def test_a_send_from_another_process_wakes_the_awaiting_task_at_once(make_channel):
    # 300 round trips through another process: with the futex wake-up each takes well
    # under a millisecond; a waiter that only woke at its upkeep period (0.1 s) would need
    # about 15 s or more.
    request, reply = make_channel(), make_channel()
    rx, tx = reply.receiver(), request.sender()
    rounds = 300
    p = CTX.Process(target=_echo, args=(request.name, reply.name, rounds))

    async def main() -> float:
        tx.send(-1, keys=("q",))  # the echo process is up once this comes back
        (await rx.recv_async(timeout=WAIT)).release()
        t0 = time.monotonic()
        for i in range(rounds - 1):
            await tx.send_async(i, keys=("q",))
            h = await rx.recv_async(timeout=WAIT)
            assert h.payload == i
            h.release()
        return time.monotonic() - t0

    with running(p):
        took = run(main())
        p.join(WAIT)
    assert took < 7.5, f"{rounds} round trips took {took:.1f} s: wake-ups were missed"


def test_import_shmchan_leaves_asyncio_unimported() -> None:
    """asyncio costs a fresh process ~30 ms to import: it comes with the first asyncio
    call (shmchan.aio), not with `import shmchan`, which every producer pays."""
    code = "import sys, shmchan; print('asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
