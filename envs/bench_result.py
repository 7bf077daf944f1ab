"""Reading `vllm bench serve --save-result [--save-detailed]` files, and comparing two of them metric by metric.

A result file is one JSON object (vLLM 0.33 writes it with ``json.dump``, vllm/benchmarks/serve.py:2447-2457);
servetune's run.json has the same shape (envs/vllm_format.py), so ``servetune compare run.json result.json``
reads both with ``read_bench_result``. Keys this module does not know are kept: vLLM adds keys from release to
release (``--metadata`` writes any), and a reader that dropped them would lose the user's data. A file that
lacks a key every generation benchmark writes, or holds a value of the wrong type, is a ``UserError`` of one line
naming the file, the key, the value and what was expected.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from servetune.errors import UserError, parse_json, reading_user_file, show_json

EXPECTED_FILE = "a `vllm bench serve --save-result` JSON file"

# What `vllm bench serve` writes for every generation benchmark (serve.py:1320-1342), and the type of each.
NUMBER, COUNT, NUMBER_OR_NULL = "a number", "a whole number ≥ 0", "a number or null"
REQUIRED = {
    "duration": NUMBER,
    "completed": COUNT,
    "total_input_tokens": COUNT,
    "total_output_tokens": COUNT,
    "request_throughput": NUMBER_OR_NULL,
    "output_throughput": NUMBER_OR_NULL,
    "total_token_throughput": NUMBER_OR_NULL,
}
# Keys checked when present: vLLM 0.33 writes them, older releases may not; servetune writes them all.
OPTIONAL = {
    "failed": COUNT,
    "num_prompts": COUNT,
    "request_goodput": NUMBER_OR_NULL,
    "max_output_tokens_per_s": NUMBER,
    "max_concurrent_requests": COUNT,
    "rtfx": NUMBER,
    "request_goodput_vllm": NUMBER_OR_NULL,
}
# The per-request arrays of --save-detailed (serve.py:1327-1337) and what their elements are.
ARRAYS = {
    "input_lens": COUNT,
    "output_lens": COUNT,
    "ttfts": NUMBER,
    "itls": "a list of numbers",
    "latencies": NUMBER,
    "start_times": NUMBER,
    "queue_times": NUMBER,
    "generated_texts": "a string",
    "errors": "a string",
}
# A latency statistic, e.g. mean_ttft_ms, p99.9_e2el_ms (serve.py:1425-1436).
STAT_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_([a-z0-9_]+)_ms$")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _matches(value, expected: str) -> bool:
    if expected == NUMBER:
        return _is_number(value)
    if expected == NUMBER_OR_NULL:
        return value is None or _is_number(value)
    if expected == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if expected == "a string":
        return isinstance(value, str)
    if expected == "a list of numbers":
        return isinstance(value, list) and all(_is_number(x) for x in value)
    raise AssertionError(expected)


def _bad(path, key: str, value, expected: str) -> UserError:
    return UserError(f"{path}: {key}: got {show_json(value)}, expected {expected}")


def check_bench_result(data, path) -> dict:
    """``data`` (the parsed file ``path``) if it is a result file as vLLM writes it, else a one-line UserError."""
    if not isinstance(data, dict):
        raise UserError(f"{path}: got {show_json(data)}, expected {EXPECTED_FILE}, one JSON object")
    for key, expected in REQUIRED.items():
        if key not in data:
            raise UserError(f"{path}: {key}: missing, expected {expected} "
                            f"(every `vllm bench serve --save-result` file has it)")
    for key, expected in {**REQUIRED, **OPTIONAL}.items():
        if key in data and not _matches(data[key], expected):
            raise _bad(path, key, data[key], expected)
    for key, value in data.items():
        if STAT_KEY.match(key) and not (value is None or _is_number(value)):
            raise _bad(path, key, value, NUMBER_OR_NULL)
        if key in ARRAYS:
            if not isinstance(value, list):
                raise _bad(path, key, value, f"a list, one element per request, each {ARRAYS[key]}")
            for i, element in enumerate(value):
                if not _matches(element, ARRAYS[key]):
                    raise _bad(path, f"{key}[{i}]", element, ARRAYS[key])
    return data


def read_bench_result(path) -> dict:
    """A `vllm bench serve --save-result [--save-detailed]` file (or servetune's run.json), every key kept."""
    path = Path(path)
    with reading_user_file(path, "result file", EXPECTED_FILE, UserError):
        text = path.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and all(line.lstrip().startswith("{") for line in lines):
        # --append-result writes one result per line (serve.py:2450-2456).
        try:
            appended = [parse_json(line, path, EXPECTED_FILE) for line in lines]
        except UserError:
            appended = None
        if appended is not None and all(isinstance(item, dict) for item in appended):
            raise UserError(f"{path}: holds {len(appended)} results, one per line (`vllm bench serve "
                            f"--append-result`), expected one: copy the line you want into a file of its own")
    return check_bench_result(parse_json(text, path, EXPECTED_FILE), path)


@dataclass(frozen=True)
class Row:
    metric: str
    unit: str
    measured: float
    simulated: float
    relative_error: Optional[float]   # (simulated - measured) / measured; None when measured is 0 and simulated not


def relative_error(measured: float, simulated: float) -> Optional[float]:
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / abs(measured)


COUNTS = (("completed", "requests"), ("failed", "requests"), ("total_input_tokens", "tokens"),
          ("total_output_tokens", "tokens"), ("duration", "s"))
RATES = (("request_throughput", "req/s"), ("output_throughput", "tok/s"), ("total_token_throughput", "tok/s"),
         ("max_output_tokens_per_s", "tok/s"), ("max_concurrent_requests", "requests"))
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def _percentiles(data: dict, metric: str) -> set[float]:
    found = set()
    for key in data:
        match = STAT_KEY.match(key)
        if match and match.group(2) == metric and match.group(1).startswith("p"):
            found.add(float(match.group(1)[1:]))
    return found


def simulated_goodput_key(simulated: dict) -> str:
    """servetune's run.json carries vLLM's definition of goodput as ``request_goodput_vllm`` (its
    ``request_goodput`` also judges inter-token gaps); any other file's is ``request_goodput``."""
    return "request_goodput_vllm" if "request_goodput_vllm" in simulated else "request_goodput"


def compare(measured: dict, simulated: dict) -> list[Row]:
    """The metrics both files report (numbers in both), measured beside simulated with the relative error:
    counts, throughputs, goodput, then mean, median and every percentile both have of TTFT, TPOT, ITL, E2EL."""
    pairs: list[tuple[str, str, str, str]] = []   # (metric shown, unit, measured key, simulated key)
    pairs += [(key, unit, key, key) for key, unit in COUNTS + RATES]
    pairs.append(("request_goodput", "req/s", "request_goodput", simulated_goodput_key(simulated)))
    for metric in LATENCY_METRICS:
        stats = ["mean", "median"] + [f"p{int(p) if int(p) == p else p}"
                                      for p in sorted(_percentiles(measured, metric) & _percentiles(simulated, metric))]
        pairs += [(f"{stat}_{metric}_ms", "ms", f"{stat}_{metric}_ms", f"{stat}_{metric}_ms") for stat in stats]
    rows = []
    for shown, unit, measured_key, simulated_key in pairs:
        m, s = measured.get(measured_key), simulated.get(simulated_key)
        if _is_number(m) and _is_number(s):
            rows.append(Row(shown, unit, float(m), float(s), relative_error(float(m), float(s))))
    return rows


def compare_notes(measured: dict, simulated: dict, rows: list[Row]) -> list[str]:
    """What a reader of the table should know: how goodput was judged on each side."""
    notes = []
    if any(row.metric == "request_goodput" for row in rows) and "request_goodput_vllm" in simulated:
        args = simulated.get("goodput_vllm_args")
        notes.append("request_goodput: measured with the measured run's --goodput (a result file does not record "
                     "it), simulated by vLLM's definition with the config's SLOs"
                     + (f" (--goodput {args})" if args else "") + ", without servetune's ITL SLO")
    return notes


def comparison(measured_path, simulated_path) -> dict:
    """``servetune compare``'s answer as JSON: both paths, the rows and the notes."""
    simulated, measured = read_bench_result(simulated_path), read_bench_result(measured_path)
    rows = compare(measured, simulated)
    return {"simulated": str(simulated_path), "measured": str(measured_path),
            "rows": [asdict(row) for row in rows], "notes": compare_notes(measured, simulated, rows)}
