"""Worker pool: keyed tasks, a worker that crashes, and the retry that follows.

Ten transfers between four accounts run in a KeyedExecutor of 3 worker processes. Tasks
that share an account never run at the same time, and run in submission order. The first
time transfer 4 runs, its worker dies (os._exit): the executor replaces the
worker and runs the task again (attempt 2), still before the tasks behind it on its keys.

Run it with `python examples/worker_pool.py`.
"""

import os
import sys
import tempfile

import shmchan


def transfer(n: int, src: str, dst: str, amount: int, crash_flag: str) -> str:
    """Runs in a worker process. Dies the first time transfer 4 is attempted."""
    if n == 4 and not os.path.exists(crash_flag):
        open(crash_flag, "w").close()
        os._exit(3)  # a crash: no exception, no cleanup, the process is gone
    return f"transfer {n}: {amount} from {src} to {dst} (worker pid {os.getpid()})"


def main() -> int:
    accounts = ["acct:1", "acct:2", "acct:3", "acct:4"]
    work = [(n, accounts[n % 4], accounts[(n + 1) % 4], 10 * n) for n in range(10)]
    with tempfile.TemporaryDirectory() as tmp:
        flag = os.path.join(tmp, "crashed-once")
        with shmchan.KeyedExecutor(max_workers=3, max_attempts=3) as ex:
            futures = [
                ex.submit(transfer, n, src, dst, amount, flag, keys=(src, dst))
                for n, src, dst, amount in work
            ]
            for fut in futures:
                print(fut.result(timeout=60))
            stats = ex.stats()
        print(f"a worker died once: {os.path.exists(flag)}; tasks retried: {stats.retried}")
    return 0 if stats.retried >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
