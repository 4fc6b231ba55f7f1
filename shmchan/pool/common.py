"""What KeyedExecutor and KeyedPool share: tuning constants and small helpers
(keys, pickling, start methods, exit statuses, cleaning up after dead executors)."""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import pickle
import re
import signal
from collections.abc import Iterable
from typing import Any

from .. import errors, liveness
from ..channel import list_channels, unlink

TICK = 0.05  # the manager's longest sleep: deaths and timeouts are noticed this fast
BATCH = 256  # handles taken from a channel per call
CHUNK_BATCH = 8  # map chunks sent per call
PREFETCH = 32  # handles a worker may have in hand (running and waiting) at once
STOP_GRACE = 5.0  # seconds a stopped worker gets to exit before it is killed
DEFAULT_CAPACITY = 32 << 20  # default bytes of each of an executor's two channels
# An executor's channels: kx-<its creator's liveness token, hex>-<n>-tasks|results
_NAME_RE = re.compile(r"kx-([0-9a-f]+)-(\d+)-(tasks|results)")
_numbers = itertools.count()


class InitializerFailed(errors.Error, concurrent.futures.BrokenExecutor):
    """A KeyedExecutor's worker processes cannot start: the initializer raised (the
    worker logs its traceback), or new workers kept dying before they ran any task.
    Nothing can run, so the executor is broken: every pending future fails with this,
    and submit and map raise it. (A concurrent.futures.BrokenExecutor, as
    ProcessPoolExecutor's BrokenProcessPool is.) A KeyedPool whose initializer raises
    stops, and its join() raises this."""


def as_keys(keys: object) -> tuple[Any, ...]:
    """A task's keys as a tuple: one str / bytes / int is one key, None is none."""
    if keys is None:
        return ()
    if isinstance(keys, (str, bytes, int)):
        return (keys,)
    if isinstance(keys, tuple):
        return keys
    if isinstance(keys, Iterable):
        return tuple(keys)
    raise errors.UnsupportedType(
        f"keys must be a str, bytes or int, or a tuple or list of them, not "
        f"{type(keys).__name__} ({keys!r:.60}): submit(fn, *args, keys=...) takes these, "
        "and so must what map's keys function returns for an item"
    )


def check_submit_keys(keys: object) -> None:
    """UnsupportedType, saying which form submit takes, for a function given as keys."""
    if callable(keys) and not isinstance(keys, (str, bytes, int, tuple, list)):
        raise errors.UnsupportedType(
            "submit(fn, *args, keys=...) takes the task's keys themselves: a str, bytes or "
            f"int, or a tuple or list of them; not a function ({name_of(keys)}). A function "
            "of one item is what map(fn, items, keys=...) takes. (If fn itself has a "
            "parameter named keys, bind it first: submit(functools.partial(fn, keys=...), "
            "*args, keys=task_keys).)"
        )


def check_map_keys(keys: object) -> None:
    """UnsupportedType, saying which form map takes, for keys that are not a function."""
    if keys is not None and not callable(keys):
        raise errors.UnsupportedType(
            "map(fn, items, keys=...) takes a function of one item that returns that item's "
            f"keys, e.g. keys=lambda order: order.account; not a {type(keys).__name__} "
            f"({keys!r:.60}). For the same keys on every item, pass "
            f"keys=lambda item: {keys!r:.60} (those items then run one at a time, in order). "
            "submit(fn, *args, keys=...) is the one that takes the keys themselves."
        )


def name_of(fn: object) -> str:
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return repr(fn)
    return f"{mod}.{name}" if mod else str(name)


def pickle_part(obj: object, what: str, fn: object) -> bytes:
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception as e:
        raise errors.TaskNotPicklable(
            f"{what} of the task {name_of(fn)}(...) cannot be pickled, and tasks travel "
            f"to the worker processes by "
            f"pickling ({type(e).__name__}: {e}); use a function defined at module level "
            "and picklable arguments"
        ) from e


def get_context(mp_context: Any) -> Any:
    if mp_context is None:
        return multiprocessing.get_context()
    if isinstance(mp_context, str):
        return multiprocessing.get_context(mp_context)
    return mp_context


def oom_kills() -> tuple[int, int]:
    """(the cgroup's oom_kill count, the kernel's), -1 where unreadable."""
    cgroup = kernel = -1
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    path = "/sys/fs/cgroup" + line[3:].strip() + "/memory.events"
                    with open(path) as ev:
                        for row in ev:
                            if row.startswith("oom_kill "):
                                cgroup = int(row.split()[1])
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/vmstat") as f:
            for row in f:
                if row.startswith("oom_kill "):
                    kernel = int(row.split()[1])
    except (OSError, ValueError):
        pass
    return cgroup, kernel


def exit_status(exitcode: int | None, oom_before: tuple[int, int]) -> str:
    """How a worker process ended, for an error message."""
    if exitcode is None:
        return "vanished"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = str(-exitcode)
    text = f"was killed by signal {name}"
    if -exitcode == signal.SIGKILL:
        after = oom_kills()
        raised = [
            what
            for what, b, a in zip(("cgroup", "kernel"), oom_before, after, strict=True)
            if b >= 0 and a > b
        ]
        if raised:
            text += f", likely OOM-killed (the {' and '.join(raised)} oom_kill counter rose)"
    return text


def new_channel_stem() -> str:
    """The start of a new executor's channel names (see reap_dead_executors)."""
    return f"kx-{liveness.current_token():x}-{next(_numbers)}"


def reap_dead_executors() -> None:
    """Unlink channels left behind by executors whose process died."""
    for name in list_channels():
        m = _NAME_RE.fullmatch(name)
        if m and not liveness.is_alive(int(m.group(1), 16)):
            try:
                unlink(name)
            except errors.ChannelNotFound:
                pass  # another process cleaned it first
