"""MkDocs hook: the command-line reference, rendered from shmchan's argparse parsers.

A page holding the line `<!-- shmchan-cli -->` gets, in its place, one section per
command of `python -m shmchan` with that command's `--help` text, read from the parsers
the command line itself uses (`shmchan.cli.build_parser`, `shmchan.bench.build_parser`),
so the reference cannot drift from the program.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- shmchan-cli -->"


def _help(parser: argparse.ArgumentParser, prog: str) -> str:
    parser.prog = prog
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fix it for the page
    return parser.format_help().rstrip()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public accessor for subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    from shmchan import bench, cli

    parser = cli.build_parser()
    out = ["## shmchan", "", "```text", _help(parser, "python -m shmchan"), "```", ""]
    for name, sub in _subparsers(parser).items():
        if name == "bench":
            sub = bench.build_parser()
        out += [f"## shmchan {name}", "", "```text", _help(sub, f"python -m shmchan {name}")]
        out += ["```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
