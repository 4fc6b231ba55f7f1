"""The demo: concurrent bank transfers through a key-locked channel equal a serial replay.

`python -m shmchan demo` starts a few producer processes that send order-dependent
work -- transfers between accounts, deposits, withdrawals, with an overdraft rule --
through one channel. Every message carries the keys of the accounts it touches. This
process serves the channel with a `shmchan.KeyedPool`: it receives the key-locked
handles and hands them to the pool's worker processes, which run `_Apply` on each
message. The workers update balances that live in one shared array *without any lock
of their own*: shmchan's key locks are what make that safe.

At the end the demo replays the producers' log serially, in `seq` order, and checks
that the final balances and every accept / reject decision equal what the workers
computed concurrently. With `order="fifo"` that is exactly shmchan's promise.
With `order="eager"` keys are still exclusive but not ordered, so the demo checks
the weaker promise instead: the result equals a serial replay in hand-out order.
`--no-keys` is the control experiment: without keys nothing protects the balances,
and the check is expected to fail.

Every wait is bounded (`--timeout`), and the channel is unlinked on every exit path,
Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import shmchan

from .bank import (  # the bank's rules (re-exported: the demo's API)
    DEPOSIT,
    INITIAL_BALANCE,
    MAX_AMOUNT,
    TRANSFER,
    WITHDRAW,
    Op,
    apply,
    compare,
    keys_of,
    make_ops,
    replay,
)

__all__ = ["add_arguments", "main", "run", "make_ops", "keys_of", "apply", "replay", "compare"]
__all__ += ["TRANSFER", "DEPOSIT", "WITHDRAW", "INITIAL_BALANCE", "MAX_AMOUNT"]


CHUNK = 64  # at most this many handles per hand-over to one worker

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_INTERRUPTED = 130


def _producer(
    tx: shmchan.Sender,
    producer: int,
    count: int,
    accounts: int,
    seed: int,
    no_keys: bool,
    timeout: float,
    ready: Any,
    go: Any,
    logs: Any,
) -> None:
    """Producer process: send `count` operations, then report `(seq, op)` for each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    ops = make_ops(producer, count, accounts, seed)
    ready.put(("producer", producer))
    if not go.wait(timeout):
        sys.exit(f"demo producer {producer}: never told to start")
    log: list[tuple[int, Op]] = []
    try:
        for op in ops:
            seq = tx.send(op, keys=() if no_keys else keys_of(op), timeout=timeout)
            log.append((seq, op))
    except shmchan.Error as e:
        sys.exit(f"demo producer {producer}: {type(e).__name__}: {e}")
    logs.put((producer, log))


class _Apply:
    """The KeyedPool handler: apply one operation to the shared balances.

    Everything it writes lives in shared arrays with *no lock of their own*: the
    message's keys (the accounts it touches) are what make that safe. Besides the
    balance it records, per message, whether it was accepted, how many times it ran,
    and a Lamport stamp: one more than the largest stamp of the accounts it touches,
    which it then gives those accounts. Sorting by stamp gives an order in which every
    account sees its operations exactly as the workers applied them, i.e. the channel's
    hand-out order per key, which the check needs."""

    def __init__(self, balances: Any, clocks: Any, results: Any, offsets: list[int]) -> None:
        self.balances = balances
        self.clocks = clocks  # per account: the stamp of the last operation on it
        self.results = results  # per message: accepted, runs, stamp (3 ints)
        self.offsets = offsets  # producer -> index of its first message in `results`

    def __call__(self, op: Op, keys: tuple[Any, ...]) -> None:
        i = 3 * (self.offsets[op[4]] + op[5])
        touched = (op[1], op[2]) if op[0] == TRANSFER else (op[1],)
        stamp = max(self.clocks[a] for a in touched) + 1
        for a in touched:
            self.clocks[a] = stamp
        self.results[i] = apply(self.balances, op)
        self.results[i + 1] += 1
        self.results[i + 2] = stamp


# --------------------------------------------------------------------------- consumer


@dataclass
class _Outcome:
    logs: dict[int, list[tuple[int, Op]]]  # producer -> [(seq, op)] in send order
    done: list[tuple[int, int, int, bool]]  # (seq, producer, index, accepted), all workers
    handout: list[tuple[int, tuple[str, ...]]]  # (seq, keys) in the order the workers
    # applied them, per key (by Lamport stamp: see _Apply)
    balances: list[int]
    elapsed: float
    stats: shmchan.Stats | None  # None only in unit tests of the checker


class _DemoFailed(Exception):
    """Something other than the final comparison went wrong (a child died, a timeout)."""


class _Progress:
    """A one-line progress counter on stderr, only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def update(self, n: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and (force or now - self.last >= 0.2):
            self.last = now
            print(f"\r  handled {n}/{self.total}", end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.enabled:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_consumer(
    ch: shmchan.Channel,
    args: argparse.Namespace,
    ctx: Any,
    children: list[Any],
    queues: list[Any],
    pools: list[shmchan.KeyedPool],
) -> _Outcome:
    """Start the producers and a KeyedPool of workers on the channel, wait until every
    message was handled, and collect the results.

    Appends every process it starts to `children`, every queue to `queues` and the
    pool to `pools`, so the caller can clean up whatever happens here.
    """
    counts = _split(args.messages, args.producers)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    balances = ctx.RawArray("q", [INITIAL_BALANCE] * args.accounts)  # no lock: keys protect it
    clocks = ctx.RawArray("q", args.accounts)
    results = ctx.RawArray("q", 3 * args.messages)
    queues[:] = [ctx.Queue() for _ in range(2)]
    ready, logs_q = queues
    go = ctx.Event()
    tx = ch.sender()
    producers = [
        ctx.Process(
            target=_producer,
            name=f"demo-producer-{i}",
            args=(
                tx,
                i,
                n,
                args.accounts,
                args.seed,
                args.no_keys,
                args.timeout,
                ready,
                go,
                logs_q,
            ),
            daemon=True,
        )
        for i, n in enumerate(counts)
    ]
    for p in producers:
        p.start()
        children.append(p)
    # The pool: this process becomes the channel's receiver and hands key-locked handles
    # to its worker processes, which run _Apply for each message.
    pool = shmchan.KeyedPool(
        ch.name,
        _Apply(balances, clocks, results, offsets),
        processes=args.workers,
        mp_context=ctx,
    )
    pools.append(pool)

    deadline = time.monotonic() + args.timeout

    def remaining() -> float:
        left: float = deadline - time.monotonic()
        if left <= 0:
            raise _DemoFailed(f"timed out after {args.timeout:g} s (raise --timeout?)")
        return left

    def check_producers() -> None:
        for p in producers:
            if p.exitcode not in (None, 0):
                raise _DemoFailed(f"{p.name} exited with code {p.exitcode}")

    # Start the clock once every producer is up, so process start-up is not measured.
    for _ in producers:
        while True:
            check_producers()
            try:
                ready.get(timeout=min(0.2, remaining()))
                break
            except queue.Empty:
                pass
    go.set()
    start = time.monotonic()

    logs: dict[int, list[tuple[int, Op]]] = {}
    progress = _Progress(args.messages)
    while len(logs) < len(producers):
        remaining()
        check_producers()
        progress.update(pool.stats().handled)
        with contextlib.suppress(queue.Empty):
            producer, log = logs_q.get(timeout=0.1)
            logs[producer] = log
    # Every message is sent. Once the pool has handled them all, shut the channel
    # down: the pool then finds it drained and ends.
    while (handled := pool.stats().handled) < args.messages:
        remaining()
        progress.update(handled)
        time.sleep(0.01)
    ch.shutdown()
    while not pool.join(min(0.2, remaining())):
        pass
    progress.update(args.messages, force=True)
    progress.finish()
    elapsed = time.monotonic() - start
    for p in producers:
        p.join(timeout=remaining())

    seq_of = {(op[4], op[5]): seq for log in logs.values() for seq, op in log}
    ops_by_seq = {seq: op for log in logs.values() for seq, op in log}
    done: list[tuple[int, int, int, bool]] = []
    stamped: list[tuple[int, int]] = []  # (stamp, seq) of every message that ran
    for producer, count in enumerate(counts):
        for index in range(count):
            i = 3 * (offsets[producer] + index)
            accepted, runs, stamp = results[i], results[i + 1], results[i + 2]
            seq = seq_of.get((producer, index), -1)
            done += [(seq, producer, index, bool(accepted))] * runs
            if runs and seq in ops_by_seq:
                stamped.append((stamp, seq))
    handout = [(seq, keys_of(ops_by_seq[seq])) for _, seq in sorted(stamped)]
    return _Outcome(logs, done, handout, list(balances), elapsed, ch.stats())


# --------------------------------------------------------------------------- checking


def _check(outcome: _Outcome, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Return (problems, notes); the demo passes when problems is empty."""
    problems: list[str] = []
    notes: list[str] = []
    sent: dict[int, Op] = {}
    for _producer, log in sorted(outcome.logs.items()):
        for seq, op in log:
            if seq in sent:
                problems.append(f"seq {seq} returned by send() twice")
            sent[seq] = op
    if len(sent) != args.messages:
        problems.append(f"producers logged {len(sent)} distinct seqs, expected {args.messages}")

    processed: dict[int, bool] = {}
    for seq, producer, index, accepted in outcome.done:
        if seq in processed:
            problems.append(f"seq {seq} processed twice")
        processed[seq] = accepted
        found = sent.get(seq)
        if found is None:
            problems.append(f"seq {seq} processed but never sent")
        elif (found[4], found[5]) != (producer, index):
            problems.append(
                f"seq {seq} carried message {producer}/{index}, "
                f"but send() returned it for {found[4]}/{found[5]}"
            )
    missing = sorted(set(sent) - set(processed))
    if missing:
        problems.append(f"{len(missing)} messages never processed, e.g. seqs {missing[:5]}")

    if args.order == "fifo" and not args.no_keys:
        # The fifo rule, seen from the consumer: on every key, hand-out order is seq order.
        last: dict[str, int] = {}
        bad = 0
        for seq, keys in outcome.handout:
            for k in keys:
                if last.get(k, -1) > seq:
                    bad += 1
                    if bad <= 5:
                        problems.append(f"key {k}: seq {seq} handed out after seq {last[k]}")
                last[k] = max(last.get(k, -1), seq)

    st = outcome.stats
    if st is not None and (st.queued, st.inflight, st.held_keys) != (0, 0, 0):
        problems.append(
            f"after every handle was released the channel still reports queued={st.queued} "
            f"inflight={st.inflight} held_keys={st.held_keys}"
        )

    if problems:
        return problems, notes

    by_seq = sorted(sent.items())
    seq_balances, seq_decisions = replay(by_seq, args.accounts)
    seq_problems = compare(seq_balances, seq_decisions, outcome.balances, processed)
    if args.order == "fifo" or args.no_keys:
        problems += seq_problems
    else:
        # eager: every key is still exclusive, so per key the processing order is the
        # hand-out order, and a serial replay in hand-out order must agree.
        in_handout_order = ((seq, sent[seq]) for seq, _ in outcome.handout)
        handout_balances, handout_decisions = replay(in_handout_order, args.accounts)
        problems += compare(handout_balances, handout_decisions, outcome.balances, processed)
        notes.append(
            "serial replay in seq order: "
            + ("also equal" if not seq_problems else "differs, as order=eager allows")
        )
    return problems, notes


# --------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to `parser` (used by `python -m shmchan demo`)."""
    add = parser.add_argument
    add("--messages", type=_positive_int, default=20_000, help="messages in total (default 20000)")
    add("--producers", type=_positive_int, default=3, help="producer processes (default 3)")
    add("--workers", type=_positive_int, default=4, help="worker processes (default 4)")
    add("--accounts", type=_accounts, default=50, help="bank accounts, at least 2 (default 50)")
    add("--order", choices=("fifo", "eager"), default="fifo", help="channel order (default fifo)")
    add(
        "--capacity",
        type=_positive_int,
        default=1 << 20,
        help="channel capacity in bytes (default 1 MiB)",
    )
    add("--seed", type=int, default=0, help="workload seed (default 0)")
    add(
        "--timeout",
        type=_positive_float,
        default=60.0,
        help="give up after this many seconds (default 60)",
    )
    add(
        "--spark",
        action="store_true",
        help="run the pipeline demo on Spark instead (shmchan.spark: needs the [spark] extra "
        "and Java 17+; SPARK_MASTER picks the master, default local[*])",
    )
    add(
        "--stream",
        action="store_true",
        help="with --spark: land the transfers as files in a directory that a Structured "
        "Streaming query processes micro-batch by micro-batch (process_keyed_stream)",
    )
    add(
        "--no-keys",
        action="store_true",
        help="control experiment: send without keys, so nothing protects the balances "
        "(expected to fail)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; return the process exit code."""
    if getattr(args, "spark", False):
        from shmchan.spark import demo as spark_demo

        if getattr(args, "stream", False):
            return spark_demo.run_stream(args)
        return spark_demo.run(args)
    if getattr(args, "stream", False):
        print("--stream runs on Spark: use it with --spark", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    name = f"shmchan-demo-{os.getpid()}"
    keys_note = "WITHOUT keys (control experiment)" if args.no_keys else "keys = accounts touched"
    print(
        f"shmchan demo: {args.messages} transfers/deposits/withdrawals, "
        f"{args.producers} producers, {args.workers} workers, {args.accounts} accounts, "
        f"order={args.order}, {keys_note}"
    )
    ch = shmchan.Channel.create(name, args.capacity, order=args.order, max_keys=2)
    children: list[Any] = []
    queues: list[Any] = []
    pools: list[shmchan.KeyedPool] = []
    try:
        print(f"channel: {name}", flush=True)
        outcome = _run_consumer(ch, args, ctx, children, queues, pools)
    except _DemoFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        _cleanup(ch, children, queues, pools)

    problems, notes = _check(outcome, args)
    accepted = sum(1 for d in outcome.done if d[3])
    s = outcome.stats
    n = len(outcome.done)
    print(f"messages:   {n} (accepted {accepted}, rejected {n - accepted})")
    print(f"elapsed:    {outcome.elapsed:.2f} s")
    print(f"throughput: {n / max(outcome.elapsed, 1e-9):,.0f} msgs/s")
    if s is not None:
        print(
            f"stats:      sent={s.sent} delivered={s.delivered} released={s.released} "
            f"redelivered={s.redelivered}"
        )
    for note in notes:
        print(f"note:       {note}")
    if problems:
        what = "seq order" if args.order == "fifo" or args.no_keys else "hand-out order"
        print(f"MISMATCH: concurrent result differs from serial replay in {what}:")
        for p in problems:
            print(f"  {p}")
        if args.no_keys:
            print(
                "(expected with --no-keys: nothing stopped two workers "
                "from touching one account at once)"
            )
        return EXIT_MISMATCH
    if args.order == "fifo":
        print("OK: concurrent result equals serial replay in seq order")
    else:
        print("OK: concurrent result equals serial replay in hand-out order")
    return EXIT_OK


def _cleanup(
    ch: shmchan.Channel, children: list[Any], queues: list[Any], pools: list[shmchan.KeyedPool]
) -> None:
    """Stop the pool and our children and remove the channel; never raises, ignores a
    second Ctrl-C."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for pool in pools:
            pool.terminate()  # a no-op once it has ended on its own
            pool.join(10)
        for q in queues:
            q.cancel_join_thread()  # never block exit on data nobody will read
        for p in children:
            if p.is_alive():
                p.terminate()
        for p in children:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        with contextlib.suppress(Exception):
            ch.unlink()
        with contextlib.suppress(Exception):
            ch.close()
    finally:
        signal.signal(signal.SIGINT, old)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m shmchan.demo [options]`: parse options and run the demo."""
    parser = argparse.ArgumentParser(prog="shmchan demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _accounts(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
