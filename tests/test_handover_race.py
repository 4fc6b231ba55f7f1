"""A stale hand-over step never touches the message's next handle.

A handle is (slot, generation). Pickling it, adopting it and extending its lease each
check the generation first and then change a word of the slot. If the message is taken
back (lease run out, hand-over time passed) and handed out again in between, the slot
has a new generation and a new holder: the late step must fail (a no-op, or
HandoverExpired) and leave the new handle alone. These tests stop the late step right
after its first check with the core's test pause points (csrc/handles.c), let the
message come round again, then let the step go on.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import shmchan
from shmchan._lib import lib

pytestmark = pytest.mark.timeout(60)


def _read_byte(fd: int, timeout: float) -> None:
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, "the paused step never reached its pause point"
    assert os.read(fd, 1)


def _recv_again(rx: Any, seq: int, timeout: float = 10.0) -> Any:
    """The next delivery of message `seq` (its lease or hand-over time runs out first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            h = rx.recv(timeout=0.2)
        except shmchan.Empty:
            continue
        assert h.seq == seq
        return h
    raise AssertionError(f"message {seq} was not delivered again within {timeout} s")


def _assert_not_delivered_again(rx: Any, seconds: float) -> None:
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=seconds)


class _Paused:
    """Run `fn` in a thread of this process, stopped at pause point `point`."""

    def __init__(self, point: int, fn: Callable[[], Any]) -> None:
        self.r_notify, self.w_notify = os.pipe()
        self.r_wait, self.w_wait = os.pipe()
        self.result: dict[str, Any] = {}
        lib.shm_test_pause_at(point, self.w_notify, self.r_wait)

        def run() -> None:
            try:
                self.result["value"] = fn()
            except Exception as e:  # reported to the test through result
                self.result["error"] = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        _read_byte(self.r_notify, 10)

    def go_on(self) -> dict[str, Any]:
        os.write(self.w_wait, b"g")
        self.thread.join(10)
        assert not self.thread.is_alive()
        for fd in (self.r_notify, self.w_notify, self.r_wait, self.w_wait):
            os.close(fd)
        return self.result


def test_a_late_pickle_does_not_put_the_next_handle_in_transit(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(lease=0.3, handover=0.6)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"m", keys="k")
    h1 = rx.recv(timeout=5)
    paused = _Paused(lib.SHM_PAUSE_HANDOVER_SEND, lambda: pickle.dumps(h1))
    # h1's lease runs out: the message comes back to this same process, a new handle
    # with the same holder (this process) and a new generation.
    h2 = _recv_again(rx, h1.seq)
    assert h2.attempt == 2
    h2.extend(math.inf)  # no lease: only a release (or this process's death) ends it
    result = paused.go_on()
    assert "error" not in result, result
    # Had the late pickle marked h2 in transit, h2 would be taken back once the pickle's
    # hand-over time (0.6 s from the pickling) passed, and delivered a third time.
    _assert_not_delivered_again(rx, 1.5)
    assert [(k.key, k.seq, k.attempt) for k in ch.held()] == [("k", h2.seq, 2)]
    h2.release()
    # The late pickle is a no-op handle wherever it is unpickled.
    late = pickle.loads(result["value"])
    assert late._done  # released already: nothing to release
    late.release()
    _assert_not_delivered_again(rx, 0.3)


def test_a_late_extend_does_not_set_the_next_handles_lease(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(lease=0.3)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"m", keys="k")
    h1 = rx.recv(timeout=5)
    paused = _Paused(lib.SHM_PAUSE_EXTEND, lambda: h1.extend(0.2))
    h2 = _recv_again(rx, h1.seq)
    h2.extend(math.inf)
    result = paused.go_on()
    # The late extend finds its handle gone (its lease ran out).
    assert isinstance(result.get("error"), shmchan.Error), result
    # Had it written its deadline (0.2 s from its call) into h2's lease, h2 would be
    # taken back and the message delivered again.
    _assert_not_delivered_again(rx, 1.0)
    h2.release()


_ADOPTER = r"""
import os, pickle, sys
import shmchan
from shmchan._lib import lib
notify, wait, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lib.shm_test_pause_at(lib.SHM_PAUSE_HANDOVER_ADOPT, notify, wait)
data = open(path, "rb").read()
try:
    h = pickle.loads(data)
except shmchan.HandoverExpired:
    print("expired", flush=True)
else:
    print("stale" if h._done else "adopted", flush=True)
"""


def test_a_late_adopter_does_not_take_the_next_handle(
    make_channel: Callable[..., Any], tmp_path: Any
) -> None:
    ch = make_channel(handover=0.5)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"m", keys="k")
    h1 = rx.recv(timeout=5)
    first = tmp_path / "first.pickle"
    first.write_bytes(pickle.dumps(h1))  # h1 in transit
    r_notify, w_notify = os.pipe()
    r_wait, w_wait = os.pipe()
    adopter = subprocess.Popen(
        [sys.executable, "-c", _ADOPTER, str(w_notify), str(r_wait), str(first)],
        pass_fds=(w_notify, r_wait),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # The adopter stops right after checking h1's generation ...
        _read_byte(r_notify, 20)
        # ... h1's hand-over time passes: taken back and delivered again (a new
        # generation), and the new handle is pickled in its turn.
        h2 = _recv_again(rx, h1.seq)
        second = pickle.dumps(h2)
        os.write(w_wait, b"g")
        out, _ = adopter.communicate(timeout=20)
    finally:
        if adopter.poll() is None:
            adopter.kill()
            adopter.wait()
        for fd in (r_notify, w_notify, r_wait, w_wait):
            os.close(fd)
    # The late adopter learns that h1 was taken back; it must not have taken h2.
    assert out.strip() == "expired"
    h3 = pickle.loads(second)  # h2's own pickle: adopted here, by this process
    assert h3.seq == h1.seq and not h3._done
    _assert_not_delivered_again(rx, 0.8)  # past h2's hand-over time: h3 holds it
    h3.release()
