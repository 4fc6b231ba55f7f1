"""The operator's view of a stuck key: who holds it, for how long, what waits behind it.

A worker process takes the message on acct:1 and sits on it. Messages behind it on acct:1
-- and, through a transfer, on acct:2 and acct:3 -- wait. From this process (any process
on the machine would do) we ask the channel what is held and why a message waits, and
print the `python -m shmchan stat` screen an operator would see; then the worker lets go
and everything drains.

Run it with `python examples/stuck_key.py`.
"""

import multiprocessing as mp
import os
import subprocess
import sys

import shmchan


def slow_worker(name: str, holding: "mp.synchronize.Event", done: "mp.synchronize.Event") -> None:
    """The receiver: takes one message and holds it until told to let go."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    h = rx.recv(timeout=30)
    holding.set()
    done.wait(60)
    h.release()
    rx.close()
    ch.close()


def main() -> int:
    name = f"stuck-{os.getpid()}"
    ch = shmchan.Channel.create(name, capacity=1 << 20)
    ctx = mp.get_context("spawn")
    holding, done = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=slow_worker, args=(name, holding, done))
    try:
        with ch.sender() as tx:
            tx.send({"deposit": 5}, keys=("acct:1",))
            worker.start()
            if not holding.wait(60):
                return 1
            tx.send({"transfer": 1}, keys=("acct:1", "acct:2"))
            waiting = tx.send({"transfer": 2}, keys=("acct:2", "acct:3"))
        print("held:", ch.held())
        print("deepest lines:", ch.waiting(top=5))
        print(f"why is seq {waiting} waiting?", ch.why_waiting(waiting))
        shell = [sys.executable, "-m", "shmchan", "stat", name]
        print(f"\n$ python -m shmchan stat {name}")
        print(subprocess.run(shell, capture_output=True, text=True, timeout=60).stdout)
        why = subprocess.run([*shell, "--why", str(waiting)], capture_output=True, text=True)
        print(f"$ python -m shmchan stat {name} --why {waiting}\n{why.stdout}")
        done.set()
        worker.join(60)
        return 0 if worker.exitcode == 0 else 1
    finally:
        done.set()
        if worker.is_alive():
            worker.kill()
        ch.unlink()
        ch.close()


if __name__ == "__main__":
    sys.exit(main())
