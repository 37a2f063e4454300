"""The ``ragkv`` command: ``demo``, ``bench`` and ``serve``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``, which
registers the parser and sets ``func(args) -> int``. Modules import their heavy
dependencies (torch, transformers, fastapi) inside ``func``, so ``ragkv --help`` stays fast.
``serve`` is the one place the core reaches into ``integrations/``: its parser module
(``ragkv.integrations.openai.server.cli``) imports no framework at module level, and the HTTP
server, which needs the ``server`` extra, is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ragkv._version import __version__
from ragkv.errors import RagkvError

SUBCOMMANDS = {
    "demo": "ragkv.demo",
    "bench": "ragkv.bench.cli",
    "serve": "ragkv.integrations.openai.server.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragkv",
        description="Cheaper, faster RAG: dedup, canonical assembly and prefix-cached generation.",
    )
    parser.add_argument("--version", action="version", version=f"ragkv {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _quiet_weight_loading() -> None:
    """No "Loading weights" bar from transformers on every engine load (four per bench run,
    one per server start, in its log). The CLI owns its process, so it may say so; the
    library itself never changes transformers' global settings."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    transformers_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ragkv`` console script."""
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # Some libraries set their own logger to DEBUG when imported (bm25s does); filtering at
    # the handler keeps their chatter out of the CLI whatever they do to their loggers.
    for handler in logging.getLogger().handlers:
        handler.setLevel(level)
    if not args.verbose:
        _quiet_weight_loading()
    try:
        return int(args.func(args) or 0)
    except RagkvError as exc:
        print(f"ragkv {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
