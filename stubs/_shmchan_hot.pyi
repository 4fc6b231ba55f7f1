# Types of the compiled hot path (csrc/hotpath.c). Private to shmchan.channel.
from collections.abc import Callable, Iterable
from typing import Any

class SegmentBase:
    registered: bool
    pid: int
    def _bind(
        self,
        ptr: int,
        base: int,
        size: int,
        max_keys: int,
        raw_only: bool,
        detached: list[bool],
        mem: memoryview,
        rx_semaphore: str,
        tx_semaphore: str,
    ) -> None: ...
    def post(self, which: int, n: int) -> None: ...
    def wait(self, which: int, seconds: float) -> None: ...

class HandleBase:
    @property
    def seq(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def payload(self) -> Any: ...
    @property
    def data(self) -> memoryview: ...
    @property
    def keys(self) -> tuple[str | bytes | int, ...]: ...
    @property
    def _seg(self) -> Any: ...
    @property
    def _slot(self) -> int: ...
    @property
    def _gen(self) -> int: ...
    _kind: int
    _data_off: int
    _data_len: int
    _keys_off: int
    _keys_len: int
    _nkeys: int
    _pos: int
    _word: int
    _keys: Any
    _done: bool
    _pid: int
    def release(self) -> None: ...
    def ack(self) -> None: ...
    def _finish(self, nack: int) -> bool: ...

class ReceiverBase:
    _next_maintenance: float
    def recv(self, timeout: float | None = None) -> Any: ...
    def recv_many(self, max_items: int = 256, timeout: float | None = None) -> list[Any]: ...
    def release_many(self, handles: Iterable[Any]) -> None: ...

class SenderBase:
    def send(self, obj: object, keys: Any = (), timeout: float | None = None) -> int: ...
    def send_many(
        self, items: Iterable[tuple[object, Any]], timeout: float | None = None
    ) -> list[int]: ...
    def _pack(
        self, items: Iterable[tuple[object, Any]]
    ) -> tuple[int, bytes, bytes, bytes, bytes, bytes, bytes]: ...

def bind(
    addresses: dict[str, int],
    handle_type: type[HandleBase],
    encode_payload: Callable[..., Any],
    encode_keys: Callable[..., Any],
) -> None: ...
def handles_from(seg: SegmentBase, address: int, n: int) -> list[Any]: ...
