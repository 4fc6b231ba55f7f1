"""Keys and payloads: how user values become bytes in the segment and back.

Keys are str, bytes or int; this module decides which values are keys (a bytes-like
object is one bytes key, a str or int subclass counts as its value, a bool is not a
key), how many a message may carry, and the errors callers get. The bytes themselves
are made and read by the key codec of the compiled hot path (csrc/hot/keys.c, which
documents the encoding), the same code the send fast path and Handle.keys use:

    str   b"s" + UTF-8 (surrogates passed through, so every str round-trips)
    bytes b"b" + the bytes
    int   b"i" + minimal two's-complement big-endian bytes

A message's keys travel as one blob: for each distinct key, a little-endian u16 length
and its encoding. The C core hashes each encoding with a stable 64-bit hash
(csrc/hash.c); the original values are decoded from the blob when a handle is asked for
its keys.

Payloads: bytes-like objects travel raw (and can be read zero-copy); anything else is
pickled with protocol 5.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import _shmchan_hot as _hot  # the key codec (csrc/hot/keys.c)

from .errors import (
    ChannelCorrupted,
    PayloadNotContiguous,
    PayloadNotPicklable,
    TooManyKeys,
    UnsupportedType,
)

__all__ = ["Key", "encode_keys", "decode_keys", "encode_payload", "decode_payload", "RAW", "PICKLE"]

Key = str | bytes | int
RAW = 0
PICKLE = 1


def _key(key: object) -> Key:
    """The key value `key` stands for, as an exact str, bytes or int."""
    cls = type(key)
    if cls is str or cls is bytes or cls is int:
        return key  # type: ignore[return-value]  # checked just above
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, (bytes, bytearray, memoryview)):  # bytes-like: a bytes key
        return bytes(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return int(key)
    raise UnsupportedType(f"keys must be str, bytes or int, not {type(key).__name__} ({key!r:.80})")


def encode_keys(keys: Key | Iterable[Key] | None, max_keys: int) -> tuple[bytes, int]:
    """The key blob and the number of distinct keys. A single str, bytes or int is one key."""
    if keys is None:
        return b"", 0
    if isinstance(keys, (str, bytes, int, bytearray, memoryview)):
        # one key, also for bytes-like objects (never one int key per byte)
        items: list[Key] = [_key(keys)]
    else:
        try:
            it = iter(keys)
        except TypeError:
            raise UnsupportedType(
                f"keys must be a str, bytes, int or an iterable of them, not {type(keys).__name__}"
            ) from None
        items = [_key(k) for k in it]
    n = len(set(items))  # exact types: equal values are equal encodings
    if n > max_keys:
        what = "1 distinct key" if n == 1 else f"{n} distinct keys"
        raise TooManyKeys(f"{what}, but this channel allows at most {max_keys}")
    blob: bytes = _hot.frame_keys(items)
    return blob, n


def decode_keys(blob: bytes | memoryview, n: int) -> tuple[Key, ...]:
    """The original key values from a key blob; ChannelCorrupted if it is malformed."""
    keys: tuple[Key, ...] | None = _hot.decode_keys(blob, n)
    if keys is None:
        raise ChannelCorrupted(
            f"malformed key blob in the segment ({len(blob)} bytes, {n} keys expected)"
        )
    return keys


def encode_payload(obj: object, raw_only: bool) -> tuple[int, Any]:
    """(kind, buffer) for a payload: bytes-like objects as they are, others pickled."""
    if isinstance(obj, memoryview) and not obj.c_contiguous:
        raise PayloadNotContiguous(
            f"payload is a non-contiguous memoryview (shape {obj.shape}, strides "
            f"{obj.strides}): pass view.tobytes() or a contiguous copy"
        )
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return RAW, obj
    if raw_only:
        raise UnsupportedType(
            f'this channel has serializer="raw" and accepts only bytes-like payloads, '
            f"not {type(obj).__name__}"
        )
    try:
        return PICKLE, pickle.dumps(obj, protocol=5)
    except Exception as e:
        raise PayloadNotPicklable(
            f"the payload, a {_type_name(obj)}, cannot be pickled ({type(e).__name__}: {e}); "
            "payloads that are not bytes-like travel pickled: send a picklable object "
            "(no locks, sockets, open files or locally defined functions or classes), "
            "or bytes you encode yourself"
        ) from e


def _type_name(obj: object) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def decode_payload(kind: int, view: memoryview) -> Any:
    if kind == RAW:
        return bytes(view)
    return pickle.loads(view)
