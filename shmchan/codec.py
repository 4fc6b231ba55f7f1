"""Keys and payloads: how user values become bytes in the segment and back.

Keys are str, bytes or int. Each is encoded canonically as a one-byte type tag and its
content, so "1", b"1" and 1 are three different keys:

    str   b"s" + UTF-8 (surrogates passed through, so every str round-trips)
    bytes b"b" + the bytes
    int   b"i" + minimal two's-complement big-endian bytes

A message's keys travel as one blob: for each key, a little-endian u16 length and its
encoding. The C core hashes each encoding with a stable 64-bit hash (csrc/hash.c); the
original values are decoded from the blob when a handle is asked for its keys.

Payloads: bytes-like objects travel raw (and can be read zero-copy); anything else is
pickled with protocol 5.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from .errors import (
    ChannelCorrupted,
    InvalidArgument,
    PayloadNotContiguous,
    PayloadNotPicklable,
    TooManyKeys,
    UnsupportedType,
)

__all__ = ["Key", "encode_keys", "decode_keys", "encode_payload", "decode_payload", "RAW", "PICKLE"]

Key = str | bytes | int
RAW = 0
PICKLE = 1
_MAX_KEY_BYTES = 0xFFFF - 1


def _encode_one(key: object) -> bytes:
    if isinstance(key, str):
        enc = b"s" + key.encode("utf-8", "surrogatepass")
    elif isinstance(key, (bytes, bytearray, memoryview)):  # bytes-like: a bytes key
        enc = b"b" + bytes(key)
    elif isinstance(key, int) and not isinstance(key, bool):
        n = int(key)
        enc = b"i" + n.to_bytes((n + (n < 0)).bit_length() // 8 + 1, "big", signed=True)
    else:
        raise UnsupportedType(
            f"keys must be str, bytes or int, not {type(key).__name__} ({key!r:.80})"
        )
    if len(enc) > _MAX_KEY_BYTES:
        raise InvalidArgument(
            f"key too long: {len(enc) - 1} bytes encoded (limit {_MAX_KEY_BYTES - 1})"
        )
    return enc


# Framed encodings of recently used keys, by exact type (so 1, True and 1.0 never mix).
_CACHE_LIMIT = 1 << 16
_framed_cache: dict[type, dict[Any, bytes]] = {str: {}, bytes: {}, int: {}}


def _framed(key: object) -> bytes:
    """u16 length + encoding of one key, cached for str, bytes and int keys."""
    cache = _framed_cache.get(type(key))
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    enc = _encode_one(key)
    framed = len(enc).to_bytes(2, "little") + enc
    if cache is not None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = framed
    return framed


def encode_keys(keys: Key | Iterable[Key] | None, max_keys: int) -> tuple[bytes, int]:
    """The key blob and the number of distinct keys. A single str, bytes or int is one key."""
    if keys is None:
        return b"", 0
    if type(keys) is str or type(keys) is int or type(keys) is bytes:
        if max_keys < 1:
            raise TooManyKeys("1 distinct key, but this channel allows at most 0")
        return _framed(keys), 1
    if isinstance(keys, (str, bytes, int, bytearray, memoryview)):
        # one key, also for bytes-like objects (never one int key per byte)
        items: Iterable[Any] = (keys,)
    else:
        try:
            items = iter(keys)
        except TypeError:
            raise UnsupportedType(
                f"keys must be a str, bytes, int or an iterable of them, not {type(keys).__name__}"
            ) from None
    seen = dict.fromkeys(map(_framed, items))
    if len(seen) > max_keys:
        raise TooManyKeys(f"{len(seen)} distinct keys, but this channel allows at most {max_keys}")
    return b"".join(seen), len(seen)


def decode_keys(blob: bytes | memoryview, n: int) -> tuple[Key, ...]:
    """The original key values from a key blob; ChannelCorrupted if it is malformed."""
    out: list[Key] = []
    off = 0
    try:
        for _ in range(n):
            size = blob[off] | (blob[off + 1] << 8)
            enc = bytes(blob[off + 2 : off + 2 + size])
            if len(enc) != size or size == 0:
                raise ValueError("key runs past the blob")
            off += 2 + size
            tag, body = enc[:1], enc[1:]
            if tag == b"s":
                out.append(body.decode("utf-8", "surrogatepass"))
            elif tag == b"b":
                out.append(body)
            elif tag == b"i":
                out.append(int.from_bytes(body, "big", signed=True))
            else:
                raise ValueError(f"unknown key tag {tag!r}")
        if off != len(blob):
            raise ValueError("bytes left over after the last key")
    except (IndexError, ValueError, UnicodeDecodeError) as e:
        raise ChannelCorrupted(f"malformed key blob in the segment: {e}") from None
    return tuple(out)


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
