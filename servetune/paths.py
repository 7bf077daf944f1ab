"""Where the optional real data lives: ``../shared/data`` beside the checkout, or $SERVETUNE_SHARED_DATA."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Optional[Path]:
    """The shared data folder if present, else None (tests that need it skip with a reason)."""
    configured = os.environ.get("SERVETUNE_SHARED_DATA")
    candidate = Path(configured) if configured else REPO_ROOT.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None
