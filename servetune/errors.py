"""Errors in what the user gave us (a config, an override, a trace), as opposed to bugs in servetune.

The CLI prints a ``UserError`` as it is and exits with status 2, without a traceback, so its text must
stand alone: one line naming the file, the field, the value found and what was expected. An error may carry
several such lines (a config with several bad fields): the CLI prints each on its own.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence


class UserError(Exception):
    """An error in the user's input: one line per message (``lines``); ``str()`` joins them, one per line."""

    def __init__(self, message: str, *more: str) -> None:
        # Parts of a message may come from elsewhere (a YAML parser's problem text, a bad field value);
        # joining its lines keeps the promise of one line per message whatever they contain.
        self.lines = tuple(" ".join(part.strip() for part in text.splitlines() if part.strip())
                           for text in (message, *more))
        super().__init__(*self.lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)


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
        raise ConfigError(*(f"{source}: {line}" for line in error.lines)) from None


class InvalidValue(UserError):
    """A value that a function given it cannot use: ``name: got value, expected ...``. Callers that know which
    config field or flag the value came from re-raise it under that name (``expected`` and ``value`` stay)."""

    def __init__(self, name: str, value: object, expected: str) -> None:
        self.name, self.value, self.expected = name, value, expected
        shown = repr(value)
        super().__init__(f"{name}: got {shown if len(shown) <= 60 else shown[:60] + '...'}, expected {expected}")


def unforced_fit_problems(source, problems: Sequence[str], written: bool) -> Optional[str]:
    """A calibration's verdict on its fit's ``problems``: a UserError when they kept the profile from being written,
    else the warning to print (None without problems)."""
    if not problems:
        return None
    verdict = "wrote it anyway (--force)" if written else "wrote nothing (--force writes it anyway)"
    message = f"{source}: {'; '.join(problems)}: {verdict}"
    if not written:
        raise UserError(message)
    return f"warning: {message}"


def parse_json(text: str, path, expected: str, error_type: type[UserError] = UserError):
    """``text`` (the file ``path``) as JSON; an ``error_type`` naming the line and column, or why Python cannot
    read it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise error_type(f"{path}: line {error.lineno}, column {error.colno}: not valid JSON ({error.msg}), "
                         f"expected {expected}") from None
    except (ValueError, RecursionError):   # a number past Python's digit limit; nesting past its recursion limit
        raise error_type(f"{path}: not JSON that Python reads (a number with too many digits, or nesting too "
                         f"deep), expected {expected}") from None


def parse_json_lines(path, text: str, expected: str):
    """(where, the object) per non-blank line of a JSONL file, each line a JSON object (``expected`` says what
    it should hold); a TraceError naming the line otherwise."""
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{where}: column {error.colno}: not valid JSON ({error.msg}); expected one JSON "
                             "object per line") from None
        except (ValueError, RecursionError):
            raise TraceError(f"{where}: not a readable JSON object; expected one JSON object per line") from None
        if type(record) is not dict:
            raise TraceError(f"{where}: got {show_json(record)}, expected {expected}")
        yield where, record

# --- showing a bad value in a message ------------------------------------------------------------------------
# One line whatever the value holds, cut to SHOWN_CHARS so that a runaway value still gives a readable message.

SHOWN_CHARS = 60


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with "..." when it was longer."""
    return text if len(text) <= limit else text[:limit] + "..."


def show_text(text: str) -> str:
    """Text read from a user's file (a CSV field), quoted, cut short: ``'12x'``."""
    return repr(shorten(text))


def show_json(value) -> str:
    """A parsed JSON value as JSON text (ASCII, so one line), cut short: ``{"a": [1, 2]}``."""
    return shorten(json.dumps(value))


def show_yaml(value, *, quote_text: bool = True) -> str:
    """A value as a YAML file or ``--set`` writes it (null, true, 3.5, .inf, 'text', [1, 4], {a: 1}), cut short;
    ``quote_text=False`` leaves text bare, as in ``--set scheduler.policy=static``."""
    return shorten(_as_yaml(value, quote_text))


def _as_yaml(value, quote_text: bool) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if quote_text else value
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_as_yaml(item, quote_text) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_as_yaml(item, quote_text)}" for key, item in value.items()) + "}"
    return str(value)
