"""The `cacheclip` command. One module per command group, each adding its subcommands:

    corpus    ingest, ask, demo
    offline   models, calibrate, train
    serving   serve
    stores    store stats | verify | repair
    bench     bench, eval
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import bench, corpus, offline, serving, stores

GROUPS = (corpus, offline, serving, stores, bench)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cacheclip", description="RAG with reused chunk KV caches (CacheClip).")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
