"""Lowest seq first among the ready messages, however they became ready.

Messages that become ready as they arrive wait on a FIFO lane; those freed later (woken
behind a released key, given back by a nack, resumed after a pause) are older and wait
elsewhere. Whatever the mix, the next handed out is the ready one sent first, and the
core's cross-check of its tables holds after every step.
"""

from __future__ import annotations

from procs import check_core


def test_message_freed_by_a_release_goes_before_newer_arrivals(tx, rx):
    tx.send(b"a0", keys="a")
    holder = rx.recv(timeout=5)
    tx.send(b"a1", keys="a")  # waits for the holder
    tx.send(b"b", keys="b")
    tx.send(b"c", keys="c")
    assert rx.recv(timeout=5).data == b"b"  # "c" stays ready, "a1" waits
    check_core(rx)
    holder.release()  # "a1" (sent before "c") is free now
    assert [rx.recv(timeout=5).data for _ in range(2)] == [b"a1", b"c"]
    check_core(rx)


def test_nacked_message_goes_before_newer_arrivals_on_other_keys(tx, rx):
    for k in "abcd":
        tx.send(k.encode(), keys=k)
    first = rx.recv(timeout=5)
    assert first.data == b"a"
    first.nack()  # back, older than everything still ready
    check_core(rx)
    assert [rx.recv(timeout=5).data for _ in range(4)] == [b"a", b"b", b"c", b"d"]
    check_core(rx)


def test_resumed_key_goes_before_newer_arrivals(ch, tx, rx):
    ch.pause_key("a")
    for k in "abc":
        tx.send(k.encode(), keys=k)
    assert rx.recv(timeout=5).data == b"b"  # "a" is held back, "c" stays ready
    check_core(rx)
    tx.send(b"d", keys="d")
    ch.resume_key("a")
    assert [rx.recv(timeout=5).data for _ in range(3)] == [b"a", b"c", b"d"]
    check_core(rx)


def test_long_mixed_run_keeps_send_order_per_free_message(tx, rx):
    """Many keys cycling, every fourth message nacked once: each recv gives the lowest
    seq among the messages free at that moment."""
    n, keys = 600, 37
    for i in range(n):
        tx.send(i.to_bytes(4, "little"), keys=i % keys)
    out: list[int] = []
    nacked: set[int] = set()
    while len(out) < n:
        h = rx.recv(timeout=5)
        i = int.from_bytes(h.data, "little")
        if i % 4 == 0 and i not in nacked:
            nacked.add(i)
            h.nack()
            continue
        out.append(i)
        h.release()
        if len(out) % 97 == 0:
            check_core(rx)
    # With each message released before the next recv, every message is free once the
    # one before it on its key is done: so they come out in send order.
    assert out == list(range(n))
    check_core(rx)
