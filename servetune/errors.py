"""Errors in what the user gave us (a config, an override, a trace), as opposed to bugs in servetune.

The CLI prints a ``UserError`` as it is and exits with status 2, without a traceback, so its text must
stand alone: one line naming the file, the field, the value found and what was expected.
"""
from __future__ import annotations


class UserError(Exception):
    """An error in the user's input; ``str()`` is a single line."""

    def __init__(self, message: str) -> None:
        # Parts of a message may come from elsewhere (a YAML parser's problem text, a bad field value);
        # joining its lines keeps the promise of one line whatever they contain.
        super().__init__(" ".join(part.strip() for part in message.splitlines() if part.strip()))


class ConfigError(UserError):
    """An invalid config file, config value or ``--set`` override."""


class TraceError(UserError):
    """A request trace file that cannot be read or breaks the input rules."""
