"""``kiln``: convert | build | run | serve | bench | eval | lora. Errors in what the user gave exit with code 2 and one line."""
from __future__ import annotations

import argparse
import logging
import sys

from kiln.cli import bench, build, convert, eval, lora, run, serve
from kiln.errors import KilnError


def _with_dashed_aliases(names: tuple[str, ...]) -> list[str]:
    return [*names, *(n.replace("_", "-") for n in names if n.startswith("--") and "_" in n)]


class _AliasGroup(argparse._ArgumentGroup):
    def add_argument(self, *names, **kwargs):
        return super().add_argument(*_with_dashed_aliases(names), **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse that also accepts ``--max-seq-len`` for every ``--max_seq_len`` flag."""

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*_with_dashed_aliases(names), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = _AliasGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kiln", description="kiln: convert, build and run LLMs on PyTorch.")
    parser.add_argument("--log_level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="logging verbosity (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (convert, build, run, serve, bench, eval, lora):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args) or 0
    except KilnError as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
