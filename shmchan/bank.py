"""The bank of the demo: its operations, its one rule (no overdraft), and the serial
replay every run is checked against. Shared by the demo on processes (shmchan.demo) and
on Spark (shmchan.spark.demo), so that both are checked against the same rules.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, MutableSequence, Sequence

__all__ = [
    "TRANSFER",
    "DEPOSIT",
    "WITHDRAW",
    "Op",
    "INITIAL_BALANCE",
    "MAX_AMOUNT",
    "make_ops",
    "keys_of",
    "apply",
    "replay",
    "compare",
]

# An operation is a plain tuple, so it pickles small:
#   (kind, a, b, amount, producer, index)
# kind TRANSFER moves `amount` from account a to account b (a != b),
# WITHDRAW takes it out of a, DEPOSIT puts it into a (b is -1 for both);
# (producer, index) names the message so the demo can match what a worker
# received against what the producer logged.
TRANSFER = "transfer"
DEPOSIT = "deposit"
WITHDRAW = "withdraw"
Op = tuple[str, int, int, int, int, int]

INITIAL_BALANCE = 100
MAX_AMOUNT = 100  # amounts are 1..MAX_AMOUNT, so overdrafts are common and order matters


def make_ops(producer: int, count: int, accounts: int, seed: int) -> list[Op]:
    """The `count` operations producer `producer` sends: deterministic for a seed."""
    rng = random.Random(seed * 1_000_003 + producer)
    ops: list[Op] = []
    for index in range(count):
        r = rng.random()
        amount = rng.randint(1, MAX_AMOUNT)
        a = rng.randrange(accounts)
        if r < 0.8 and accounts > 1:
            b = rng.randrange(accounts - 1)
            b += b >= a  # any account but a
            ops.append((TRANSFER, a, b, amount, producer, index))
        elif r < 0.9:
            ops.append((DEPOSIT, a, -1, amount // 2 + 1, producer, index))
        else:
            ops.append((WITHDRAW, a, -1, amount, producer, index))
    return ops


def keys_of(op: Op) -> tuple[str, ...]:
    """The keys a message carries: every account the operation reads or writes."""
    kind, a, b = op[0], op[1], op[2]
    if kind == TRANSFER:
        return (f"acct:{a}", f"acct:{b}")
    return (f"acct:{a}",)


def apply(balances: MutableSequence[int], op: Op) -> bool:
    """Apply one operation; False if the overdraft rule rejects it.

    The same function runs in the workers (on the shared array, concurrently)
    and in the serial replay (on a list), so the check compares schedules, not
    two implementations. It deliberately reads and then writes each balance
    without a lock: only the key lock on the account makes that safe.
    """
    kind, a, b, amount = op[0], op[1], op[2], op[3]
    if kind == DEPOSIT:
        balances[a] += amount
        return True
    if balances[a] < amount:
        return False  # overdraft: rejected, nothing changes
    balances[a] -= amount
    if kind == TRANSFER:
        balances[b] += amount
    return True


def replay(
    ops_in_order: Iterable[tuple[int, Op]], accounts: int
) -> tuple[list[int], dict[int, bool]]:
    """Apply `(seq, op)` pairs one at a time; return final balances and decisions by seq."""
    balances = [INITIAL_BALANCE] * accounts
    decisions = {seq: apply(balances, op) for seq, op in ops_in_order}
    return balances, decisions


def compare(
    expected_balances: Sequence[int],
    expected_decisions: dict[int, bool],
    balances: Sequence[int],
    decisions: dict[int, bool],
    limit: int = 5,
) -> list[str]:
    """Differences between a serial replay and the concurrent result ([] if none)."""
    problems: list[str] = []
    wrong = [s for s in sorted(expected_decisions) if decisions.get(s) != expected_decisions[s]]
    for seq in wrong[:limit]:
        problems.append(
            f"seq {seq}: replay {_verdict(expected_decisions[seq])}, "
            f"workers {_verdict(decisions.get(seq))}"
        )
    if len(wrong) > limit:
        problems.append(f"... {len(wrong) - limit} more decisions differ")
    extra = sorted(set(decisions) - set(expected_decisions))
    if extra:
        problems.append(f"{len(extra)} decisions for seqs never sent, e.g. {extra[:limit]}")
    diff = [i for i in range(len(expected_balances)) if balances[i] != expected_balances[i]]
    for i in diff[:limit]:
        problems.append(f"account {i}: replay {expected_balances[i]}, workers {balances[i]}")
    if len(diff) > limit:
        problems.append(f"... {len(diff) - limit} more balances differ")
    return problems


def _verdict(ok: bool | None) -> str:
    return {True: "accepted", False: "rejected", None: "missing"}[ok]


# --------------------------------------------------------------------------- processes
