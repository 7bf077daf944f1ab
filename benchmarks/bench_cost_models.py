"""Cost-model benchmark: evaluation speed, calibration accuracy, and a cross-check on data not calibrated on.

    python benchmarks/bench_cost_models.py [--write BENCHMARKS.md]

1. Speed: jitted roofline step times over 4M random mixed batches, and vmapped over 16 configs.
2. Calibration: refits the shipped profile's data (Vidur Llama-2-7B, A100) and reports k-fold held-out
   MAPE per operator and per step, next to the uncalibrated roofline (datasheet peaks, default efficiencies).
3. Cross-check: the shipped profile and the uncalibrated roofline on steps of models it was not fitted on
   (Vidur's other A100 profiles, DistServe's OPT fits under vLLM), the MANIFEST sanity figures, and KV
   capacity against DistServe's ``max_num_tokens``.
Needs ../shared/data for parts 2 and 3 (they are skipped without it).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from servetune.cost_models import calibrate as cal
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.memory import kv_capacity
from servetune.cost_models.profile import load_profile, shipped_profiles
from servetune.cost_models.roofline import Calibration, build_roofline_params, host_overhead_s, step_time_s
from servetune.paths import shared_data_dir
from servetune.types import StepBatch

from markdown_sections import replace_section  # benchmarks/, beside this script

A100 = resolve_gpu("a100-80gb")
COMMAND = "python benchmarks/bench_cost_models.py --write BENCHMARKS.md"
# Vidur A100 profiles other than the calibrated Llama-2-7B, with the TP degree their steps are assembled at
# (the smallest that fits an 80 GB GPU; Llama-2-70B at TP2 is exactly the attention file's layout).
CROSS_CHECK_MODELS = [("meta-llama/Meta-Llama-3-8B", 1), ("microsoft/phi-2", 1), ("internlm/internlm-20b", 1),
                      ("codellama/CodeLlama-34b-Instruct-hf", 2), ("meta-llama/Llama-2-70b-hf", 2),
                      ("meta-llama/Meta-Llama-3-70B", 2)]
MANIFEST_FIGURES = [("decode, batch 1, context 1024", (0, 0, 0, 0, 0, 1, 1024), 9.9),
                    ("decode, batch 8, context 1024", (0, 0, 0, 0, 0, 8, 8 * 1024), 12.9),
                    ("decode, batch 32, context 1024", (0, 0, 0, 0, 0, 32, 32 * 1024), 19.9),
                    ("decode, batch 128, context 1024", (0, 0, 0, 0, 0, 128, 128 * 1024), 47.1),
                    ("prefill 512", (1, 512, 512, 512 * 256, 512 * 256, 0, 0), 36.7),
                    ("prefill 2048", (1, 2048, 2048, 2048 * 1024, 2048 * 1024, 0, 0), 158.5)]


def speed() -> list[str]:
    params = build_roofline_params(resolve_model("llama-2-7b"), A100, 2)
    rows = 1 << 22
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 2048, rows).astype(np.float32)
    cached = rng.integers(0, 4096, rows).astype(np.float32)
    decodes = rng.integers(0, 256, rows).astype(np.float32)
    batch = StepBatch(*(jnp.asarray(x) for x in ((chunk > 0).astype(np.float32), chunk, chunk + cached,
                                                  chunk * (cached + chunk / 2), chunk * chunk / 2, decodes,
                                                  decodes * 1000)))
    single = jax.jit(step_time_s)
    configs = [build_roofline_params(resolve_model(m), A100, tp) for m in ("llama-2-7b", "llama-3-8b")
               for tp in (1, 2, 4, 8)] * 2
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *configs)
    per_config = jax.tree_util.tree_map(lambda x: x[: rows // len(configs)], batch)
    many = jax.jit(jax.vmap(step_time_s, in_axes=(0, None)))

    def best_rate(fn, *args, evaluations):
        fn(*args).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - start)
        return evaluations / min(times) / 1e6

    one = best_rate(single, params, batch, evaluations=rows)
    vmapped = best_rate(many, stacked, per_config, evaluations=len(configs) * (rows // len(configs)))
    return ["| evaluation | step costs per second |", "|---|---:|",
            f"| one config, {rows:,} mixed batches, jit | {one:.1f} M |",
            f"| {len(configs)} configs vmapped x {rows // len(configs):,} batches, jit | {vmapped:.1f} M |"]


def _pooled(errors: list[dict]) -> tuple[float, float]:
    """Row-weighted MAPE and the worst error over several data sets' summaries."""
    rows = sum(e["rows"] for e in errors)
    mape = sum(e["mape_pct"] * e["rows"] for e in errors) / rows
    worst = max((e["worst_pct"] for e in errors), key=abs)
    return mape, worst


def calibration_accuracy(shared: Path) -> list[str]:
    vidur = shared / "profiles" / "vidur"
    result = cal.calibrate([vidur / "compute/a100/meta-llama/Llama-2-7b-hf"],
                           vidur / "attention_legacy/a100/attention.csv", vidur / "network/a100_dgx/all_reduce.csv",
                           vidur / "cpu_overheads/a100/cpu_overheads.csv", None, A100, folds=5)
    lines = ["| data set | rows | calibrated MAPE (held out) | worst | uncalibrated MAPE | worst |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, errors in result.report["datasets"].items():
        fitted, default = errors["calibrated"], errors["uncalibrated"]
        lines.append(f"| {name} | {fitted['rows']} | {fitted['mape_pct']:.2f}% | {fitted['worst_pct']:+.1f}% "
                     f"| {default['mape_pct']:.2f}% | {default['worst_pct']:+.1f}% |")
    steps = [e for n, e in result.report["datasets"].items() if ":step." in n]
    fitted_mape, fitted_worst = _pooled([e["calibrated"] for e in steps])
    default_mape, default_worst = _pooled([e["uncalibrated"] for e in steps])
    lines.append(f"| **all steps (TP1)** | {sum(e['calibrated']['rows'] for e in steps)} | **{fitted_mape:.2f}%** "
                 f"| {fitted_worst:+.1f}% | **{default_mape:.2f}%** | {default_worst:+.1f}% |")
    fitted = ", ".join(f"{k} {v:.3g}" for k, v in result.calibration.as_floats().items())
    return lines + ["", f"Fitted on all rows: {fitted}."]


def _step_errors(datasets: list[cal.Dataset], calibration: Calibration) -> dict:
    measured = np.concatenate([d.measured_s for d in datasets])
    predicted = np.concatenate([np.asarray(cal.predict(d, calibration.as_float32(), A100)) for d in datasets])
    return cal.error_summary(measured, predicted)


def cross_check(shared: Path) -> list[str]:
    vidur = shared / "profiles" / "vidur"
    profile, _ = load_profile(shipped_profiles()[0])
    _, attention_raw = cal.load_vidur_attention(vidur / "attention_legacy/a100/attention.csv")
    lines = ["| steps of | TP | steps | shipped profile MAPE | worst | uncalibrated MAPE | worst |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for model_id, tp in CROSS_CHECK_MODELS:
        _, raw = cal.load_vidur_operators(vidur / "compute/a100" / model_id)
        steps = cal.assemble_vidur_steps(raw, attention_raw, resolve_model(model_id).num_layers, A100, tp)
        fitted, default = _step_errors(steps, profile), _step_errors(steps, Calibration())
        lines.append(f"| Vidur {model_id} | {tp} | {fitted['rows']} | {fitted['mape_pct']:.2f}% | "
                     f"{fitted['worst_pct']:+.1f}% | {default['mape_pct']:.2f}% | {default['worst_pct']:+.1f}% |")
    for engine in ("vllm", "distserve"):
        for d in cal.load_distserve_steps(shared / f"profiles/distserve/profiler-a100-80g.{engine}.json", A100):
            fitted, default = _step_errors([d], profile), _step_errors([d], Calibration())
            lines.append(f"| DistServe fit, {d.name[5:]} under {engine} (TP 1-8, whole steps) | all | "
                         f"{fitted['rows']} | {fitted['mape_pct']:.2f}% | {fitted['worst_pct']:+.1f}% | "
                         f"{default['mape_pct']:.2f}% | {default['worst_pct']:+.1f}% |")
    return lines


def manifest_figures() -> list[str]:
    profile, _ = load_profile(shipped_profiles()[0])
    lines = ["| Llama-2-7B, A100, TP1 (GPU time, no LM head) | MANIFEST | shipped profile | uncalibrated |",
             "|---|---:|---:|---:|"]
    for label, fields, expected_ms in MANIFEST_FIGURES:
        step = StepBatch(*(jnp.float32(x) for x in fields))
        cells = []
        for calibration in (profile, Calibration()):
            params = build_roofline_params(resolve_model("llama-2-7b"), A100, 1, calibration)
            params = dataclasses.replace(params, lm_head_weight_bytes=jnp.float32(0),
                                         lm_head_flops_per_seq=jnp.float32(0), lm_head_io_bytes_per_seq=jnp.float32(0))
            ms = 1e3 * float(step_time_s(params, step) - host_overhead_s(params.calibration, step))
            cells.append(f"{ms:.1f} ms ({100 * (ms / expected_ms - 1):+.0f}%)")
        lines.append(f"| {label} | {expected_ms} ms | {cells[0]} | {cells[1]} |")
    return lines


def kv_capacity_check(shared: Path) -> list[str]:
    lines = ["| model | TP | DistServe max_num_tokens | servetune (utilization 0.9) | difference |",
             "|---|---:|---:|---:|---:|"]
    with open(shared / "profiles/distserve/max_num_tokens.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["pp"] != "1" or row["model"] == "facebook/opt-175b":
                continue
            model, tp = resolve_model(row["model"]), int(row["tp"])
            try:
                ours = kv_capacity(model, A100, tp, 0.9, 16, 2048, 256).token_capacity
            except Exception:    # heads that do not split over this TP: DistServe shards differently
                continue
            theirs = int(row["max_num_tokens"])
            lines.append(f"| {model.name} | {tp} | {theirs:,} | {ours:,} | {100 * (ours / theirs - 1):+.1f}% |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the '## Cost models' section of this markdown file")
    args = parser.parse_args()
    shared = shared_data_dir()
    sections = [("### Speed", speed())]
    if shared is not None:
        sections += [("### Calibration accuracy (Llama-2-7B on A100, 5-fold by token count)",
                      calibration_accuracy(shared)),
                     ("### Cross-check on models the profile was not fitted on", cross_check(shared)),
                     ("### MANIFEST sanity figures", manifest_figures()),
                     ("### KV capacity vs DistServe", kv_capacity_check(shared))]
    body = "\n\n".join(f"{title}\n\n" + "\n".join(lines) for title, lines in sections)
    print(body)
    if args.write:
        write_section(args.write, body)
    return 0


def write_section(path: Path, body: str) -> None:
    intro = (f"Measured with `{COMMAND}` on this machine (2 CPU cores, JAX CPU). Numbers below are regenerated by "
             "that command; notes on them follow the tables.")
    replace_section(path, "## Cost models", f"{intro}\n\n{body}", NOTES_MARKER)


# Hand-written notes under this line in BENCHMARKS.md are kept when the tables are regenerated.
NOTES_MARKER = "<!-- notes (kept on regeneration) -->"

if __name__ == "__main__":
    sys.exit(main())
