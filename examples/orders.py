"""Per-customer order processing with shmchan.KeyedExecutor.

Each order reads and rewrites its customer's ledger file, so two orders of one customer
must never run at the same time, and they must run in the order they were placed (an
order may be refused for lack of funds, so order matters). Orders of different
customers run in parallel. Keying each task by its customer gives exactly that.

One worker process crashes halfway through an order (a simulated segfault). The
executor replaces it and runs the order again -- still before that customer's later
orders -- so the ledgers end up exactly as a one-by-one run would leave them. The task
is written to be safe to run twice: it records which orders it applied.

Run it with `python examples/orders.py`.
"""

import functools
import json
import os
import random
import signal
import tempfile
from pathlib import Path

import shmchan

CRASH_ON = 17  # the order whose first attempt kills its worker


def place(ledger_dir: str, order: tuple[str, int, int]) -> str:
    """Apply one order to its customer's ledger; runs in a worker process."""
    customer, order_id, amount = order
    path = Path(ledger_dir, f"{customer}.json")
    ledger = json.loads(path.read_text()) if path.exists() else {"balance": 0, "applied": {}}
    if str(order_id) in ledger["applied"]:  # a retry after a crash: already done
        return ledger["applied"][str(order_id)]
    marker = Path(ledger_dir, "crashed-once")
    if order_id == CRASH_ON and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGSEGV)  # the worker dies in the middle of the order
    if ledger["balance"] + amount < 0:
        outcome = "refused"
    else:
        ledger["balance"] += amount
        outcome = "ok"
    ledger["applied"][str(order_id)] = outcome
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ledger))
    os.replace(tmp, path)  # atomic: a crash leaves the old ledger or the new one
    return outcome


def main() -> None:
    rng = random.Random(1)
    customers = [f"customer-{i}" for i in range(5)]
    orders = [(rng.choice(customers), i, rng.randint(-40, 50)) for i in range(60)]

    with tempfile.TemporaryDirectory() as ledgers:
        with shmchan.KeyedExecutor(max_workers=4) as ex:
            outcomes = list(
                ex.map(functools.partial(place, ledgers), orders, keys=lambda order: order[0])
            )
            stats = ex.stats()
        balances = {
            c: json.loads(Path(ledgers, f"{c}.json").read_text())["balance"]
            for c in customers
            if Path(ledgers, f"{c}.json").exists()
        }

    # The same orders one by one, in the order they were placed.
    expected: dict[str, int] = {}
    expected_outcomes = []
    for customer, _, amount in orders:
        balance = expected.get(customer, 0)
        ok = balance + amount >= 0
        expected[customer] = balance + amount if ok else balance
        expected_outcomes.append("ok" if ok else "refused")

    print(f"{len(orders)} orders, {outcomes.count('refused')} refused for lack of funds")
    print(f"worker crashes survived: {stats.retried} task(s) ran again")
    for customer in sorted(balances):
        print(f"  {customer}: balance {balances[customer]}")
    same = balances == expected and outcomes == expected_outcomes
    print("same as one order at a time:", "yes" if same else "NO")


if __name__ == "__main__":
    main()
