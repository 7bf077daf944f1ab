"""Paths: where the optional real data lives (``../shared/data`` beside the checkout, or $SERVETUNE_SHARED_DATA),
and the checks an output path passes before a command does any work, so that a run is never lost to a path it
cannot write at the end."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

from servetune.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Optional[Path]:
    """The shared data folder if present, else None (tests that need it skip with a reason)."""
    configured = os.environ.get("SERVETUNE_SHARED_DATA")
    candidate = Path(configured) if configured else REPO_ROOT.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def check_output_file(path: Union[str, Path], flag: str) -> None:
    """A UserError naming ``flag`` (``--out``) unless ``path`` can be written as a file: its folder exists, no
    folder stands in its place, and a file can be opened there for writing (tried, which also answers for
    root, whom permission bits do not stop, and for read-only file systems). Leaves no file behind."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, expected the path of a file to write")
    folder = path.parent
    if not folder.exists():
        raise UserError(f"{flag} {path}: no such folder {folder} (create it first)")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: {folder} is a file, expected a folder")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write it ({error.strerror})") from None
    if not existed:
        path.unlink()


def check_output_folder(path: Union[str, Path], flag: str) -> None:
    """A UserError naming ``flag`` unless ``path`` is a folder that exists, or can be created, and takes new
    files."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: is a file, expected a folder")
    existing = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, expected a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write in {existing} ({error.strerror})") from None
