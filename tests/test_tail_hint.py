"""The tail hint is raised lazily: small sends write no shared word but their record's,
and nothing that reads the ring's fill level, nor any later sender, is misled by the lag."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys

import pytest
from procs import layout_fact

import shmchan

WAIT = 20

KILLED_AFTER_SENDS = """
import os, signal, sys
import shmchan
tx = shmchan.Sender.open(sys.argv[1])
for i in range(5):
    tx.send(b"from the dead %d" % i, keys="k", timeout=20)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no detach: as a crash leaves it
"""


def _hint_and_tail(ch: shmchan.Channel) -> tuple[int, int]:
    """The header's tail hint, and the tail found by following records from it."""
    with open(shmchan._segment.name_file(ch.name, None), "rb") as f:
        seg = f.read()
    (ring_off,) = struct.unpack_from("<Q", seg, layout_fact("header.ring_off"))
    (hint,) = struct.unpack_from("<Q", seg, layout_fact("header.tail_hint"))
    tail = hint
    for _ in range(ch.capacity // 32):
        owner, meta = struct.unpack_from("<QQ", seg, ring_off + tail % ch.capacity)
        if owner & 1:
            break
        tail += meta >> 8
    return hint, tail


def test_small_sends_leave_the_shared_hint_behind(make_channel):
    ch = make_channel()
    with ch.sender() as tx:
        for i in range(5):
            tx.send(b"x" * 64, keys=f"k{i}", timeout=WAIT)
    hint, tail = _hint_and_tail(ch)
    assert hint == 0 < tail  # five small records: no raise of the shared word yet


def test_the_hint_keeps_up_within_a_stride(make_channel):
    ch = make_channel()
    with ch.sender() as tx:
        for i in range(500):
            tx.send(b"x" * 64, keys=f"k{i % 7}", timeout=WAIT)
    hint, tail = _hint_and_tail(ch)
    assert 0 < tail - hint <= 2048 + 512  # a stride, and the record that crossed it


def test_stats_count_records_the_hint_has_not_reached(make_channel):
    ch = make_channel()
    with ch.sender() as tx:
        tx.send(b"x" * 64, keys="k", timeout=WAIT)
    hint, tail = _hint_and_tail(ch)
    assert hint < tail
    assert ch.stats().used_bytes == tail  # read through the ring, not the lagging hint


def test_a_producer_killed_with_the_hint_behind_loses_nothing(make_channel):
    # A producer SIGKILLed after sends that did not raise the hint (as one killed between
    # its claim and its hint raise would): a new producer, which has no record of its
    # own to start from, walks from the lagging hint to the tail, and every message is
    # delivered in order.
    ch = make_channel()
    child = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_SENDS, ch.name], timeout=60, capture_output=True
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    hint, tail = _hint_and_tail(ch)
    assert hint < tail  # the dead producer left the hint behind its records
    assert ch.stats().used_bytes == tail
    with shmchan.Sender.open(ch.name) as tx:
        tx.send(b"after", keys="k", timeout=WAIT)
    with ch.receiver() as rx:
        got = []
        for _ in range(6):
            h = rx.recv(timeout=WAIT)
            got.append(h.payload)
            h.release()
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=0.05)
    assert got == [b"from the dead %d" % i for i in range(5)] + [b"after"]
    assert ch.stats().used_bytes == 0
