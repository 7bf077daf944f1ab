"""How long loading a trace takes, per format, at about 20k rows (the workload issue asks for well under a
second).

    python benchmarks/bench_traces.py

Times (best of 5) for the shipped Azure conversation trace (19,366 rows), 20,000 generated rows of the
processed, servetune and Mooncake formats, and the Mooncake conversation trace from ../shared when present.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from servetune.envs.workload.traces import load_trace
from servetune.paths import REPO_ROOT, shared_data_dir

ROWS = 20_000


def _best_of(path: Path, format: str, repeats: int = 5) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        count = load_trace(path, format).num_requests
        best = min(best, time.perf_counter() - start)
    return best, count


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    processed = folder / "processed.csv"
    processed.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{i * 0.01:.6f},{1 + i % 4000},{1 + i % 500}\n" for i in range(ROWS)))
    servetune = folder / "servetune.csv"
    servetune.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,tenant,priority,prefix_id\n" + "".join(
        f"{i * 0.01:.6f},{1 + i % 4000},{1 + i % 500},t{i % 3},{i % 2},{i % 7}\n" for i in range(ROWS)))
    mooncake = folder / "mooncake.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 12_000, "output_length": 300,
                                            "hash_ids": list(range(i, i + 24))}) + "\n" for i in range(ROWS)))
    cases = [("azure (shipped conv trace)", REPO_ROOT / "examples" / "traces" / "AzureLLMInferenceTrace_conv.csv",
              "azure"),
             ("processed", processed, "processed"), ("servetune (all columns)", servetune, "servetune"),
             ("mooncake (24 hash ids a row)", mooncake, "mooncake")]
    shared = shared_data_dir()
    if shared is not None:
        cases.append(("mooncake conversation trace", shared / "traces" / "mooncake" / "conversation_trace.jsonl",
                      "mooncake"))
    print("| trace | rows | load time (best of 5) |")
    print("|---|---:|---:|")
    for name, path, format in cases:
        seconds, count = _best_of(path, format)
        print(f"| {name} | {count:,} | {seconds * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
