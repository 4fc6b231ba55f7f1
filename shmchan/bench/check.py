"""The payload check of the batched workloads, the same for every system."""

from __future__ import annotations

from typing import Any

from shmchan.bench.common import FILL, HDR, BenchError, bad_payload


class BatchCheck:
    """The payload check of the batched workloads, the same for every system: every byte
    of every message, each message exactly once, order inversions counted per producer.

    It runs vectorized (numpy) over chunks of a few thousand messages: at millions of
    messages per second a per-message check in Python would cost more than the fastest
    transports themselves. Without numpy it checks message by message instead."""

    CHUNK = 4096

    def __init__(self, system: str, n: int, nprod: int, size: int) -> None:
        self.system, self.n, self.nprod, self.size = system, n, nprod, size
        self.high = [-1] * nprod
        self.late = 0
        self.count = 0
        self.pending: list[bytes] = []
        self.pending_count = 0  # messages in pending (an entry may hold several)
        try:
            import numpy
        except ImportError:
            numpy = None  # type: ignore[assignment]
        if size % 8 or size < 24:
            numpy = None  # type: ignore[assignment]  # the word layout below needs these
        self.np: Any = numpy
        self.seen: list[bytearray] = []
        self.seen_np: Any = None
        if numpy is not None:
            self.seen_np = numpy.zeros(n * nprod, dtype=numpy.bool_)
        else:
            self.seen = [bytearray(n) for _ in range(nprod)]

    def add(self, ds: list[bytes]) -> None:
        self.pending += ds
        self.pending_count += len(ds)
        if self.pending_count >= self.CHUNK:
            self._check()

    def add_joined(self, blob: bytes) -> None:
        """Payloads of `size` bytes each, back to back (Batch.joined())."""
        if self.np is None or len(blob) % self.size:
            self.add([blob[i : i + self.size] for i in range(0, len(blob), self.size)])
            return
        self.pending.append(blob)  # the vectorized check joins its input anyway
        self.pending_count += len(blob) // self.size
        if self.pending_count >= self.CHUNK:
            self._check()

    def finish(self) -> int:
        """Check what is pending, then that every message came; returns the inversions."""
        self._check()
        if self.np is not None:
            self.count = int(self.np.count_nonzero(self.seen_np))
        if self.count != self.n * self.nprod:  # a duplicate within a chunk lands here
            raise BenchError(
                f"{self.system}: {self.n * self.nprod - self.count} messages missing or "
                "delivered twice"
            )
        return self.late

    def _check(self) -> None:
        ds, self.pending = self.pending, []
        count, self.pending_count = self.pending_count, 0
        if not ds:
            return
        if self.np is None:
            self._check_each(ds)
        else:
            self._check_vectorized(ds, count)

    def _check_each(self, ds: list[bytes]) -> None:
        seen, high, size, unpack, mid = self.seen, self.high, self.size, HDR.unpack_from, 24
        for d in ds:
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != FILL or len(d) != size:
                raise bad_payload(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                self.late += 1
            else:
                high[p] = i
        self.count += len(ds)

    def _check_vectorized(self, ds: list[bytes], k: int) -> None:
        """ds: k messages, some entries holding several back to back (add_joined)."""
        np, size = self.np, self.size
        blob = b"".join(ds)
        if len(blob) != k * size:
            raise bad_payload(self.system, next((d for d in ds if len(d) != size), blob), size)

        def message(i: int) -> bytes:
            return blob[i * size : (i + 1) * size]

        # A payload as little-endian words: [index] [producer | 4 fill] [8 fill] ...
        # [7 fill | check byte]; see payload.
        u64 = np.uint64
        fill = u64(int.from_bytes(bytes([FILL]) * 8, "little"))
        w = np.frombuffer(blob, dtype="<u8").reshape(k, size // 8)
        idx, prod = w[:, 0], w[:, 1] & u64(0xFFFFFFFF)
        ok = (prod < self.nprod) & (idx < self.n)
        ok &= (w[:, 1] >> u64(32)) == (fill >> u64(32))
        ok &= (w[:, 2:-1] == fill).all(axis=1)
        ok &= (w[:, -1] & u64(0x00FFFFFFFFFFFFFF)) == (fill >> u64(8))
        ok &= (w[:, -1] >> u64(56)) == (idx & u64(0xFF))
        if not ok.all():
            raise bad_payload(self.system, message(int(np.argmin(ok))), size)
        flat = (prod * u64(self.n) + idx).astype(np.int64)
        if self.seen_np[flat].any():
            raise bad_payload(self.system, message(int(np.argmax(self.seen_np[flat]))), size)
        self.seen_np[flat] = True
        for p in range(self.nprod):
            sub = (idx if self.nprod == 1 else idx[prod == p]).astype(np.int64)
            if sub.size:
                before = np.maximum.accumulate(np.concatenate(([self.high[p]], sub)))[:-1]
                self.late += int((sub < before).sum())
                self.high[p] = max(self.high[p], int(sub.max()))
