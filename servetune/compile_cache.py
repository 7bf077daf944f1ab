"""JAX's compiled engines kept on disk, so that a command run again does not wait for XLA again.

Compiling the engine for one configuration takes seconds; simulating a few thousand requests with it takes a tenth of
that. Every command that simulates calls ``use_persistent_compilation_cache`` before it compiles anything. The
programs live under ``SERVETUNE_JAX_CACHE`` (else ~/.cache/servetune/jax), in a folder per servetune, JAX and jaxlib
version: JAX's own key already holds the program and the XLA flags, and the versions in the path make sure an
upgrade never reads a program another release compiled (and leave the old ones for ``servetune cache clear``).
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Optional

CACHE_ENV = "SERVETUNE_JAX_CACHE"
# Programs that compile faster than this are not worth a file (JAX's default is 1 s; the engine's small variants,
# a cluster's lanes, take about that).
MIN_COMPILE_TIME_S = 0.5


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "servetune" / "jax"))


def cache_folder(root: Optional[Path] = None) -> Path:
    """This installation's folder: one per servetune, JAX and jaxlib version (read without importing JAX, so that
    a process can point JAX_COMPILATION_CACHE_DIR at it before JAX starts)."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    tag = f"servetune-{version('servetune')}_jax-{version('jax')}_jaxlib-{version('jaxlib')}"
    return (root or cache_root()) / tag


def use_persistent_compilation_cache(root: Optional[Path] = None) -> Path:
    """Point JAX at this installation's folder (made if absent) and return it."""
    import jax

    folder = cache_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return folder


def cache_contents(root: Optional[Path] = None) -> list[tuple[Path, int, int]]:
    """Each version's folder under the cache: (folder, programs, bytes), this installation's first. Programs an
    earlier servetune kept in the root itself count as the root's."""
    root = root or cache_root()
    if not root.is_dir():
        return []
    current = cache_folder(root)
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: (p != current, p.name))
    contents = []
    for folder in folders:
        files = [f for f in folder.rglob("*") if f.is_file()]
        contents.append((folder, len(files), sum(f.stat().st_size for f in files)))
    loose = [f for f in root.iterdir() if f.is_file()]
    if loose:
        contents.append((root, len(loose), sum(f.stat().st_size for f in loose)))
    return contents


def clear_cache(root: Optional[Path] = None) -> int:
    """Remove every version's programs; the number of files removed."""
    root = root or cache_root()
    removed = 0
    for folder, count, _ in cache_contents(root):
        if folder == root:
            for file in root.iterdir():
                if file.is_file():
                    file.unlink()
        else:
            shutil.rmtree(folder)
        removed += count
    return removed
