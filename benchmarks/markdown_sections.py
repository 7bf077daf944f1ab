"""Writing a benchmark's section of BENCHMARKS.md: the generated part replaced, the hand-written notes under its
marker kept, the section appended (or put before an anchor) when the file has none yet."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional


def replace_section(path: Path, header: str, generated: str, notes_marker: Optional[str] = None,
                    before: Optional[str] = None) -> None:
    """``header`` (a ``## `` or ``### `` line) followed by ``generated``, then ``notes_marker`` and the notes the
    file already has under it. The section runs to the next heading of its level or above."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    level = len(header) - len(header.lstrip("#"))
    pattern = re.compile(rf"^{re.escape(header)}\n.*?(?=^#{{1,{level}}} |\Z)", re.S | re.M)
    old = pattern.search(text)
    section = f"{header}\n\n{generated.strip()}\n\n"
    if notes_marker is not None:
        notes = old.group(0).split(notes_marker, 1)[1].strip("\n") if old and notes_marker in old.group(0) else ""
        section += f"{notes_marker}\n\n" + (f"{notes}\n\n" if notes else "")
    if old:
        text = text[:old.start()] + section + text[old.end():]
    elif before is not None and before in text:
        text = text.replace(before, section + before, 1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
