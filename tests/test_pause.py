"""Pause and resume (shmchan/hold.py, csrc/hold.c): a channel, or single keys of it,
held back by any process, through processes and restarts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any

import pytest
from procs import CTX, WAIT, check_core, run_shmchan, running, take_receiver_seat

import shmchan
from shmchan import hold


def _drain(rx: shmchan.Receiver, wait: float = 0.3) -> list[Any]:
    """Payloads handed out until `wait` seconds pass with none, each released at once."""
    out = []
    while True:
        try:
            h = rx.recv(timeout=wait)
        except shmchan.Empty:
            return out
        out.append(h.payload)
        h.release()


def _receive_one(name: str, q: Any) -> None:
    """Child: take the receiver, report ready, block in one recv, report what and when."""
    ch = shmchan.Channel.open(name)
    rx = take_receiver_seat(ch)
    q.put(("ready", time.monotonic()))
    try:
        h = rx.recv(timeout=WAIT)
    except shmchan.Empty:
        q.put(("empty", time.monotonic()))
        return
    q.put((h.payload, time.monotonic()))
    h.release()


def test_cli_pause_holds_a_receiver_in_another_process_and_resume_wakes_it(
    make_channel: Any,
) -> None:
    ch = make_channel()
    q = CTX.Queue()
    p = CTX.Process(target=_receive_one, args=(ch.name, q))
    with running(p):
        assert q.get(timeout=WAIT)[0] == "ready"
        assert run_shmchan("pause", ch.name, timeout=WAIT).returncode == 0
        assert ch.pause_state().paused
        ch.sender().send("held", keys="k")  # producers still send while paused
        time.sleep(0.5)
        assert q.empty(), "a paused channel handed a message out"
        assert ch.why_waiting(1).paused == "channel paused"
        assert ch.stats().queued == 1
        result = run_shmchan("resume", ch.name, timeout=WAIT)
        assert result.returncode == 0, result.stderr
        resumed = time.monotonic()
        payload, when = q.get(timeout=WAIT)
        assert payload == "held"
        # woken by the resume, not by its recv's timeout (WAIT seconds)
        assert when - resumed < WAIT / 2
        p.join(WAIT)
    assert p.exitcode == 0


def test_recv_times_out_while_paused_and_handles_out_stay_valid(
    ch: shmchan.Channel, tx: shmchan.Sender, rx: shmchan.Receiver
) -> None:
    tx.send("out", keys="a")
    h = rx.recv(timeout=WAIT)
    ch.pause()
    tx.send("next", keys="b")
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.2)
    assert rx.try_recv() is None
    assert h.payload == "out"
    h.release()  # a handle handed out before the pause is released as usual
    assert ch.stats().released == 1
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.1)
    ch.resume()
    assert rx.recv(timeout=WAIT).payload == "next"


def test_a_paused_key_holds_its_messages_and_those_behind_them_on_any_of_their_keys(
    ch: shmchan.Channel, tx: shmchan.Sender, rx: shmchan.Receiver
) -> None:
    ch.pause_key("acct:1")
    tx.send("a1", keys="acct:1")
    tx.send("b1", keys="acct:2")
    tx.send("a+c", keys=("acct:1", "acct:3"))
    tx.send("c1", keys="acct:3")  # behind a+c on acct:3: waits too
    tx.send("d1", keys="acct:4")
    tx.send("b2", keys="acct:2")
    assert _drain(rx) == ["b1", "d1", "b2"]
    chain = ch.why_waiting(4)
    assert chain.paused == "key 'acct:1' paused", chain
    assert ch.why_waiting(1).paused == "key 'acct:1' paused"
    assert ch.why_waiting(2).paused is None  # delivered
    assert ch.resume_key("acct:1") is True
    assert ch.resume_key("acct:1") is False  # not paused any more
    assert _drain(rx) == ["a1", "a+c", "c1"]  # per-key order kept


@pytest.mark.parametrize("key", ["s", b"\x00b", 12, -(2**70)])
def test_keys_of_every_type_pause_and_show_their_value(
    ch: shmchan.Channel, tx: shmchan.Sender, rx: shmchan.Receiver, key: Any
) -> None:
    ch.pause_key(key)
    assert ch.pause_state().keys == (key,)
    tx.send("x", keys=key)
    assert rx.try_recv() is None
    ch.resume_key(key)
    assert rx.recv(timeout=WAIT).payload == "x"


def test_the_paused_key_table_is_bounded_with_a_clear_error(ch: shmchan.Channel) -> None:
    for i in range(hold.MAX_PAUSED_KEYS):
        ch.pause_key(f"k{i}")
    ch.pause_key("k0")  # pausing a paused key again takes no entry
    with pytest.raises(shmchan.TooManyPausedKeys, match="resume one"):
        ch.pause_key("one too many")
    assert len(ch.pause_state().keys) == hold.MAX_PAUSED_KEYS
    assert ch.resume_key("k5")
    ch.pause_key("one too many")  # the freed entry is reused
    assert "one too many" in ch.pause_state().keys


def test_pausing_a_non_key_is_refused(ch: shmchan.Channel) -> None:
    with pytest.raises(shmchan.UnsupportedType):
        ch.pause_key(1.5)  # type: ignore[arg-type]  # the error under test


def _pause_keys_in_a_loop(name: str, base: int, n: int) -> None:
    ch = shmchan.Channel.open(name)
    for _ in range(20):
        for i in range(n):
            ch.pause_key(f"k{base + i}")
        for i in range(n):
            ch.resume_key(f"k{base + i}")
    for i in range(n):
        ch.pause_key(f"k{base + i}")


def test_processes_pausing_and_resuming_keys_at_once_leave_a_consistent_table(
    ch: shmchan.Channel,
) -> None:
    procs = [
        CTX.Process(target=_pause_keys_in_a_loop, args=(ch.name, 100 * j, 10)) for j in range(3)
    ]
    with running(*procs):
        for p in procs:
            p.join(WAIT)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    keys = ch.pause_state().keys
    assert sorted(keys, key=str) == sorted(
        (f"k{100 * j + i}" for j in range(3) for i in range(10)), key=str
    )
    for k in keys:
        assert ch.resume_key(k)  # type: ignore[arg-type]  # str keys here
    assert ch.pause_state() == hold.PauseState(paused=False, keys=(), hashes=())


def _receive_forever(name: str, q: Any) -> None:
    ch = shmchan.Channel.open(name)
    rx = take_receiver_seat(ch)
    q.put("ready")
    for h in rx:
        q.put(h.payload)
        h.release()


def test_a_pause_survives_the_receivers_death(make_channel: Any) -> None:
    ch = make_channel()
    tx = ch.sender()
    ch.pause()
    ch.pause_key("k")
    q = CTX.Queue()
    p = CTX.Process(target=_receive_forever, args=(ch.name, q))
    with running(p):
        assert q.get(timeout=WAIT) == "ready"
        tx.send(1, keys="j")
        time.sleep(0.3)
        assert q.empty()
        os.kill(p.pid, signal.SIGKILL)
        p.join(WAIT)
    rx = take_receiver_seat(ch)
    assert ch.pause_state().paused
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.2)
    ch.resume()
    tx.send(2, keys="k")
    assert _drain(rx) == [1]
    ch.resume_key("k")
    assert _drain(rx) == [2]
    rx.close()


def _reopen_and_report(path: str, name: str, q: Any) -> None:
    ch = shmchan.Channel.open(name, path=path)
    st = ch.pause_state()
    rx = ch.receiver()
    got = rx.try_recv()
    q.put((st.paused, st.keys, got is None))


def test_a_durable_channel_keeps_its_pause_across_processes(tmp_path: Any, chan_name: str) -> None:
    path = str(tmp_path / "chan")
    ch = shmchan.Channel.create(chan_name, 1 << 20, path=path)
    ch.pause()
    ch.pause_key("k")
    ch.sender().send("x", keys="k")
    ch.flush()
    ch.close()
    q = CTX.Queue()
    p = CTX.Process(target=_reopen_and_report, args=(path, chan_name, q))
    with running(p):
        assert q.get(timeout=WAIT) == (True, ("k",), True)
        p.join(WAIT)
    shmchan.unlink(chan_name, path=path)


def test_resume_wakes_an_asyncio_receiver(
    ch: shmchan.Channel, tx: shmchan.Sender, rx: shmchan.Receiver
) -> None:
    ch.pause()
    tx.send("x")
    timer = threading.Timer(0.3, ch.resume)

    async def main() -> tuple[Any, float]:
        timer.start()
        h = await rx.recv_async(timeout=WAIT)
        with h:
            return h.payload, time.monotonic()

    start = time.monotonic()
    payload, when = asyncio.run(main())
    timer.join()
    assert payload == "x"
    assert when - start < WAIT / 2


def test_under_eager_order_a_held_back_message_keeps_its_keys_too(make_channel: Any) -> None:
    ch = make_channel(order="eager")
    tx, rx = ch.sender(), ch.receiver()
    ch.pause_key("p")
    tx.send("both", keys=("p", "q"))
    tx.send("q only", keys="q")
    tx.send("r only", keys="r")
    assert _drain(rx) == ["r only"]  # "both" holds q as a message in flight would
    ch.resume_key("p")
    assert _drain(rx) == ["both", "q only"]
    rx.close()


def test_cli_pause_key_forms_and_stat_show_them(ch: shmchan.Channel) -> None:
    r = run_shmchan(
        "pause", ch.name, "--key", "acct:1", "--int-key", "7", "--bytes-key", "00ff", timeout=WAIT
    )
    assert r.returncode == 0, r.stderr
    assert set(ch.pause_state().keys) == {"acct:1", 7, b"\x00\xff"}
    stat = run_shmchan("stat", ch.name, "--json", timeout=WAIT)

    paused = json.loads(stat.stdout)["paused"]
    assert paused["channel"] is False
    assert sorted(map(str, paused["keys"])) == sorted(["acct:1", "7", "{'bytes': '00ff'}"])
    text = run_shmchan("stat", ch.name, timeout=WAIT).stdout
    assert "paused keys: 3" in text
    bad = run_shmchan("pause", ch.name, "--bytes-key", "xyz", timeout=WAIT)
    assert bad.returncode == 2 and "hex" in bad.stderr
    r = run_shmchan(
        "resume", ch.name, "--key", "acct:1", "--int-key", "7", "--bytes-key", "00ff", timeout=WAIT
    )
    assert r.returncode == 0
    assert ch.pause_state().keys == ()


def test_a_receiver_waiting_on_a_paused_channel_sleeps_instead_of_spinning(
    ch: shmchan.Channel, tx: shmchan.Sender, rx: shmchan.Receiver
) -> None:
    for key in ("a", "b", "c"):
        tx.send(key, keys=key)
    ch.pause_key("a")
    assert rx.recv(timeout=WAIT).payload == "b"  # ready messages that may go, go
    ch.pause()
    cpu = time.process_time()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=1.0)  # ready messages are there, all held back
    # A receiver that took held-back ready messages for work would poll for the whole
    # second (about 1 s of CPU); asleep, it wakes for upkeep only.
    assert time.process_time() - cpu < 0.3


def test_a_long_key_pauses_and_shows_as_its_hash(ch: shmchan.Channel, tx: shmchan.Sender) -> None:
    long_key = "x" * (hold.MAX_PAUSED_KEYS * 4)
    ch.pause_key(long_key)
    st = ch.pause_state()
    assert st.keys == (None,) and st.hashes == (hold.key_hash(long_key),)
    tx.send("held", keys=long_key)
    text = run_shmchan("stat", ch.name, timeout=WAIT).stdout
    assert f"hash {hold.key_hash(long_key):#x}" in text
    assert ch.why_waiting(1).paused == f"key {long_key!r} paused"
    assert ch.resume_key(long_key)


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_many_held_back_messages_leave_the_rest_in_seq_order(make_channel: Any, order: str) -> None:
    """Held-back messages are skipped in the middle of the ready heap: what may go still
    goes lowest seq first, the heap stays whole, and a resume releases the rest in order."""
    ch = make_channel(order=order)
    tx, rx = ch.sender(), ch.receiver()
    paused = [f"p{i}" for i in range(hold.MAX_PAUSED_KEYS)]
    for key in paused:
        ch.pause_key(key)
    free, held = [], []
    for i in range(300):
        if i % 3 == 0 and len(held) < len(paused):
            key = paused[len(held)]
            held.append(tx.send(("held", key), keys=key))
        else:
            free.append(tx.send(("free", i), keys=f"f{i}"))
    batch = [rx.recv(timeout=WAIT) for _ in free]  # all out at once: seq order
    assert [h.seq for h in batch] == free
    check_core(rx)
    assert rx.try_recv() is None
    for h in batch:
        h.release()
    for key in reversed(paused):  # resumed in another order than sent
        ch.resume_key(key)
    rest = [rx.recv(timeout=WAIT) for _ in held]
    assert [h.seq for h in rest] == held
    for h in rest:
        h.release()
    check_core(rx)
    rx.close()


@pytest.mark.parametrize("seed", range(8))
def test_random_pauses_keep_the_scheduler_whole_and_per_key_order(
    make_channel: Any, seed: int
) -> None:
    """Pauses and resumes at random among sends, receives and releases in random order:
    the core's own check of its tables passes at every step, every message is handed
    out once, and each key's messages in seq order."""
    import random

    rnd = random.Random(seed)
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    keys = [f"k{i}" for i in range(48)]
    sent: dict[int, tuple[str, ...]] = {}
    out: list[shmchan.Handle] = []
    order: dict[str, list[int]] = {k: [] for k in keys}
    for step in range(1500):
        r = rnd.random()
        if r < 0.35 and len(sent) < 800:
            ks = tuple(rnd.sample(keys, rnd.choice((1, 1, 2, 3))))
            sent[tx.send(step, keys=ks)] = ks
        elif r < 0.5:
            ch.pause_key(rnd.choice(keys))
        elif r < 0.55:
            ch.resume_key(rnd.choice(keys))
        elif r < 0.8:
            h = rx.try_recv()
            if h is not None:
                for k in h.keys:
                    order[k].append(h.seq)  # type: ignore[index]  # str keys here
                out.append(h)
        elif out:
            out.pop(rnd.randrange(len(out))).release()
        check_core(rx)
    for k in keys:
        ch.resume_key(k)
    for h in out:
        h.release()
    while True:
        try:
            h = rx.recv(timeout=0.3)
        except shmchan.Empty:
            break
        for k in h.keys:
            order[k].append(h.seq)  # type: ignore[index]  # as above
        h.release()
    check_core(rx)
    delivered = sorted(s for seqs in order.values() for s in seqs)
    assert sorted(set(delivered)) == sorted(sent)  # each once (per key), none lost
    for k, seqs in order.items():
        assert seqs == sorted(seqs), f"key {k}: out of order"
        assert seqs == sorted(s for s, ks in sent.items() if k in ks)
    rx.close()


def test_ls_and_prometheus_show_what_is_paused(ch: shmchan.Channel) -> None:
    ch.pause()
    ch.pause_key("k1")
    ch.pause_key("k2")
    listed = run_shmchan("ls", timeout=WAIT).stdout.splitlines()
    at = listed[0].index("PAUSED")
    row = next(line for line in listed if line.startswith(ch.name + " "))
    assert row[at:].startswith("channel, 2 keys")
    metrics = run_shmchan("stat", ch.name, "--prometheus", timeout=WAIT).stdout
    assert f'shmchan_paused{{channel="{ch.name}"}} 1.0' in metrics
    assert f'shmchan_paused_keys{{channel="{ch.name}"}} 2.0' in metrics


def _recv_on_a_paused_backlog(name: str, q: Any) -> None:
    """Child: with the channel paused and more messages ready than the receiver takes in
    ahead, a recv with a timeout returns Empty in time (reported with its duration)."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    t0 = time.monotonic()
    try:
        rx.recv(timeout=0.3)
    except shmchan.Empty:
        pass
    ch.sender().send(b"late", keys=("late",))  # a new record while the backlog is held
    try:
        rx.recv(timeout=0.3)
        q.put("got one while paused")
    except shmchan.Empty:
        q.put(time.monotonic() - t0)
    rx.close()


def test_recv_on_a_paused_channel_with_a_large_backlog_keeps_its_timeout(
    make_channel: Any,
) -> None:
    # More ready messages than the receiver scans ahead for, all held back: the poll must
    # not keep finding "work" in the ring it will not take in (that spun, ignoring the
    # timeout). In a child process, so a spin fails the test instead of hanging it.
    ch = make_channel(capacity=4 << 20)
    tx = ch.sender()
    ch.pause()
    for i in range(300):
        tx.send(i, keys=(f"k{i}",))
    q = CTX.Queue()
    p = CTX.Process(target=_recv_on_a_paused_backlog, args=(ch.name, q))
    with running(p):
        p.join(WAIT)
        assert not p.is_alive(), "a recv on a paused channel did not return"
        took = q.get(timeout=1)
    assert isinstance(took, float) and took < WAIT, took


def test_a_paused_key_does_not_stop_free_messages_under_the_tables_budget(
    make_channel: Any,
) -> None:
    # A message on a paused key is ready but held back; it must not count as "the next to
    # hand out" for the tables' budget (csrc/budget.c), or messages on free keys behind
    # the budget were never taken in while handles are held.
    ch = make_channel(capacity=1 << 16, max_messages=4096)
    tx, rx = ch.sender(), ch.receiver()
    ch.pause_key("P")
    tx.send("p", keys=("P",))
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.05)
    held = []
    for i in range(300):
        tx.send(i, keys=(f"k{i}",))
        held.append(rx.recv(timeout=WAIT))
    assert [h.payload for h in held] == list(range(300))
    rx.release_many(held)
    ch.resume_key("P")
    with rx.recv(timeout=WAIT) as h:
        assert h.payload == "p"
    check_core(rx)
    rx.close()
