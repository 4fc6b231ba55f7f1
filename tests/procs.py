"""Helpers shared by the tests that start processes: one spawn context, one bound on
every cross-process wait, and a context manager that never leaves a process behind."""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import select
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shmchan

CTX = multiprocessing.get_context("spawn")
WAIT = 30  # seconds any single cross-process wait may take before the test fails


@contextlib.contextmanager
def running(*procs: multiprocessing.process.BaseProcess) -> Iterator[None]:
    """Start the processes; whatever happens, leave none of them alive."""
    try:
        for p in procs:
            p.start()
        yield
    finally:
        for p in procs:
            if p.is_alive():
                p.join(0.5)
            if p.is_alive():
                p.kill()
            p.join(WAIT)


def child_env() -> dict[str, str]:
    """Make a child import the same shmchan as this test process (installed or in place)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_shmchan(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m shmchan ARGS` in a child, output captured, time bounded."""
    return subprocess.run(
        [sys.executable, "-m", "shmchan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def take_receiver_seat(ch: shmchan.Channel) -> shmchan.Receiver:
    """ch.receiver(), retried while the previous receiver's seat is still taken: its
    holder was killed and reaped, so ReceiverBusy lasts only until the seat is seen
    free (for longer than WAIT only by a bug)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return ch.receiver()
        except shmchan.ReceiverBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def wait_forked(pid: int, limit: float = WAIT) -> int | None:
    """The exit code of the forked child `pid`; None (after killing it) if it still runs
    after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def cpu_share(pid: int, settle: float = 0.5, seconds: float = 1.0) -> float:
    """The share of one core process `pid` uses over `seconds`, after `settle` seconds."""
    import psutil

    proc = psutil.Process(pid)
    time.sleep(settle)
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = sum(proc.cpu_times()[:2]), time.monotonic()
    return (cpu1 - cpu0) / (wall1 - wall0)


@contextlib.contextmanager
def held_by_another_thread(lock: Any) -> Iterator[None]:
    """Hold `lock` in another thread of this process for the duration of the block (what
    a fork at that moment copies into the child as held)."""
    import threading

    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            done.wait(WAIT)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(WAIT), "the other thread never took the lock"
        yield
    finally:
        done.set()
        holder.join(WAIT)


def layout_fact(name: str) -> int:
    """An offset or size in the segment's layout, from the C core (csrc/segment.c)."""
    from shmchan._lib import ffi, lib

    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


def check_core(rx: shmchan.Receiver) -> None:
    """The C core's own cross-check of the receiver's tables: key lines, parked chains,
    ready heap (csrc: shm_check_scheduler)."""
    from shmchan._lib import ffi, lib

    what = ffi.new("uint32_t *")
    assert lib.shm_check_scheduler(rx._seg.ptr, what) == 0, f"check {what[0]} failed"


def header_u32(ch: shmchan.Channel, name: str) -> int:
    """A 32-bit field of the channel's header, read from the segment as it is now."""
    with open(shmchan._segment.name_file(ch.name, None), "rb") as f:
        f.seek(layout_fact(name))
        return int(struct.unpack("<I", f.read(4))[0])


def header_u64(ch: shmchan.Channel, name: str) -> int:
    """A 64-bit field of the channel's header, read from the segment as it is now."""
    with open(shmchan._segment.name_file(ch.name, None), "rb") as f:
        f.seek(layout_fact(name))
        return int(struct.unpack("<Q", f.read(8))[0])


@contextlib.contextmanager
def tail_claimed_by_us(ch: shmchan.Channel) -> Iterator[tuple[mmap.mmap, int, int]]:
    """This process claims the ring's tail and stops there, as a live producer between
    its claim and its length would (nobody repairs the claim). Yields the segment
    mapped, the claimed owner word's offset and the EMPTY value to give the tail back
    with. Nothing may be in the ring past the tail hint (no send under way)."""
    from shmchan import liveness

    with open(shmchan._segment.name_file(ch.name, None), "r+b") as f:
        seg = mmap.mmap(f.fileno(), 0)
    try:
        (ring_off,) = struct.unpack_from("<Q", seg, layout_fact("header.ring_off"))
        (tail,) = struct.unpack_from("<Q", seg, layout_fact("header.tail_hint"))
        owner_at = ring_off + tail % ch.capacity
        (owner,) = struct.unpack_from("<Q", seg, owner_at)
        assert owner == tail | 1  # EMPTY(tail): the next record goes here
        struct.pack_into("<Q", seg, owner_at, liveness.current_token() << 1)
        yield seg, owner_at, owner
    finally:
        seg.close()


@contextlib.contextmanager
def child_at_pause(
    script: str, chan_name: str, what: str
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Run `script` (it arms a pause point on argv[2], argv[3]) in a child process and
    wait until it stops at the point; yields the child and the fd whose write lets it go
    on. The child is killed on the way out if it still runs."""
    r_notify, w_notify = os.pipe()
    r_wait, w_wait = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), chan_name, str(w_notify), str(r_wait)],
        pass_fds=(w_notify, r_wait),
        env=child_env(),
    )
    try:
        os.close(w_notify)
        os.close(r_wait)
        ready, _, _ = select.select([r_notify], [], [], 60)
        assert ready, f"the child never reached {what}"
        assert os.read(r_notify, 1) == b"\0"
        yield child, w_wait
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        os.close(r_notify)
        os.close(w_wait)


def kill_at_pause(script: str, chan_name: str, what: str) -> None:
    """Run `script` (it arms a pause point on argv[2], argv[3]) in a child process, wait
    until it stops at the point, and SIGKILL it there."""
    with child_at_pause(script, chan_name, what) as (child, _):
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL


def receiver_after_kill(
    ch: shmchan.Channel, script: str, chan_name: str, what: str
) -> shmchan.Receiver:
    """kill_at_pause, then the next receiver of ch, its rebuilt tables cross-checked."""
    kill_at_pause(script, chan_name, what)
    rx = take_receiver_seat(ch)
    check_core(rx)
    return rx


def drain_checked(rx: shmchan.Receiver) -> list[tuple[int, int, bytes]]:
    """(seq, attempt, payload) of every message ready now, each released in turn, the core's
    tables cross-checked after each receive and each release."""
    got = []
    while (h := rx.try_recv()) is not None:
        got.append((h.seq, h.attempt, h.payload))
        check_core(rx)
        h.release()
        check_core(rx)
    return got


def send_to_a_waiting_receiver(
    ch: shmchan.Channel,
    tx: shmchan.Sender,
    rx: shmchan.Receiver,
    payload: bytes,
    *,
    timeout: float,
    keys: Any = (),
    settle: float = 0.0,
) -> None:
    """Send `payload` while another thread waits in `rx.recv`, which must get it: fails
    the test, with the channel's figures, if the send is refused for a full ring. The
    thread starts first (with `settle`, it has had that long to fall asleep), so the
    space the send needs must be made by a receiver that is waiting, not polling."""
    got: list[shmchan.Handle] = []

    def wait() -> None:
        with contextlib.suppress(shmchan.Empty):
            got.append(rx.recv(timeout=timeout + 20))

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        if settle:
            time.sleep(settle)
        try:
            tx.send(payload, keys=keys, timeout=timeout)
        except shmchan.Full:
            st = ch.stats()
            pytest.fail(
                f"a send of {len(payload)} bytes refused after {timeout} s with the receiver "
                f"waiting in recv: {st.queued} queued, {st.inflight} in flight, "
                f"{st.used_bytes} bytes used"
            )
    finally:
        waiter.join(timeout=timeout + 40)
    assert len(got) == 1 and len(got[0].payload) == len(payload)
    got[0].release()
