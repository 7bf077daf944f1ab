"""Errors in what the user gave us (a config, an override, a trace), as opposed to bugs in servetune.

The CLI prints a ``UserError`` as it is and exits with status 2, without a traceback, so its text must
stand alone: one line naming the file, the field, the value found and what was expected.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, Optional


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


@contextmanager
def reading_user_file(path, name: str, expected: str, error: type[UserError]) -> Iterator[None]:
    """Turn the ways reading a user's file can fail into one-line errors.

    `name` is what the file is ("config file"), `expected` what it should have been ("a YAML config file").
    """
    try:
        yield
    except FileNotFoundError:
        raise error(f"{path}: no such {name}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, expected {expected}") from None
    except UnicodeDecodeError as decode_error:
        raise error(f"{path}: byte {decode_error.start}: not UTF-8 text, expected {expected}") from None
    except OSError as os_error:
        raise error(f"{path}: cannot read the {name} ({os_error.strerror})") from None


@contextmanager
def in_config(source: Optional[str]) -> Iterator[None]:
    """Start the ``ConfigError``s raised inside with the config's file: for the checks that can only run once a
    config is resolved or its workload drawn, away from the loader, which names it itself."""
    try:
        yield
    except ConfigError as error:
        if source is None:
            raise
        raise ConfigError(f"{source}: {error}") from None


class InvalidValue(UserError):
    """A value that a function given it cannot use: ``name: got value, expected ...``. Callers that know which
    config field or flag the value came from re-raise it under that name (``expected`` and ``value`` stay)."""

    def __init__(self, name: str, value: object, expected: str) -> None:
        self.name, self.value, self.expected = name, value, expected
        shown = repr(value)
        super().__init__(f"{name}: got {shown if len(shown) <= 60 else shown[:60] + '...'}, expected {expected}")


def parse_json(text: str, path, expected: str):
    """``text`` (the file ``path``) as JSON; a UserError naming the line and column, or why Python cannot read it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: line {error.lineno}, column {error.colno}: not valid JSON ({error.msg}), "
                        f"expected {expected}") from None
    except (ValueError, RecursionError):   # a number past Python's digit limit; nesting past its recursion limit
        raise UserError(f"{path}: not JSON that Python reads (a number with too many digits, or nesting too "
                        f"deep), expected {expected}") from None
