"""What a user waits for XLA: `servetune simulate` of a config run twice, the second time reading the engine that the
first kept on disk (servetune/compile_cache.py).

    python benchmarks/bench_compile_cache.py [--config examples/chat.yaml] [--write BENCHMARKS.md]

Each run is a fresh process, as a user's is, over an empty cache folder made for the measurement.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from markdown_sections import replace_section  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parents[1]
HEADER = "### Compile cache"
COMMAND = "python benchmarks/bench_compile_cache.py --write BENCHMARKS.md"


def simulate_wall_time(config: Path, cache: Path) -> tuple[float, float]:
    """(compile s, simulate s) as `servetune simulate` reports them."""
    environment = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    environment["SERVETUNE_JAX_CACHE"] = str(cache)
    environment["COLUMNS"] = "200"
    done = subprocess.run([sys.executable, "-m", "servetune.cli", "simulate", str(config)], env=environment,
                          capture_output=True, text=True, check=True)
    found = re.search(r"compile ([\d.]+) s, simulate ([\d.]+) s", done.stdout)
    if found is None:
        raise RuntimeError(f"no wall time in simulate's output:\n{done.stdout}")
    return float(found.group(1)), float(found.group(2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "chat.yaml")
    parser.add_argument("--write", type=Path, help="replace the section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="servetune-bench-cache-") as cache:
        first = simulate_wall_time(args.config, Path(cache))
        second = simulate_wall_time(args.config, Path(cache))
    name = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    body = (f"`servetune simulate {name}` twice, each a fresh process over one empty cache folder, measured with "
            f"`{COMMAND}` on this machine (2 cores, shared):\n\n| run | compile | simulate |\n|---|---|---|\n"
            f"| first (cold) | {first[0]:.2f} s | {first[1]:.2f} s |\n| second (engine read from disk) | "
            f"{second[0]:.2f} s | {second[1]:.2f} s |")
    print(body)
    if args.write:
        replace_section(args.write, HEADER, body, before="### Queue orders and prefix caching")
    return 0


if __name__ == "__main__":
    sys.exit(main())
