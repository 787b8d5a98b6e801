"""The `cacheclip` command. One module per command group, each adding its subcommands:

    corpus    ingest, ask, demo
    offline   models, calibrate, train
    serving   serve
    stores    store stats | verify | repair

and the groups other installed packages add through the `cacheclip.commands` entry point: the
benchmark harness (`benchmarks/`, package `cacheclip-bench`) adds `bench` and `eval` that way, so
the library never imports it. Where it is not installed, `bench` and `eval` say how to install it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from . import corpus, offline, serving, stores

GROUPS = (corpus, offline, serving, stores)
PLUGIN_GROUP = "cacheclip.commands"
HARNESS_COMMANDS = {"bench": "benchmarks", "eval": "QA evaluation from a file"}
HARNESS_HINT = ("the benchmark harness is not installed; from a clone of the repository: "
                "pip install -e ./benchmarks (or `make install`, which installs it)")


def plugins() -> list:
    """The `add_commands` functions that installed packages register under `cacheclip.commands`;
    one that does not import (a package half installed) is left out with a warning, so that the
    library's own commands still run."""
    out = []
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        try:
            out.append(ep.load())
        except ImportError as err:
            logging.getLogger(__name__).warning("command group %r (%s) does not import: %s", ep.name, ep.value, err)
    return out


def parser(extra: list | None = None) -> argparse.ArgumentParser:
    """The command line: the library's groups, then `extra` (default: the installed plugins')."""
    ap = argparse.ArgumentParser(prog="cacheclip", description="RAG with reused chunk KV caches (CacheClip).")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub)
    for add_commands in plugins() if extra is None else extra:
        add_commands(sub)
    for name, what in HARNESS_COMMANDS.items():
        if name not in sub.choices:  # listed in --help; main() answers them before parsing
            sub.add_parser(name, help=f"{what} (needs the benchmark harness: pip install -e ./benchmarks)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = plugins()
    ap = parser(extra)
    if argv and argv[0] in HARNESS_COMMANDS and not extra:  # no plugin: bench and eval are stubs
        print(f"cacheclip {argv[0]}: {HARNESS_HINT}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as err:
        print(f"cacheclip: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
