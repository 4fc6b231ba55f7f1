"""Quickstart: a channel, a producer process, and key-locked handles.

Run it with `python examples/quickstart.py`.
"""

import multiprocessing as mp
import os

import shmchan


def produce(tx: shmchan.Sender) -> None:
    """Runs in a child process: the Sender was pickled over and re-attached by name."""
    tx.send({"op": "deposit", "amount": 50}, keys=("acct:1",))
    tx.send({"op": "transfer", "amount": 20}, keys=("acct:1", "acct:2"))
    tx.send(b"bytes travel as they are", keys=("acct:3",))


def main() -> None:
    ch = shmchan.Channel.create(f"quickstart-{os.getpid()}", capacity=1 << 20)
    try:
        child = mp.get_context("spawn").Process(target=produce, args=(ch.sender(),))
        child.start()
        child.join(timeout=30)

        rx = ch.receiver()  # a channel has one receiver; it hands out key-locked handles
        deposit = rx.recv(timeout=5)  # holds acct:1 until released
        print(deposit.seq, deposit.keys, deposit.payload)
        with rx.recv(timeout=5) as h:  # the transfer must wait for acct:1, acct:3 is free
            print(h.seq, h.keys, h.payload)  # `with` releases the handle on exit
        print("while acct:1 is held:", rx.try_recv())  # None: the transfer waits its turn
        deposit.release()  # frees acct:1 for the next message in line
        with rx.recv(timeout=5) as h:
            print(h.seq, h.keys, h.payload)
        print(ch.stats())
    finally:
        ch.unlink()  # remove the name; this process's mapping stays valid until close
        ch.close()


if __name__ == "__main__":
    main()
