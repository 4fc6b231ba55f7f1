"""Pause and resume: an operator's hold on a channel, or on single keys of it.

The state lives in the channel's segment (csrc/hold.c has the protocol), so any process
that can open the channel may pause or resume it -- an operator's `shmchan pause NAME`
holds a channel another process receives from -- and it outlives the receiver (a new
one starts paused) and, for a channel created with path=, a restart of everything.

* `pause(seg)`: the receiver hands out nothing from its next poll on. Producers still
  send (until the channel is full); handles already handed out stay valid and may be
  released, nacked or extended; a `recv(timeout=)` waits and times out as usual.
* `pause_key(seg, key)`: messages carrying `key` are not handed out. A message taken
  in holds its keys (under both orders), so nothing behind a held-back message on *any*
  of its keys passes it either; messages on other keys flow. Up to `MAX_PAUSED_KEYS`
  keys per channel are paused at once (`TooManyPausedKeys` beyond).
* `resume(seg)` / `resume_key(seg, key)`: clear the hold and wake the receiver.

A key is paused by its 64-bit hash, as the scheduler knows keys: a key that shares its
hash with a paused one is held back too (the same rule as for locking: a collision can
only add waiting).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import codec, errors
from ._lib import ffi, lib, raise_for
from ._segment import RX, Segment

__all__ = [
    "MAX_PAUSED_KEYS",
    "PauseState",
    "key_hash",
    "pause",
    "resume",
    "pause_key",
    "resume_key",
    "state",
]

MAX_PAUSED_KEYS: int = lib.SHM_HOLD_KEYS
_BLOB_BYTES: int = lib.SHM_HOLD_KEY_BYTES


@dataclass(frozen=True)
class PauseState:
    """What is paused on a channel."""

    paused: bool
    """The whole channel: its receiver hands out nothing."""
    keys: tuple[codec.Key | None, ...]
    """The paused keys (None for one whose value is too long to be kept for display)."""
    hashes: tuple[int, ...]
    """Their hashes, in the same order (what the scheduler compares)."""


def _one_key(key: object) -> tuple[int, bytes]:
    """(hash, framed encoding) of one key, as a send would hash it."""
    if not isinstance(key, (str, bytes, int, bytearray, memoryview)) or isinstance(key, bool):
        raise errors.UnsupportedType(
            f"a key to pause must be a str, bytes or int, not {type(key).__name__}"
        )
    blob, _ = codec.encode_keys(key, 1)
    enc = blob[2:]  # a u16 length, then the encoding (codec.py)
    return int(lib.shm_hash_key(enc, len(enc))), blob


def key_hash(key: object) -> int:
    """The 64-bit hash the channel's scheduler uses for `key`."""
    return _one_key(key)[0]


def pause(seg: Segment) -> None:
    lib.shm_pause(seg.ptr, 1)


def resume(seg: Segment) -> None:
    lib.shm_pause(seg.ptr, 0)
    seg.post(RX, 1)  # a receiver asleep with paused messages ready looks again


def pause_key(seg: Segment, key: object) -> None:
    h, blob = _one_key(key)
    rc = lib.shm_pause_key(seg.ptr, h, blob, len(blob))
    if rc == lib.SHM_FULL:
        raise errors.TooManyPausedKeys(
            f"channel {seg.name!r} already has {MAX_PAUSED_KEYS} paused keys, the most it "
            "holds: resume one (resume_key), or pause the whole channel (pause)"
        )
    if rc:
        raise_for(rc, "pause_key")


def resume_key(seg: Segment, key: object) -> bool:
    """Resume `key`; False if it was not paused."""
    h, _ = _one_key(key)
    cleared = ffi.new("uint32_t *")
    lib.shm_resume_key(seg.ptr, h, cleared)
    if cleared[0]:
        seg.post(RX, 1)
    return bool(cleared[0])


def state(seg: Segment) -> PauseState:
    paused = ffi.new("uint32_t *")
    hashes = ffi.new("uint64_t[]", MAX_PAUSED_KEYS)
    blobs = ffi.new("uint8_t[]", MAX_PAUSED_KEYS * _BLOB_BYTES)
    lens = ffi.new("uint32_t[]", MAX_PAUSED_KEYS)
    n = ffi.new("uint32_t *")
    lib.shm_hold_read(seg.ptr, paused, hashes, blobs, lens, n)
    keys: list[codec.Key | None] = []
    for i in range(int(n[0])):
        length = int(lens[i])
        key: codec.Key | None = None
        if length:
            raw = bytes(ffi.buffer(blobs + i * _BLOB_BYTES, length))
            try:
                key = codec.decode_keys(raw, 1)[0]
            except errors.ChannelCorrupted:
                key = None  # display only: an unreadable copy shows as unknown
        keys.append(key)
    return PauseState(
        paused=bool(paused[0]),
        keys=tuple(keys),
        hashes=tuple(int(hashes[i]) for i in range(int(n[0]))),
    )
