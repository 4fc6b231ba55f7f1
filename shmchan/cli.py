"""The command line: `python -m shmchan {ls,stat,rm,dead,demo,bench}` (also installed as
`shmchan`).

Exit codes: 0 success, 1 the command failed (missing channel, failed demo, ...),
2 bad usage, 130 interrupted. User errors print one line
on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import shmchan
from shmchan import demo, exchange, hold, inspect, temporary
from shmchan.codec import Key

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Stats fields that count bytes; shown human-readable as well.
_BYTE_FIELDS = frozenset(
    {
        "capacity",
        "used_bytes",
        "committed_bytes",
        "table_bytes",
        "ring_committed_bytes",
        "overflow_bytes",
    }
)


class _UserError(Exception):
    """A failure to report as one line on stderr (exit code 1)."""


class _UsageError(Exception):
    """A bad combination of arguments (exit code 2)."""


# --------------------------------------------------------------------------- formatting


def _human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _open(name: str, path: str | None = None) -> shmchan.Channel:
    """Attach to an existing channel, turning every shmchan error into a user error."""
    try:
        return shmchan.Channel.open(name, path=path)
    except shmchan.ChannelNotFound:
        hint = " (for a channel created with path=, give --path FILE)" if path is None else ""
        raise _UserError(f"no channel named {name!r}{hint}") from None
    except shmchan.LayoutMismatch as e:
        raise _UserError(f"{name!r} is not a channel this shmchan version can read: {e}") from None
    except shmchan.ChannelCorrupted as e:
        raise _UserError(f"channel {name!r} is corrupted: {e}") from None


# --------------------------------------------------------------------------- commands


def _age_text(seconds: float) -> str:
    """3.2 -> '3.2 s', 250 -> '4 min 10 s', 7300 -> '2 h 1 min', 200000 -> '2 d 7 h'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(seconds)
    for size, unit, sub, subunit in ((86400, "d", 3600, "h"), (3600, "h", 60, "min")):
        if s >= size:
            return f"{s // size} {unit} {s % size // sub} {subunit}"
    return f"{s // 60} min {s % 60} s"


def _key_text(key: object) -> str:
    """A key as an operator reads it: plain words bare, anything else as Python repr."""
    if isinstance(key, str) and key and key.isprintable() and not any(c.isspace() for c in key):
        return key
    return repr(key)


def _key_json(key: object) -> object:
    """str and int keys as they are; bytes keys as {"bytes": hex} (JSON has no bytes)."""
    if isinstance(key, bytes):
        return {"bytes": key.hex()}
    return key


def _payload_size(payload: object) -> int:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return len(payload)
    return len(pickle.dumps(payload, protocol=5))  # as it is stored


def _preview(payload: object, width: int = 40) -> str:
    text = repr(bytes(payload) if isinstance(payload, (bytearray, memoryview)) else payload)
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    width = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        indent + "  ".join(f"{c:<{width[i]}}" for i, c in enumerate(r)).rstrip()
        for r in [header, *rows]
    ]


def _in_use(pids: int) -> str:
    if not pids:
        return "no: leftover"
    return f"yes: {pids} pid" + ("s" if pids > 1 else "")


def _committed_bytes(path: str) -> int:
    """Memory a segment file really takes: its allocated blocks, not its size."""
    return os.stat(path).st_blocks * 512


def _cmd_ls(args: argparse.Namespace) -> int:
    for name in temporary.sweep():  # temporary channels whose users are all gone
        print(f"shmchan ls: removed temporary channel {name} (no live process used it)",
              file=sys.stderr)  # fmt: skip
    names = sorted(shmchan.list_channels())
    paths = {n: inspect.segment_path(n) for n in names}
    maps = inspect.mapping_pids(list(paths.values()))
    me = os.getpid()
    rows: list[tuple[str, ...]] = []
    failed = False
    now = time.time()
    for name in names:
        try:
            committed = _human_bytes(_committed_bytes(paths[name]))
        except FileNotFoundError:
            continue  # removed since we listed it
        mappers = maps.get(paths[name], set()) - {me}
        try:
            ch = shmchan.Channel.open(name)
        except shmchan.ChannelNotFound:
            continue
        except (shmchan.Error, OSError) as e:
            # Still list it (it exists), but say why there are no numbers.
            print(f"shmchan ls: {name}: {e}", file=sys.stderr)
            used = _in_use(len(mappers))
            rows.append((name, "?", committed, "?", "?", "?", "?", "?", "?", "?", used))
            failed = True
            continue
        try:
            s = ch.stats()
            age = _age_text(max(now - ch.created, 0.0))
            users = inspect.users(ch, paths[name])
            paused = _paused_text(ch.pause_state())
            receiver = (
                str(s.receiver_pid) if s.receiver_pid and inspect.receiver_alive(ch) else "none"
            )
        finally:
            ch.close()
        users_text = _in_use(len(users))
        rows.append(
            (
                name,
                _human_bytes(s.capacity),
                committed,
                _human_bytes(s.used_bytes),
                str(s.queued),
                str(s.inflight),
                str(s.producers),
                receiver,
                paused,
                age,
                users_text,
            )
        )
    if rows:
        header: tuple[str, ...] = ("NAME", "CAPACITY", "COMMITTED", "USED", "QUEUED")
        header = (*header, "INFLIGHT", "PRODUCERS", "RECEIVER")
        for line in _table((*header, "PAUSED", "AGE", "IN USE"), rows):
            print(line)
    for line in exchange.ls_lines():  # then the exchanges, with their bindings
        print(line)
    return EXIT_FAILED if failed else EXIT_OK


def _paused_text(st: hold.PauseState) -> str:
    """ls's PAUSED column: "no", "channel", "2 keys", "channel, 1 key"."""
    parts = ["channel"] if st.paused else []
    if st.keys:
        parts.append(f"{len(st.keys)} key" + ("s" if len(st.keys) > 1 else ""))
    return ", ".join(parts) or "no"


def _paused_key_json(st: hold.PauseState, i: int) -> object:
    """A paused key for JSON: its value, or {"hash": N} if only its hash is kept."""
    key = st.keys[i]
    return {"hash": st.hashes[i]} if key is None else _key_json(key)


# Counters whose per-second rate stat shows.
_COUNTERS = ("sent", "delivered", "released", "redelivered", "discarded")


def _sample(ch: shmchan.Channel, name: str, top: int) -> dict[str, Any]:
    """One sample of everything `stat` shows, as the documented `stat --json` object."""
    s = ch.stats()
    pst = ch.pause_state()
    return {
        "time": time.time(),
        "name": name,
        "temporary": ch.temporary,
        "stats": dataclasses.asdict(s),
        "rates": None,
        "paused": {
            "channel": pst.paused,
            "keys": [_paused_key_json(pst, i) for i in range(len(pst.keys))],
        },
        "held": [
            {
                "key": _key_json(h.key),
                "seq": h.seq,
                "pid": h.pid,
                "attempt": h.attempt,
                "age": round(h.age, 3),
            }
            for h in ch.held()
        ],
        "waiting": [
            {"key": _key_json(w.key), "depth": w.depth, "head_seq": w.head_seq}
            for w in ch.waiting(top)
        ],
        "producers": [{"pid": p.pid, "sent": p.sent} for p in inspect.producers(ch) if p.alive],
        "dead_letters": [
            {
                "seq": d.seq,
                "keys": [_key_json(k) for k in d.keys],
                "attempts": d.attempts,
                "reason": d.reason,
                "size": _payload_size(d.payload),
            }
            for d in ch.dead_letters()
        ],
    }


def _add_rates(sample: dict[str, Any], before: dict[str, Any] | None, dt: float) -> None:
    if before is None or dt <= 0:
        return
    now, then = sample["stats"], before["stats"]
    sample["rates"] = {k: round((now[k] - then[k]) / dt, 1) for k in _COUNTERS}


def _json_key_text(key: object) -> str:
    if isinstance(key, dict):
        return repr(bytes.fromhex(key["bytes"]))
    return _key_text(key)


def _stats_text(sample: dict[str, Any], compact: bool = False) -> str:
    """The `stat` screen; `compact` puts the Stats fields a few to a line (the live view
    of --watch, which must fit a terminal)."""
    fields = sample["stats"]
    rates = sample["rates"]
    if compact:
        cells = [f"channel {sample['name']}"]
        for key, value in fields.items():
            text = _human_bytes(value) if key in _BYTE_FIELDS else f"{value}"
            if rates is not None and key in rates:
                text += f" ({rates[key]:+,.0f}/s)"
            cells.append(f"{key} {text}")
        lines = ["   ".join(cells[i : i + 4]) for i in range(0, len(cells), 4)]
    else:
        width = max(len(k) for k in fields)
        lines = [f"{'channel':<{width}}  {sample['name']}"]
        for key, value in fields.items():
            text = f"{value}"
            if key in _BYTE_FIELDS:
                text = f"{value} ({_human_bytes(value)})"
            if rates is not None and key in rates:
                text = f"{text:<14} {rates[key]:>+12,.0f}/s"
            lines.append(f"{key:<{width}}  {text}")
    paused = sample.get("paused") or {"channel": False, "keys": []}
    lines += ["", "paused: " + ("yes, the whole channel" if paused["channel"] else "no")]
    lines += [f"paused keys: {len(paused['keys'])}"]
    if sample.get("temporary"):
        lines += ["temporary: yes (removed when its last user exits)"]
    for k in paused["keys"]:
        hashed = isinstance(k, dict) and "hash" in k  # a key too long to keep for display
        lines.append("  " + (f"hash {k['hash']:#x}" if hashed else _json_key_text(k)))
    held = sample["held"]
    rows: list[tuple[str, ...]]
    lines += ["", f"held keys: {len(held)}"]
    if held:
        rows = [
            (
                _json_key_text(h["key"]),
                str(h["seq"]),
                str(h["pid"]),
                str(h["attempt"]),
                _age_text(h["age"]),
            )
            for h in held
        ]
        lines += _table(("KEY", "SEQ", "PID", "ATTEMPT", "HELD FOR"), rows, "  ")
    waiting = sample["waiting"]
    lines += ["", f"deepest waiting lines: {len(waiting)}"]
    if waiting:
        rows = [(_json_key_text(w["key"]), str(w["depth"]), str(w["head_seq"])) for w in waiting]
        lines += _table(("KEY", "DEPTH", "HEAD SEQ"), rows, "  ")
    producers = sample["producers"]
    lines += ["", f"live producers: {len(producers)}"]
    if producers:
        rows = [(str(p["pid"]), str(p["sent"])) for p in producers]
        lines += _table(("PID", "SENT"), rows, "  ")
    dead = sample["dead_letters"]
    lines += ["", f"dead letters: {len(dead)}"]
    if dead:
        rows = [
            (
                str(d["seq"]),
                ", ".join(_json_key_text(k) for k in d["keys"]),
                str(d["attempts"]),
                str(d["size"]),
            )
            for d in dead
        ]
        lines += _table(("SEQ", "KEYS", "ATTEMPTS", "SIZE"), rows, "  ")
    return "\n".join(lines)


def _delayed_text(due: float | None) -> str:
    """ "delayed until 12:00:03.250 UTC (in 2.5 s)" """
    if due is None:
        return "delayed"
    when = time.strftime("%H:%M:%S", time.gmtime(due)) + f".{int(due * 1000) % 1000:03d} UTC"
    return f"delayed until {when} (in {max(0.0, due - time.time()):.1f} s)"


def _why_text(chain: inspect.WaitChain) -> str:
    """The why_waiting chain as sentences an operator reads."""
    seq = chain.seq
    if chain.state == inspect.IN_FLIGHT:
        return (
            f"seq {seq} is not waiting: it is in flight, held by pid {chain.pid} for "
            f"{_age_text(chain.age or 0.0)}, attempt {chain.attempt}"
        )
    if chain.state == inspect.READY and chain.paused:
        return (
            f"seq {seq} is ready, nothing is ahead of it, but it is held back: "
            f"{chain.paused} (`shmchan resume` ends it)"
        )
    if chain.state == inspect.READY:
        return f"seq {seq} is not waiting: nothing is ahead of it, the next recv() hands it out"
    if chain.state == inspect.DELAYED:
        return f"seq {seq} is not waiting: it is {_delayed_text(chain.due)}, keeping its keys"
    if chain.state == inspect.DELIVERED:
        return f"seq {seq} is not waiting: it was delivered and released"
    if chain.state == inspect.DEAD_LETTER:
        return (
            f"seq {seq} is not waiting: it is a dead letter after {chain.attempt} attempts "
            f"(see `shmchan dead`)"
        )
    if chain.state != inspect.WAITING:
        return f"seq {seq} is unknown: not sent yet, or dropped when its producer died"
    if not chain and chain.paused:
        return f"seq {seq} is waiting: held back, {chain.paused}"
    if not chain:
        return f"seq {seq} is waiting, but nothing holds it back any more: it goes next"
    parts = []
    shown = list(enumerate(chain))
    if len(chain) > 8:  # a long line: the first three steps and the last three
        skipped = len(chain) - 6
        shown = shown[:3] + [(-skipped, chain[3])] + shown[-3:]
    for i, w in shown:
        if i < 0:
            parts.append(f"... {-i} more messages ...")
            continue
        who = f"seq {seq}" if i == 0 else "which"
        parts.append(f"{who} waits on key {_key_text(w.key)} behind seq {w.seq}")
    last = chain[-1]
    text = ", ".join(parts)
    if last.state == inspect.IN_FLIGHT:
        alive = last.pid is not None and inspect.pid_alive(last.pid)
        dead = "" if alive else " (that process is gone: it is redelivered at the next check)"
        text += (
            f", held by pid {last.pid} for {_age_text(last.age or 0.0)}, "
            f"attempt {last.attempt}{dead}"
        )
    elif last.state == inspect.READY and chain.paused:
        text += f", which is ready but held back: {chain.paused}"
    elif last.state == inspect.READY:
        text += ", which is ready: the next recv() hands it out"
    elif last.state == inspect.DELAYED:
        text += f", which is {_delayed_text(last.due)}"
    elif last.state == inspect.DELIVERED:
        text += ", which was just released"
    if chain.paused and last.state != inspect.READY:
        text += f"; held back: {chain.paused}"
    if chain.partial:
        text += " (the receiver was busy: this reading may be incomplete)"
    return text


def _cmd_stat(args: argparse.Namespace) -> int:
    name = args.name
    ch = _open(name, args.path)
    try:
        if args.why is not None:
            chain = ch.why_waiting(args.why)
            if args.json:
                print(json.dumps(_why_json(chain)))
            else:
                print(_why_text(chain))
            return EXIT_OK
        if args.prometheus:
            try:
                from shmchan import metrics
            except ImportError:
                raise _UserError(
                    "--prometheus needs prometheus_client: pip install 'shmchan[metrics]'"
                ) from None
            sys.stdout.write(metrics.openmetrics_text(ch, name, top=args.top))
            return EXIT_OK
        if args.watch is None:
            first = _sample(ch, name, args.top)
            time.sleep(_RATE_SECONDS)  # a second reading gives the rates
            sample = _sample(ch, name, args.top)
            _add_rates(sample, first, sample["time"] - first["time"])
            print(json.dumps(sample) if args.json else _stats_text(sample))
            return EXIT_OK
        return _watch(ch, name, args)
    finally:
        ch.close()


_RATE_SECONDS = 0.2  # stat without --watch: the rates are measured over this long


def _why_json(chain: inspect.WaitChain) -> dict[str, Any]:
    return {
        "seq": chain.seq,
        "state": chain.state,
        "pid": chain.pid,
        "due": chain.due,
        "partial": chain.partial,
        "paused": chain.paused,
        "chain": [
            {
                "key": _key_json(w.key),
                "seq": w.seq,
                "pid": w.pid,
                "attempt": w.attempt,
                "state": w.state,
                "age": None if w.age is None else round(w.age, 3),
                "due": w.due,
            }
            for w in chain
        ],
    }


def _watch(ch: shmchan.Channel, name: str, args: argparse.Namespace) -> int:
    """--watch: sample every `interval` seconds until Ctrl-C; in place with rich on a
    terminal, one block (or JSON line) per sample otherwise."""
    interval = args.watch
    live = None
    if sys.stdout.isatty() and not args.json:
        from rich.live import Live

        live = Live(auto_refresh=False, redirect_stdout=False, transient=False)
        live.start()
    before: dict[str, Any] | None = None
    try:
        while True:
            if ch.removed():  # works for path= channels too (they are not in /dev/shm)
                raise _UserError(f"channel {name!r} was removed")
            sample = _sample(ch, name, args.top)
            _add_rates(sample, before, sample["time"] - before["time"] if before else 0.0)
            before = sample
            if args.json:
                print(json.dumps(sample), flush=True)
            else:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                body = _stats_text(sample, compact=live is not None)
                text = f"{stamp}  (every {interval:g} s, Ctrl-C to stop)\n{body}"
                if live is not None:
                    from rich.text import Text

                    live.update(Text(text), refresh=True)
                else:
                    print(text + "\n", flush=True)
            time.sleep(interval)
    finally:  # Ctrl-C, the way to stop watching, exits 130 (main)
        if live is not None:
            live.stop()


def _cmd_rm(args: argparse.Namespace) -> int:
    if args.stale:
        if args.name is not None or args.force or args.exchange or args.channel:
            raise _UsageError("rm --stale takes no NAME, --force, --exchange or --channel")
        return _rm_stale()
    if args.name is None:
        raise _UsageError("rm needs a NAME (or --stale)")
    if args.exchange and (args.channel or args.path):
        raise _UsageError("rm --exchange takes no --channel or --path (exchanges have no file)")
    name = args.name
    if not args.channel and args.path is None:
        is_exchange = name in exchange.list_exchanges()
        if args.exchange or (is_exchange and name not in shmchan.list_channels()):
            return _rm_exchange(name, args.force)
        if is_exchange:
            raise _UserError(
                f"{name!r} names both a channel and an exchange: `shmchan rm --channel {name}` "
                f"removes the channel, `shmchan rm --exchange {name}` the exchange"
            )
    path = inspect.segment_path(name, args.path)
    ch = _open(name, args.path)
    try:
        users = inspect.users(ch, path)
    finally:
        ch.close()
    if users and not args.force:
        who = "; ".join(f"pid {pid} ({', '.join(how)})" for pid, how in sorted(users.items()))
        raise _UserError(
            f"channel {name!r} is still in use by live processes: {who}; "
            f"`rm --force` removes it anyway (they keep working on the removed segment)"
        )
    try:
        shmchan.unlink(name, path=args.path)
    except shmchan.ChannelNotFound:
        raise _UserError(f"no channel named {name!r}") from None
    print(f"removed {name}")
    return EXIT_OK


def _exchange_users(name: str) -> set[int]:
    path = exchange.segment_path(name)
    return inspect.mapping_pids([path])[path] - {os.getpid()}


def _rm_exchange(name: str, force: bool) -> int:
    exchange.segment_path(name)  # refuses a bad name (InvalidArgument: bad usage)
    if name not in exchange.list_exchanges():
        raise _UserError(f"no exchange named {name!r}")
    users = _exchange_users(name)
    if users and not force:
        who = ", ".join(str(pid) for pid in sorted(users))
        raise _UserError(
            f"exchange {name!r} is still open in live processes: pid {who}; "
            f"`rm --force --exchange {name}` removes it anyway (they keep publishing "
            f"through the removed exchange)"
        )
    try:
        shmchan.unlink_exchange(name)
    except shmchan.ExchangeNotFound:
        raise _UserError(f"no exchange named {name!r}") from None
    print(f"removed exchange {name}")
    return EXIT_OK


_YOUNG_SECONDS = 10.0  # rm --stale leaves unreadable segments younger than this alone


def _rm_stale() -> int:
    removed = 0
    for name in temporary.sweep():
        print(f"removed temporary channel {name} (no live process used it)")
        removed += 1
    names = sorted(shmchan.list_channels())
    paths = {n: inspect.segment_path(n) for n in names}
    maps = inspect.mapping_pids(list(paths.values()))
    me = os.getpid()
    for name in names:
        if maps.get(paths[name], set()) - {me}:
            continue  # mapped by a live process: in use
        try:
            ch = shmchan.Channel.open(name)
        except shmchan.ChannelNotFound:
            continue
        except (shmchan.Error, OSError) as e:
            # Not readable by this version (another layout, never initialized): nobody
            # maps it, so nobody uses it -- unless it is being created this very moment.
            try:
                young = time.time() - os.stat(paths[name]).st_ctime < _YOUNG_SECONDS
            except FileNotFoundError:
                continue
            if young:
                print(f"shmchan rm: {name}: left alone for now: {e}", file=sys.stderr)
                continue
        else:
            try:
                users = inspect.users(ch, paths[name])
            finally:
                ch.close()
            if users:
                continue
        try:
            shmchan.unlink(name)
        except shmchan.ChannelNotFound:
            continue
        print(f"removed {name} (no live process used it)")
        removed += 1
    for name in exchange.list_exchanges():
        try:
            if _exchange_users(name):
                continue
            try:
                shmchan.Exchange.open(name).close()
            except (shmchan.Error, OSError, ValueError):
                # Not readable: nobody has it open, so nobody uses it -- unless it is
                # being created this very moment.
                made = os.stat(exchange.segment_path(name)).st_ctime
                if time.time() - made < _YOUNG_SECONDS:
                    continue
            shmchan.unlink_exchange(name)
        except (FileNotFoundError, shmchan.ExchangeNotFound):
            continue
        print(f"removed exchange {name} (no live process used it)")
        removed += 1
    if not removed:
        print("no stale channels or exchanges")
    return EXIT_OK


def _cli_keys(args: argparse.Namespace) -> list[Key]:
    """The keys of --key (str), --int-key and --bytes-key (hex), in that order."""
    keys: list[Key] = list(args.key or [])
    keys += list(args.int_key or [])
    for text in args.bytes_key or []:
        try:
            keys.append(bytes.fromhex(text))
        except ValueError:
            raise _UsageError(f"--bytes-key takes hex digits, got {text!r}") from None
    return keys


def _cmd_pause_resume(args: argparse.Namespace) -> int:
    """`pause` and `resume`: the whole channel, or each key given."""
    pausing = args.command == "pause"
    ch = _open(args.name, args.path)
    try:
        keys = _cli_keys(args)
        if not keys and pausing:
            ch.pause()
            print(f"paused channel {args.name}: its receiver hands out nothing until resumed")
        elif not keys:
            ch.resume()
            print(f"resumed channel {args.name}")
        for key in keys:
            if pausing:
                ch.pause_key(key)
                done = "paused"
            else:
                done = "resumed" if ch.resume_key(key) else "was not paused:"
            print(f"{done} key {_key_text(key)} on channel {args.name}")
    finally:
        ch.close()
    return EXIT_OK


def _cmd_dead(args: argparse.Namespace) -> int:
    name = args.name
    ch = _open(name, args.path)
    try:
        letters = {d.seq: d for d in ch.dead_letters()}
        wanted = list(letters) if args.all else (args.resend or [])
        acting = bool(wanted or args.drop)
        for seq in [*wanted, *(args.drop or [])]:
            if seq not in letters:
                raise _UserError(f"seq {seq} is not a dead letter of {name!r}")
        if acting:
            tx = ch.sender()
            try:
                for seq in wanted:
                    new = letters[seq].resend(tx)
                    print(f"resent dead letter seq {seq} as seq {new}")
            finally:
                tx.close()
            for seq in args.drop or []:
                if seq in wanted:
                    continue  # resending dropped it already
                letters[seq].discard()
                print(f"dropped dead letter seq {seq}")
            return EXIT_OK
        if not letters:
            print(f"no dead letters in {name}")
            return EXIT_OK
        rows = [
            (
                str(d.seq),
                ", ".join(_key_text(k) for k in d.keys),
                str(d.attempts),
                str(_payload_size(d.payload)),
                _preview(d.payload),
            )
            for d in sorted(letters.values(), key=lambda d: d.seq)
        ]
        for line in _table(("SEQ", "KEYS", "ATTEMPTS", "SIZE", "PAYLOAD"), rows):
            print(line)
        return EXIT_OK
    finally:
        ch.close()


def _cmd_demo(args: argparse.Namespace) -> int:
    return demo.run(args)


def _bench(argv: Sequence[str]) -> int:
    """`bench ARGS...`: hand every argument to `shmchan.bench.main`."""
    from shmchan import bench

    rc = bench.main(list(argv))
    return rc if isinstance(rc, int) else EXIT_OK


# --------------------------------------------------------------------------- parser


def _prog() -> str:
    return "python -m shmchan" if os.path.basename(sys.argv[0]) == "__main__.py" else "shmchan"


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 1e6:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"must be positive and finite (seconds, below 1000000), got {text}"
        )
    return value


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a message seq: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"seqs start at 1, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if not 0 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be between 0 and 4096, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Inspect and manage shmchan channels (key-locked shared-memory channels).",
    )
    version = f"%(prog)s {getattr(shmchan, '__version__', '?')}"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ls",
        help="list every channel: size, backlog, processes, and leftovers no live process uses",
    )
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "stat",
        help="a channel's statistics, held keys, deepest lines, producers and dead letters",
    )
    p.add_argument("name", metavar="NAME", help="channel name")
    p.add_argument(
        "--json", action="store_true", help="print JSON (one object per line with --watch)"
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=_interval,
        const=1.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    p.add_argument(
        "--why",
        type=_seq,
        metavar="SEQ",
        help="explain why message SEQ is not handed out: the chain of what it waits on",
    )
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="print the OpenMetrics text format (for node_exporter's textfile collector)",
    )
    p.add_argument(
        "--top", type=_count, default=10, metavar="N", help="deepest lines to show (default 10)"
    )
    p.add_argument(
        "--path", metavar="FILE", help="the channel's file, for channels created with path="
    )
    p.set_defaults(func=_cmd_stat)

    p = sub.add_parser(
        "rm",
        help="remove a channel or an exchange (refused while a live process uses it, "
        "unless --force)",
    )
    p.add_argument("name", metavar="NAME", nargs="?", help="channel or exchange name")
    p.add_argument(
        "--force", action="store_true", help="remove it even if live processes still use it"
    )
    p.add_argument(
        "--stale",
        action="store_true",
        help="remove every channel and exchange that no live process uses, and say which",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--exchange",
        action="store_true",
        help="NAME is an exchange (needed when a channel has the same name)",
    )
    kind.add_argument(
        "--channel",
        action="store_true",
        help="NAME is a channel (needed when an exchange has the same name)",
    )
    p.add_argument(
        "--path", metavar="FILE", help="the channel's file, for channels created with path="
    )
    p.set_defaults(func=_cmd_rm)

    p = sub.add_parser("dead", help="list a channel's dead letters; resend or drop them")
    p.add_argument("name", metavar="NAME", help="channel name")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--resend", type=_seq, action="append", metavar="SEQ", help="send dead letter SEQ again"
    )
    what.add_argument("--all", action="store_true", help="send every dead letter again")
    p.add_argument(
        "--drop", type=_seq, action="append", metavar="SEQ", help="drop dead letter SEQ for good"
    )
    p.add_argument(
        "--path", metavar="FILE", help="the channel's file, for channels created with path="
    )
    p.set_defaults(func=_cmd_dead)

    for command, text in (
        ("pause", "pause a channel (its receiver hands out nothing) or, with --key, single "
         "keys (messages on them, and those behind them, wait)"),
        ("resume", "resume a paused channel or, with --key, paused keys"),
    ):  # fmt: skip
        p = sub.add_parser(command, help=text)
        p.add_argument("name", metavar="NAME", help="channel name")
        p.add_argument("--key", action="append", metavar="K", help="a str key (repeatable)")
        p.add_argument(
            "--int-key", type=int, action="append", metavar="N", help="an int key (repeatable)"
        )
        p.add_argument(
            "--bytes-key", action="append", metavar="HEX", help="a bytes key, in hex (repeatable)"
        )
        p.add_argument(
            "--path", metavar="FILE", help="the channel's file, for channels created with path="
        )
        p.set_defaults(func=_cmd_pause_resume)

    p = sub.add_parser(
        "demo",
        help="run the bank-transfer demo and check it against a serial replay",
        description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None,
    )
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)

    # Only listed here for --help; main() hands `bench ...` over before parsing.
    sub.add_parser(
        "bench", help="run the benchmarks (arguments go to the benchmark)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m shmchan` and the `shmchan` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            return _bench(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func
        try:
            return func(args)
        except _UsageError as e:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    except _UserError as e:
        return _fail(argv, str(e))
    except (shmchan.InvalidArgument, shmchan.UnsupportedType) as e:  # e.g. a bad name
        return _fail(argv, str(e), EXIT_USAGE)
    except shmchan.Error as e:
        return _fail(argv, f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:  # also the way to stop `stat --watch`
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `shmchan ls | head`: the reader left; stay quiet like other Unix tools.
        _silence_stdout()
        return EXIT_OK
    except (ValueError, OSError) as e:  # a permission, a full disk, ...: one line too
        return _fail(argv, str(e))


def _fail(argv: Sequence[str], message: str, code: int = EXIT_FAILED) -> int:
    command = next((a for a in argv if not a.startswith("-")), "")
    prefix = f"shmchan {command}" if command else "shmchan"
    line = " ".join(message.split())  # one line, whatever the message holds
    print(f"{prefix}: error: {line}", file=sys.stderr)
    return code


def _silence_stdout() -> None:
    # Point stdout at /dev/null so the interpreter's final flush does not fail again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    raise SystemExit(main())
