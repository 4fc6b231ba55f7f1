"""Exchange fan-out: one publish, several consumers, all or nothing.

A topic exchange routes order events to two channels, each served by its own consumer
process: "audit" gets every event, "billing" only payments. Each consumer receives its
messages with their keys, in order per key.

Run it with `python examples/fanout.py`.
"""

import multiprocessing as mp
import os
import sys

import shmchan


def consume(name: str, expected: int, out: "mp.Queue[str]") -> None:
    """A consumer process: take `expected` messages from channel `name`."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    for _ in range(expected):
        with rx.recv(timeout=30) as h:
            out.put(f"{name}: seq {h.seq} keys {h.keys} {h.payload}")
    rx.close()
    ch.close()


def main() -> int:
    tag = os.getpid()
    audit = shmchan.Channel.create(f"audit-{tag}", capacity=1 << 20)
    billing = shmchan.Channel.create(f"billing-{tag}", capacity=1 << 20)
    ex = shmchan.Exchange.create(f"orders-{tag}", kind="topic")
    try:
        ex.bind(audit.name, "orders.#")
        ex.bind(billing.name, "orders.*.paid")
        events = [
            ("orders.eu.created", {"order": 1}, ("cust:7",)),
            ("orders.eu.paid", {"order": 1, "amount": 30}, ("cust:7",)),
            ("orders.us.created", {"order": 2}, ("cust:8",)),
            ("orders.us.paid", {"order": 2, "amount": 12}, ("cust:8",)),
            ("refunds.eu", {"order": 0}, ("cust:7",)),  # matches no binding
        ]
        for routing_key, payload, keys in events:
            routed = ex.publish(payload, routing_key=routing_key, keys=keys, timeout=5)
            print(f"{routing_key:<18} -> {sorted(routed) or 'nowhere'}")
        ctx = mp.get_context("spawn")
        out: mp.Queue[str] = ctx.Queue()
        consumers = [
            ctx.Process(target=consume, args=(audit.name, 4, out)),
            ctx.Process(target=consume, args=(billing.name, 2, out)),
        ]
        for p in consumers:
            p.start()
        lines = [out.get(timeout=60) for _ in range(6)]
        for p in consumers:
            p.join(timeout=60)
        for line in sorted(lines):
            print(line)
        print(ex.stats())
        return 0 if all(p.exitcode == 0 for p in consumers) else 1
    finally:
        for thing in (ex, audit, billing):
            thing.unlink()
            thing.close()


if __name__ == "__main__":
    sys.exit(main())
