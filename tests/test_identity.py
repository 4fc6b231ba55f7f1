"""A name means the channel under that name now.

A channel's name can be removed and given to a new channel while processes still hold
the old one. Cached attachments (Sender.open, unpickled senders and handles) follow the
name; sends into a removed channel are refused; unlink() removes only its own channel.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import posix_ipc
import pytest

import shmchan

SHM = "/dev/shm/shmchan."


def _recreate(name: str, **kwargs: object) -> shmchan.Channel:
    shmchan.unlink(name)
    return shmchan.Channel.create(name, capacity=1 << 16, **kwargs)  # type: ignore[arg-type]


def test_sender_open_after_the_name_was_recreated_reaches_the_new_channel(chan_name):
    old = shmchan.Channel.create(chan_name, capacity=1 << 16)
    shmchan.Sender.open(chan_name).send(b"to the old one")  # caches an attachment
    new = _recreate(chan_name)
    try:
        rx = new.receiver()
        seq = shmchan.Sender.open(chan_name).send(b"to the new one")
        h = rx.recv(timeout=5)
        assert (h.seq, h.payload) == (seq, b"to the new one")
        h.release()
        rx.close()
    finally:
        old.close()
        new.close()


def test_unpickled_sender_after_the_name_was_recreated_reaches_the_new_channel(chan_name):
    old = shmchan.Channel.create(chan_name, capacity=1 << 16)
    tx = old.sender()
    pickle.loads(pickle.dumps(tx)).send(b"x")  # the unpickled one caches the attachment
    new = _recreate(chan_name)
    try:
        rx = new.receiver()
        pickle.loads(pickle.dumps(tx)).send(b"y")
        assert rx.recv(timeout=5).payload == b"y"
        rx.close()
    finally:
        old.close()
        new.close()


def test_a_handle_unpickled_after_the_name_was_recreated_stays_with_its_channel(chan_name):
    old = shmchan.Channel.create(chan_name, capacity=1 << 16)
    old.sender().send(b"old message", keys="k")
    rx_old = old.receiver()
    h = rx_old.recv(timeout=5)
    blob = pickle.dumps(h)
    new = _recreate(chan_name)
    try:
        new.sender().send(b"new message", keys="k")
        rx_new = new.receiver()
        h2 = pickle.loads(blob)
        assert h2.payload == b"old message"
        h2.release()
        # the new channel's message and keys were not touched by the old handle
        assert new.stats().inflight == 0
        hn = rx_new.recv(timeout=5)
        assert hn.payload == b"new message"
        hn.release()
        rx_new.close()
        rx_old.close()
    finally:
        old.close()
        new.close()


def test_send_after_unlink_is_refused_and_the_receiver_drains(make_channel):
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    seq = tx.send(b"accepted before")
    ch.unlink()
    with pytest.raises(shmchan.ChannelRemoved, match="removed"):
        tx.send(b"would be lost")
    with pytest.raises(shmchan.ChannelRemoved):
        tx.send_many([(b"a", ()), (b"b", ())])
    with pytest.raises(shmchan.Closed):  # ChannelRemoved is a Closed
        tx.send({"pickled": True})
    h = rx.recv(timeout=5)
    assert (h.seq, h.payload) == (seq, b"accepted before")
    h.release()
    with pytest.raises(shmchan.Closed, match="removed and drained"):
        rx.recv(timeout=5)
    rx.close()


@pytest.mark.parametrize("how", ["function", "cli"])
def test_unlink_by_another_process_refuses_sends(make_channel, chan_name, how):
    ch = make_channel(chan_name)
    tx = ch.sender()
    tx.send(b"fine")
    if how == "function":
        code = f"import shmchan; shmchan.unlink({chan_name!r})"
        cmd = [sys.executable, "-c", code]
    else:
        # --force: this process still uses the channel, which plain `rm` refuses (#13)
        cmd = [sys.executable, "-m", "shmchan", "rm", "--force", chan_name]
    subprocess.run(cmd, check=True, timeout=60)
    assert not os.path.exists(SHM + chan_name)
    with pytest.raises(shmchan.ChannelRemoved):
        tx.send(b"refused")


def test_a_waiting_sender_notices_its_name_removed_behind_its_back(make_channel, chan_name):
    """Removed without shmchan (rm /dev/shm/...): a sender blocked on a full channel is
    refused instead of timing out (or waiting forever)."""
    ch = make_channel(chan_name, capacity=4096)
    tx = ch.sender()
    with pytest.raises(shmchan.Full):
        while True:
            tx.send(b"x" * 512, timeout=0)
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            tx.send(b"x" * 512, timeout=30)
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    time.sleep(0.1)
    posix_ipc.unlink_shared_memory("/shmchan." + chan_name)
    t.join(10)
    assert not t.is_alive(), "the blocked sender never noticed"
    assert len(outcome) == 1 and isinstance(outcome[0], shmchan.ChannelRemoved)


def test_a_receiver_notices_its_name_removed_behind_its_back(make_channel, chan_name):
    ch = make_channel(chan_name)
    tx, rx = ch.sender(), ch.receiver()
    posix_ipc.unlink_shared_memory("/shmchan." + chan_name)
    with pytest.raises(shmchan.Closed, match="removed"):
        rx.recv(timeout=10)  # its periodic check marks the channel removed
    with pytest.raises(shmchan.ChannelRemoved):
        tx.send(b"refused")
    rx.close()


def test_stale_unlink_leaves_the_new_channel_alone(chan_name):
    old = shmchan.Channel.create(chan_name, capacity=1 << 16)
    old.unlink()
    new = shmchan.Channel.create(chan_name, capacity=1 << 16)
    try:
        with pytest.raises(shmchan.ChannelNotFound, match="another channel"):
            old.unlink()
        assert os.path.exists(SHM + chan_name)
        for sem in (f"/shmchan.{chan_name}.rx", f"/shmchan.{chan_name}.tx"):
            posix_ipc.Semaphore(sem).close()  # still there
        rx = new.receiver()
        shmchan.Sender.open(chan_name).send(b"still works")
        assert rx.recv(timeout=5).payload == b"still works"
        rx.close()
    finally:
        old.close()
        new.close()


def test_unlink_twice_raises_channel_not_found(make_channel):
    ch = make_channel()
    ch.unlink()
    with pytest.raises(shmchan.ChannelNotFound, match="already removed"):
        ch.unlink()


def test_a_failed_create_leaves_the_existing_channels_semaphores(make_channel, chan_name):
    make_channel(chan_name)
    with pytest.raises(shmchan.ChannelExists):
        shmchan.Channel.create(chan_name)
    for sem in (f"/shmchan.{chan_name}.rx", f"/shmchan.{chan_name}.tx"):
        posix_ipc.Semaphore(sem).close()


def test_file_backed_channel_recreated_at_the_same_path(tmp_path, chan_name):
    path = tmp_path / "chan"
    old = shmchan.Channel.create(chan_name, capacity=1 << 16, path=path)
    shmchan.Sender.open(chan_name, path=path).send(b"old")
    shmchan.unlink(chan_name, path=path)
    new = shmchan.Channel.create(chan_name, capacity=1 << 16, path=path)
    try:
        rx = new.receiver()
        shmchan.Sender.open(chan_name, path=path).send(b"new")
        assert rx.recv(timeout=5).payload == b"new"
        rx.close()
        with pytest.raises(shmchan.ChannelRemoved):
            old.sender().send(b"lost")
    finally:
        old.close()
        new.close()
        shmchan.unlink(chan_name, path=path)
