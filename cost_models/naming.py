"""Catalogue names: one normal form for lookups, and a helpful error when a name is unknown."""
from __future__ import annotations

import difflib
from typing import Iterable

from servetune.errors import InvalidValue


def normalise_name(name: str) -> str:
    """Lower-case, with a Hugging Face organisation prefix, "-hf" suffix and spaces/underscores dropped."""
    short = name.strip().lower().rsplit("/", 1)[-1]
    short = short.replace("_", "-").replace(" ", "-")
    return short[: -len("-hf")] if short.endswith("-hf") else short


def unknown_name_error(kind: str, name: str, known: Iterable[str], alternative: str = "") -> InvalidValue:
    """``kind: got 'name', expected a known kind`` (or ``alternative``), with the closest names and every one."""
    known = sorted(known)
    close = difflib.get_close_matches(normalise_name(name), known, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return InvalidValue(kind, name, f"a known {kind}{hint}{alternative}; known {kind}s: {', '.join(known)}")
