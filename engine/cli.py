"""The `deepinfer` command line.

    deepinfer generate --model PATH "prompt"      stream a completion
    deepinfer bench --model PATH ...               throughput and latency table
    deepinfer edition check [PATH]                 does this checkout match the book?

Each subcommand imports what it needs when it runs, so `edition check` works
without torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _edition_check(args: argparse.Namespace) -> int:
    from engine.edition import check

    status, text = check(Path(args.path), Path(args.manifest) if args.manifest else None)
    print(text, file=sys.stderr if status == 2 else sys.stdout)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    edition = sub.add_parser("edition", help="compare a checkout with the book's edition")
    edition_sub = edition.add_subparsers(dest="edition_command", required=True)
    check = edition_sub.add_parser(
        "check",
        help="list, chapter by chapter, the excerpts that changed, moved or vanished",
    )
    check.add_argument("path", nargs="?", default=".", help="the checkout (default: .)")
    check.add_argument(
        "--manifest",
        help="the edition.json to compare with (default: PATH/docs/edition.json); "
        "use the one a published site links from its footer",
    )
    check.set_defaults(func=_edition_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
