"""The Python classes over the C types (csrc/hot/subclass.c): shmchan.Handle,
shmchan.Receiver and shmchan.Sender call their C methods as their own, Handles are plain
objects outside the cyclic collector, and what a subclass defines for itself stays its
own."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import _shmchan_hot as _hot
import pytest

import shmchan
from shmchan import codec
from shmchan._lib import ffi, lib

HAVE_GC = 1 << 14  # Py_TPFLAGS_HAVE_GC

HANDLE_NAMES = ["release", "ack", "payload", "data", "keys", "seq", "attempt", "_finish"]
RECEIVER_NAMES = ["recv", "recv_many", "release_many", "recv_batch"]
SENDER_NAMES = ["send", "send_many", "send_batch"]
BATCH_NAMES = ["payload", "keys", "joined", "release", "seqs"]


def bind_handle_type(handle_type: type) -> None:
    """Re-wire _shmchan_hot as shmchan.handle does, making Handles of handle_type."""
    _hot.bind(
        {
            name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
            for name in dir(lib)
            if name.startswith("shm_")
        },
        handle_type,
        codec.encode_payload,
        codec.encode_keys,
        shmchan.Batch,
    )


@pytest.fixture
def bound() -> Iterator[Any]:
    """bind_handle_type for one test; shmchan.Handle again afterwards."""
    try:
        yield bind_handle_type
    finally:
        bind_handle_type(shmchan.Handle)


# --- shmchan.Handle and shmchan.Receiver -----------------------------------------------


@pytest.mark.parametrize(
    ("cls", "name"),
    [(shmchan.Handle, n) for n in HANDLE_NAMES]
    + [(shmchan.Receiver, n) for n in RECEIVER_NAMES]
    + [(shmchan.Sender, n) for n in SENDER_NAMES]
    + [(shmchan.Batch, n) for n in BATCH_NAMES],
)
def test_the_c_methods_and_attributes_are_the_classs_own(cls, name):
    """CPython calls a C method the quick way only on objects of exactly its class."""
    assert vars(cls)[name].__objclass__ is cls


def test_special_methods_stay_the_bases():
    """__enter__ and __exit__ are found by a special lookup, not the quick call."""
    assert "__enter__" not in vars(shmchan.Handle)
    assert shmchan.Handle.__exit__ is _hot.HandleBase.__exit__


def test_the_copies_keep_their_docstrings():
    assert shmchan.Handle.payload.__doc__ == _hot.HandleBase.payload.__doc__
    assert shmchan.Handle.release.__doc__ == _hot.HandleBase.release.__doc__
    assert shmchan.Receiver.recv.__doc__ == _hot.ReceiverBase.recv.__doc__


def test_a_handle_is_not_tracked_by_the_collector(tx, rx):
    tx.send(b"x", keys="k")
    h = rx.recv(timeout=5)
    assert not shmchan.Handle.__flags__ & HAVE_GC
    assert not gc.is_tracked(h)
    h.release()


def test_dropped_handles_give_back_their_reference_to_the_class(tx, rx):
    """Each Handle holds its class once; made and dropped (some of them into the kept
    memory, some beyond it), they leave its reference count as it was."""

    def round_trip() -> tuple[int, int]:
        tx.send_many([(b"%d" % i, f"k{i}") for i in range(600)])
        before = sys.getrefcount(shmchan.Handle)
        hs: list[shmchan.Handle] = []
        while len(hs) < 600:
            hs += rx.recv_many(600 - len(hs), timeout=5)
        held = sys.getrefcount(shmchan.Handle) - before
        for h in hs[::2]:
            h.release()
        del h, hs
        return held, sys.getrefcount(shmchan.Handle) - before

    round_trip()  # the first receive may leave a cache behind
    assert [round_trip() for _ in range(3)] == [(600, 0)] * 3
    assert rx.try_recv() is None


def test_a_released_handle_kept_alive_stays_released_while_others_reuse_memory(ch, tx, rx):
    """A released Handle that is still referenced is never reused for another message:
    after hundreds of Handles were made and dropped it still raises Closed for its
    payload and data, and releasing it again does not free the key's next holder."""
    tx.send(b"first", keys="k")
    old = rx.recv(timeout=5)
    old.release()
    for i in range(600):  # through the kept memory and beyond, while `old` lives
        tx.send(b"%d" % i, keys="k")
        rx.recv(timeout=5).release()
    tx.send(b"held", keys="k")
    tx.send(b"behind", keys="k")
    holder = rx.recv(timeout=5)
    assert holder.payload == b"held"
    assert (old.seq, old._done) == (1, True)
    with pytest.raises(shmchan.Closed):
        _ = old.payload
    with pytest.raises(shmchan.Closed):
        _ = old.data
    old.release()
    old.ack()
    assert rx.try_recv() is None  # "k" is still held by `holder`
    holder.release()
    assert rx.recv(timeout=5).payload == b"behind"


# --- subclasses of the C types -----------------------------------------------------------


def test_what_a_subclass_defines_stays_its_own():
    class Mine(_hot.HandleBase):
        __slots__ = ()

        def release(self) -> str:
            return "mine"

    class Below(Mine):
        __slots__ = ()

    assert vars(Mine)["release"] is Mine.release  # not replaced by a copy
    assert Below.release is Mine.release  # nor hidden by one below it
    assert vars(Mine)["payload"].__objclass__ is Mine
    assert "payload" not in vars(Below)  # Mine's copy already resolves it


def test_a_receiver_subclass_keeps_what_it_overrides():
    """The same for the bases that only copy descriptors (Receiver, Sender, Batch)."""

    class Mine(_hot.ReceiverBase):
        def recv(self) -> str:
            return "mine"

    class Below(Mine):
        pass

    assert Below.recv is Mine.recv
    assert vars(Mine)["recv_many"].__objclass__ is Mine
    assert "recv_many" not in vars(Below)
    assert Mine.__flags__ & HAVE_GC  # with a __dict__: still collected


def test_only_a_subclass_that_adds_nothing_is_plain():
    class Plain(_hot.HandleBase):
        __slots__ = ()

    class WithDict(_hot.HandleBase):
        pass

    class WithSlot(_hot.HandleBase):
        __slots__ = ("extra",)

    class WithFinalizer(_hot.HandleBase):
        __slots__ = ()

        def __del__(self) -> None:
            pass

    assert not Plain.__flags__ & HAVE_GC
    for cls in (WithDict, WithSlot, WithFinalizer):
        assert cls.__flags__ & HAVE_GC, cls


def test_init_subclass_refuses_arguments():
    with pytest.raises(TypeError, match="takes no arguments"):

        class Flavoured(_hot.HandleBase, flavour="x"):  # type: ignore[call-arg]
            __slots__ = ()


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "with-dict"])
def test_handles_of_a_subclass_of_handle_live_and_die_as_handles(tx, rx, bound, plain):
    """Handles of a subclass of shmchan.Handle (collected, with a __dict__, or plain)
    carry their fields, release their keys when dropped and give back their reference
    to the class."""
    if plain:

        class Tagged(shmchan.Handle):
            __slots__ = ()

    else:

        class Tagged(shmchan.Handle):  # type: ignore[no-redef]
            pass

    bound(Tagged)
    assert bool(Tagged.__flags__ & HAVE_GC) is not plain
    tx.send_many([(b"%d" % i, "k") for i in range(300)])
    before = sys.getrefcount(Tagged)
    for i in range(300):
        h = rx.recv(timeout=5)
        assert type(h) is Tagged
        assert (h.payload, h.keys, gc.is_tracked(h)) == (b"%d" % i, ("k",), not plain)
        if not plain:
            h.note = i  # its own __dict__
        del h  # releases "k" for the next one
    assert sys.getrefcount(Tagged) == before
    assert rx.try_recv() is None
