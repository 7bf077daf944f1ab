"""The command-line arguments every command that reads a config shares: the config file and ``--set``.

One definition, so that ``simulate``, ``tune``, ``capacity``, ``sweep``, ``train-rl``, ``eval-policy`` and the
benchmark scripts take a config and its overrides the same way, with the same help text.
"""
from __future__ import annotations

import argparse
from typing import Optional

CONFIG_HELP = "YAML config (see examples/)"
SET_HELP = "override a config field, e.g. --set scheduler.max_num_seqs=32 (repeatable; see docs/config.md)"


def add_config_arguments(parser: argparse.ArgumentParser, help: str = CONFIG_HELP, *, optional: bool = False,
                         default: Optional[str] = None) -> None:
    """Add the positional ``config`` (the path, ``args.config``) and ``--set KEY=VALUE`` (``args.overrides``, a
    list, for ``load_config(args.config, args.overrides)``).

    ``optional`` (or a ``default``) lets the path be left out: ``capacity`` takes ``--study`` instead, and the
    benchmark scripts default to a shipped example.
    """
    if optional or default is not None:
        parser.add_argument("config", nargs="?", default=default,
                            help=help + ("" if default is None else f"; default {default}"))
    else:
        parser.add_argument("config", help=help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
