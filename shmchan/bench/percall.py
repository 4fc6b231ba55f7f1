"""Per-call costs in one process (ns): shmchan's hot calls beside the plain queues' put and
get, and beside a floor measured in the same run.

Each row is one loop of N calls timed in this thread's CPU time (`time.thread_time_ns`,
so that time the thread spends preempted on a shared machine is not counted; time it
spends blocked is not either, and none of these calls should block), divided by N: the
loop's own cost is included, as it is in the floor. The floor is one loop iteration making three
calls of a bound no-argument C method of a builtin object (`(0).bit_length`: no
allocation, no work) -- the least that three C calls from Python (send, recv, release)
can cost here -- and, below it, the empty loop. Receive-side rows time taking messages
that are already queued (filled untimed just before); pyzmq's messages are given a pause to
cross its I/O thread first. The rows of a repetition are taken one after the other, and
the median over the repetitions is reported.

* send: `send(payload, key)` (one int key) and `send(payload)`, beside zeroq `put`,
  pyzmq `send`, mp.Queue `put` and faster-fifo `put` of the same 64 B.
* receive: `recv()` + `release()`, beside the queues' `get` / `recv`; and shmchan's
  `recv()` + `payload` + `release()` (what the unbatched consumer does), `recv_many(256)`
  + `release()` per handle, and `recv_many(256)` + `release_many`, per message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import shmchan
from shmchan.bench.common import (
    CAPACITY,
    FFIFO,
    MPQ,
    PAYLOAD,
    SHMCHAN,
    TIMEOUT,
    ZEROQ,
    ZMQ,
    Sizes,
    no_gc,
    payload,
    unique,
)
from shmchan.bench.endpoints import ShmchanEnd
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, best_peer, find_result

FLOOR = "3 trivial C calls"
LOOP = "empty loop"
LABEL = "per call, one process"

Timer = Callable[[int], float]  # n -> elapsed ns for n calls (untimed set-up excluded)


def _floor3(n: int) -> float:
    f = (0).bit_length
    with no_gc():
        t0 = time.thread_time_ns()
        for _ in range(n):
            f()
            f()
            f()
        return time.thread_time_ns() - t0


def _loop(n: int) -> float:
    with no_gc():
        t0 = time.thread_time_ns()
        for _ in range(n):
            pass
        return time.thread_time_ns() - t0


class _Shmchan:
    def __init__(self) -> None:
        self.end = ShmchanEnd(CAPACITY)  # its channel, receiver and clean-up
        self.tx, self.rx = self.end.ch.sender(), self.end.rx
        self.p = payload(0, 0)

    def _drain(self) -> None:
        rx = self.rx
        with contextlib.suppress(shmchan.Empty):
            while True:
                rx.release_many(rx.recv_many(4096, 0))

    def _fill(self, n: int) -> None:
        self.tx.send_many([(self.p, i % 1024) for i in range(n)], TIMEOUT)

    def send_key(self, n: int) -> float:
        send, p, keys = self.tx.send, self.p, [i % 1024 for i in range(n)]
        with no_gc():
            t0 = time.thread_time_ns()
            for k in keys:
                send(p, k)
            t = time.thread_time_ns() - t0
        self._drain()
        return t

    def send_nokey(self, n: int) -> float:
        send, p = self.tx.send, self.p
        with no_gc():
            t0 = time.thread_time_ns()
            for _ in range(n):
                send(p)
            t = time.thread_time_ns() - t0
        self._drain()
        return t

    def recv_release(self, n: int) -> float:
        self._fill(n)
        recv = self.rx.recv
        with no_gc():
            t0 = time.thread_time_ns()
            for _ in range(n):
                recv(TIMEOUT).release()
            return time.thread_time_ns() - t0

    def recv_payload_release(self, n: int) -> float:
        self._fill(n)
        recv = self.rx.recv
        with no_gc():
            t0 = time.thread_time_ns()
            for _ in range(n):
                h = recv(TIMEOUT)
                h.payload  # noqa: B018 -- the copy the unbatched consumer makes
                h.release()
            return time.thread_time_ns() - t0

    def recv_many_each(self, n: int) -> float:
        self._fill(n)
        recv_many = self.rx.recv_many
        got = 0
        with no_gc():
            t0 = time.thread_time_ns()
            while got < n:
                hs = recv_many(256, TIMEOUT)
                for h in hs:
                    h.release()
                got += len(hs)
            return time.thread_time_ns() - t0

    def recv_many_release_many(self, n: int) -> float:
        self._fill(n)
        recv_many, release_many = self.rx.recv_many, self.rx.release_many
        got = 0
        with no_gc():
            t0 = time.thread_time_ns()
            while got < n:
                hs = recv_many(256, TIMEOUT)
                release_many(hs)
                got += len(hs)
            return time.thread_time_ns() - t0

    def close(self) -> None:
        self.end.close()


class _Queue:
    """One plain queue in one process: `put` timed alone, then `get` of what it holds."""

    def __init__(self, system: str, ctx: Any) -> None:
        self.system = system
        self.p = payload(0, 0)
        self.closers: list[Callable[[], Any]] = []
        self.put_raw: Callable[..., Any]
        self.get_raw: Callable[..., Any]
        self.put_args: tuple[Any, ...]
        self.get_args: tuple[Any, ...]
        if system == ZEROQ:
            import zeroq

            q = zeroq.Queue(unique("percall-zq"), element_size=PAYLOAD, capacity=1 << 16)
            self.closers.append(q.close)
            self.put_raw, self.put_args = q.put, (TIMEOUT,)
            self.get_raw, self.get_args = q.get, (TIMEOUT,)
        elif system == ZMQ:
            import zmq

            from shmchan.bench.fastpeers import ZmqEnd

            end = ZmqEnd("msg", 1, CAPACITY)
            self.closers.append(end.close)
            push = end.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(end.address)
            self.closers.insert(0, lambda: push.close(linger=0))
            self.put_raw, self.put_args = push.send, ()
            self.get_raw, self.get_args = end.sock.recv, ()
        elif system == FFIFO:
            import faster_fifo

            fq = faster_fifo.Queue(max_size_bytes=CAPACITY)
            self.put_raw, self.put_args = fq.put, (True, TIMEOUT)
            self.get_raw, self.get_args = fq.get, (True, TIMEOUT)
        else:
            mq = ctx.Queue()
            self.closers.append(lambda: (mq.close(), mq.join_thread()))
            self.put_raw, self.put_args = mq.put, (True, TIMEOUT)
            self.get_raw, self.get_args = mq.get, (True, TIMEOUT)

    def put_n(self, n: int) -> float:
        put, p, args = self.put_raw, self.p, self.put_args
        with no_gc():
            t0 = time.thread_time_ns()
            if len(args) == 1:
                a = args[0]
                for _ in range(n):
                    put(p, a)
            elif len(args) == 2:
                a, b = args
                for _ in range(n):
                    put(p, a, b)
            else:
                for _ in range(n):
                    put(p)
            t = time.thread_time_ns() - t0
        self.get_n(n)  # untimed: empty it again
        return t

    def get_n(self, n: int) -> float:
        get, args = self.get_raw, self.get_args
        with no_gc():
            t0 = time.thread_time_ns()
            if len(args) == 1:
                a = args[0]
                for _ in range(n):
                    get(a)
            elif len(args) == 2:
                a, b = args
                for _ in range(n):
                    get(a, b)
            else:
                for _ in range(n):
                    get()
            return time.thread_time_ns() - t0

    def timed_get(self, n: int) -> float:
        put, p, args = self.put_raw, self.p, self.put_args
        for _ in range(n):
            put(p, *args)
        if self.system in (ZMQ, MPQ):  # let an I/O or feeder thread deliver them first
            time.sleep(0.02 + n * 2e-6)
        return self.get_n(n)

    def close(self) -> None:
        for c in self.closers:
            with contextlib.suppress(Exception):
                c()


def _run_percall(run: Run) -> None:
    n = 2_000 if run.quick else 20_000
    with contextlib.ExitStack() as stack:
        shm = _Shmchan()
        stack.callback(shm.close)
        # (workload, system, note, timer, reference)
        rows: list[tuple[str, str, str, Timer, bool]] = [
            ("percall_floor", FLOOR, "(0).bit_length() three times", _floor3, True),
            ("percall_loop", LOOP, "for _ in range(n): pass", _loop, True),
            ("percall_send", SHMCHAN, "send(payload, key)", shm.send_key, False),
            ("percall_send_nokey", SHMCHAN, "send(payload), no keys", shm.send_nokey, False),
            ("percall_recv", SHMCHAN, "recv() + release()", shm.recv_release, False),
            (
                "percall_recv_payload",
                SHMCHAN,
                "recv() + payload + release()",
                shm.recv_payload_release,
                False,
            ),
            (
                "percall_recv_many",
                SHMCHAN,
                "recv_many(256) + release() each, per message",
                shm.recv_many_each,
                False,
            ),
            (
                "percall_recv_many_release_many",
                SHMCHAN,
                "recv_many(256) + release_many, per message",
                shm.recv_many_release_many,
                False,
            ),
        ]
        for system in (ZEROQ, ZMQ, FFIFO, MPQ):
            if system not in run.systems:
                continue
            q = _Queue(system, run.ctx)
            stack.callback(q.close)
            put = "send" if system == ZMQ else "put"
            get = "recv" if system == ZMQ else "get"
            rows.append(("percall_send", system, put, q.put_n, False))
            rows.append(("percall_recv", system, get, q.timed_get, False))
        samples: dict[tuple[str, str], list[float]] = {(w, s): [] for w, s, *_ in rows}
        for rep in range(-1, run.sizes.reps):
            for w, s, _, timer, _ in rows:
                # mp.Queue costs tens of us a call: a tenth of the calls is plenty
                k = max(200, n // 10) if s == MPQ else n
                ns = timer(k) / k
                if rep >= 0:
                    samples[w, s].append(ns)
            run.progress.step("per call")
    for w, s, note, _, ref in rows:
        run.results.append(
            Result(w, LABEL, s, "ns", False, samples[w, s], reference=ref, note=note)
        )


def _steps(sizes: Sizes, nsys: int) -> int:
    return sizes.reps + 1


def _targets(results: list[Result]) -> list[Target]:
    recv = find_result(results, "percall_recv", SHMCHAN)
    peer = best_peer(results, "percall_recv")
    floor = find_result(results, "percall_floor", FLOOR)
    detail = "recv() + release() vs the cheapest plain queue get, one process"
    if peer is not None and recv is not None:
        detail += f" (this run: {recv.median:.0f} ns vs {peer.system} {peer.median:.0f} ns"
        if floor is not None:
            detail += f"; floor of 3 trivial C calls {floor.median:.0f} ns"
        detail += ")"
    return [
        Target(
            "per call: recv+release / best peer's get",
            None if recv is None or peer is None else recv.median / peer.median,
            1.0,
            "<=",
            detail,
        )
    ]


register("percall", _run_percall, steps=_steps, order=8, targets=_targets)
