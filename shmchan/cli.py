"""The command line: `python -m shmchan {ls,stat,rm,demo,bench}` (also installed as `shmchan`).

Exit codes: 0 success, 1 the command failed (missing channel, failed demo, ...),
2 bad usage (or `bench` not available), 130 interrupted. User errors print one line
on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import shmchan
from shmchan import demo

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Stats fields that count bytes; shown human-readable as well.
_BYTE_FIELDS = frozenset({"capacity", "used_bytes"})


class _UserError(Exception):
    """A failure to report as one line on stderr (exit code 1)."""


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
        raise _UserError(f"no channel named {name!r}") from None
    except shmchan.LayoutMismatch as e:
        raise _UserError(f"{name!r} is not a channel this shmchan version can read: {e}") from None
    except shmchan.ChannelCorrupted as e:
        raise _UserError(f"channel {name!r} is corrupted: {e}") from None


def _read_stats(name: str, path: str | None = None) -> shmchan.Stats:
    ch = _open(name, path)
    try:
        return ch.stats()
    finally:
        ch.close()


# --------------------------------------------------------------------------- commands


def _cmd_ls(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str, str, str]] = []
    failed = False
    for name in sorted(shmchan.list_channels()):
        try:
            ch = shmchan.Channel.open(name)
        except shmchan.ChannelNotFound:
            continue  # removed since we listed it
        except (shmchan.Error, OSError) as e:
            # Still list it (it exists), but say why there are no numbers.
            print(f"shmchan ls: {name}: {e}", file=sys.stderr)
            rows.append((name, "?", "?", "?"))
            failed = True
            continue
        try:
            s = ch.stats()
        finally:
            ch.close()
        rows.append((name, _human_bytes(s.capacity), _human_bytes(s.used_bytes), str(s.queued)))
    if rows:
        header = ("NAME", "CAPACITY", "USED", "QUEUED")
        width = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        for r in [header, *rows]:
            print(f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}  {r[3]:>{width[3]}}")
    return EXIT_FAILED if failed else EXIT_OK


def _stats_text(name: str, s: shmchan.Stats, rates: dict[str, float] | None) -> str:
    fields = dataclasses.asdict(s)
    width = max(len(k) for k in fields)
    lines = [f"{'channel':<{width}}  {name}"]
    for key, value in fields.items():
        text = f"{value}"
        if key in _BYTE_FIELDS:
            text = f"{value} ({_human_bytes(value)})"
        if rates is not None and key in rates:
            text = f"{text:<14} {rates[key]:>+12,.0f}/s"
        lines.append(f"{key:<{width}}  {text}")
    return "\n".join(lines)


# Counters whose per-second rate --watch shows.
_COUNTERS = ("sent", "delivered", "released", "redelivered", "discarded")


def _cmd_stat(args: argparse.Namespace) -> int:
    name = args.name
    if args.watch is None:
        s = _read_stats(name, args.path)
        if args.json:
            print(json.dumps({"name": name, **dataclasses.asdict(s)}))
        else:
            print(_stats_text(name, s, None))
        return EXIT_OK

    # --watch: keep one attachment open, sample every `interval` seconds until Ctrl-C.
    interval = args.watch
    ch = _open(name, args.path)
    clear = sys.stdout.isatty() and not args.json
    previous: tuple[float, shmchan.Stats] | None = None
    try:
        while True:
            if ch.removed():  # works for path= channels too (they are not in /dev/shm)
                raise _UserError(f"channel {name!r} was removed")
            now = time.monotonic()
            s = ch.stats()
            if args.json:
                sample = {"time": time.time(), "name": name, **dataclasses.asdict(s)}
                print(json.dumps(sample), flush=True)
            else:
                rates = None
                if previous is not None:
                    dt = max(now - previous[0], 1e-9)
                    before = previous[1]
                    rates = {k: (getattr(s, k) - getattr(before, k)) / dt for k in _COUNTERS}
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                header = f"{stamp}  (every {interval:g} s, Ctrl-C to stop)"
                text = f"{header}\n{_stats_text(name, s, rates)}\n"
                print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            previous = (now, s)
            time.sleep(interval)
    finally:
        ch.close()


def _cmd_rm(args: argparse.Namespace) -> int:
    try:
        shmchan.unlink(args.name, path=args.path)
    except shmchan.ChannelNotFound:
        raise _UserError(f"no channel named {args.name!r}") from None
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    return demo.run(args)


def _bench(argv: Sequence[str]) -> int:
    """`bench ARGS...`: hand every argument to `shmchan.bench.main`, if it exists."""
    if importlib.util.find_spec("shmchan.bench") is None:
        print("bench: not implemented yet", file=sys.stderr)
        return EXIT_USAGE
    # The benchmark module is optional and written separately; mypy may not see it.
    from shmchan import bench  # type: ignore[attr-defined,unused-ignore]

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Inspect and manage shmchan channels (key-locked shared-memory channels).",
    )
    version = f"%(prog)s {getattr(shmchan, '__version__', '?')}"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", help="list channels with capacity, used bytes and queued messages")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("stat", help="show a channel's statistics")
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
        help="repeat every SECONDS (default 1) until Ctrl-C",
    )
    p.add_argument(
        "--path", metavar="FILE", help="the channel's file, for channels created with path="
    )
    p.set_defaults(func=_cmd_stat)

    p = sub.add_parser("rm", help="remove (unlink) a channel")
    p.add_argument("name", metavar="NAME", help="channel name")
    p.add_argument(
        "--path", metavar="FILE", help="the channel's file, for channels created with path="
    )
    p.set_defaults(func=_cmd_rm)

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
        args = build_parser().parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
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
