"""An asyncio service consuming keyed messages that producer processes send.

Three producer processes send account events keyed by account. The service, an asyncio
program, awaits them (`async for h in rx`) without blocking its event loop: a heartbeat
task keeps ticking meanwhile, and each event is applied by its own task -- events of one
account never at the same time, and in the order they were sent, because the channel
hands out one event per account at a time until its handle is released.

Run it with `python examples/async_service.py`.
"""

import asyncio
import multiprocessing
import os
from collections import defaultdict

import shmchan

ACCOUNTS = 5
EVENTS = 200  # per producer


def producer(name: str, me: int) -> None:
    tx = shmchan.Sender.open(name)
    for i in range(EVENTS):
        tx.send((me, i, 1), keys=(f"acct:{i % ACCOUNTS}",), timeout=30)


async def serve(rx: shmchan.Receiver) -> dict[str, int]:
    balances: dict[str, int] = defaultdict(int)
    ticks = 0
    done = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    async def apply(h: shmchan.Handle) -> None:
        (account,) = h.keys
        _, _, amount = h.payload
        await asyncio.sleep(0)  # e.g. a database write; the account stays locked
        balances[account] += amount
        h.release()  # the account's next event may go now

    beat = asyncio.create_task(heartbeat())
    tasks = set()
    async for h in rx:  # ends once the channel is shut down and drained
        task = asyncio.create_task(apply(h))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    done.set()
    await beat
    print("heartbeat kept ticking while waiting:", ticks > 0)
    return dict(balances)


def main() -> None:
    name = f"async-service-{os.getpid()}"
    ch = shmchan.Channel.create(name, capacity=1 << 20)
    try:
        rx = ch.receiver()
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=producer, args=(name, m)) for m in range(3)]
        for p in procs:
            p.start()

        async def run() -> dict[str, int]:
            service = asyncio.create_task(serve(rx))
            # Shut the channel down once the producers are done; serve() then drains it.
            await asyncio.gather(*(asyncio.to_thread(p.join, 60) for p in procs))
            ch.shutdown()
            return await asyncio.wait_for(service, 60)

        balances = asyncio.run(run())
        print("balances:", dict(sorted(balances.items())))
        print("all events applied:", sum(balances.values()) == 3 * EVENTS)
    finally:
        ch.close()
        shmchan.unlink(name)


if __name__ == "__main__":
    main()
