"""Cross-checks of the shipped profiles on data they were not fitted on, and of ``calibrate --steps``.

    python benchmarks/bench_calibration.py [--shared ../shared/data] [--models all|quick]

Prints markdown tables (step-time MAPE, worst error):

1. Cross-GPU: every shipped profile, and the uncalibrated roofline, on each GPU's Vidur steps. A100 steps are
   whole GPU steps (the layers' measured operators plus the measured attention kernel, as ``calibrate``
   assembles them); H100 has no attention measurement, so its steps are the layers' operators and embedding
   without attention (``layer_step``). A100 layer steps are shown too, for a like-for-like comparison.
2. ``calibrate --steps`` on half: for each model the profiles were not fitted on, the steps of one GPU split in
   two by step shape (2-fold), the profile of that GPU refitted on one half and judged on the other (the
   ``calibrate_steps`` code path), next to the uncalibrated roofline and the shipped profile.
3. ``calibrate --steps`` on half of DistServe's whole-step fits (OPT-13B and OPT-66B on A100 at TP 1-8, under
   the 2023 vLLM and under DistServe's engine), judged on the other half. The 2023 vLLM (v0.2.3) chose between
   paged attention V1 and V2 per step, so its fits search the split-KV threshold (docs/cost-models.md,
   "Split-KV decode attention"); the table gives it in decode requests (the threshold over the query heads).
Needs the Vidur data under ``--shared`` (default: ``servetune.paths.shared_data_dir()``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from servetune.cost_models import calibrate as cal
from servetune.cost_models.calibrate_steps import FROM_ROWS, calibrate_dataset
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.profile import load_profile, shipped_profile_for
from servetune.cost_models.roofline import Calibration
from servetune.paths import shared_data_dir

GPUS = {"a100": "a100-80gb", "h100": "h100-80gb"}
# Vidur models on both GPUs, with the TP degree their steps are assembled at (the smallest that fits 80 GB).
MODELS = [("meta-llama/Llama-2-7b-hf", 1), ("microsoft/phi-2", 1), ("internlm/internlm-20b", 1),
          ("codellama/CodeLlama-34b-Instruct-hf", 2), ("meta-llama/Llama-2-70b-hf", 2)]
FITTED_ON = "meta-llama/Llama-2-7b-hf"


def _errors(datasets: list[cal.Dataset], calibration: Calibration, gpu) -> dict:
    measured = np.concatenate([d.measured_s for d in datasets])
    predicted = np.concatenate([np.asarray(cal.predict(d, calibration.as_float32(), gpu)) for d in datasets])
    return cal.error_summary(measured, predicted)


def _cell(errors: dict) -> str:
    return f"{errors['mape_pct']:.2f}% ({errors['worst_pct']:+.0f}%)"


def steps_of(vidur: Path, gpu_key: str, model_id: str, tp: int, with_attention: bool) -> list[cal.Dataset]:
    gpu = resolve_gpu(GPUS[gpu_key])
    _, raw = cal.load_vidur_operators(vidur / "compute" / gpu_key / model_id)
    layers = resolve_model(model_id).num_layers
    if with_attention:
        _, attention_raw = cal.load_vidur_attention(vidur / "attention_legacy" / gpu_key / "attention.csv")
        return cal.assemble_vidur_steps(raw, attention_raw, layers, gpu, tp)
    return cal.assemble_layer_steps(raw, layers, gpu, tp)


def cross_gpu(vidur: Path, profiles: dict[str, Calibration], models) -> list[str]:
    names = list(profiles)
    lines = ["| GPU | steps of | TP | steps | rows | uncalibrated | " + " | ".join(f"{n} profile" for n in names) + " |",
             "|---|---|---:|---|---:|---:|" + "---:|" * len(names)]
    for gpu_key in GPUS:
        gpu = resolve_gpu(GPUS[gpu_key])
        kinds = [("whole (attention measured)", True), ("layers, no attention", False)] if gpu_key == "a100" \
            else [("layers, no attention", False)]
        for model_id, tp in models:
            if not (vidur / "compute" / gpu_key / model_id / "mlp.csv").exists():
                continue
            for label, with_attention in kinds:
                steps = steps_of(vidur, gpu_key, model_id, tp, with_attention)
                cells = [_cell(_errors(steps, calibration, gpu)) for calibration in profiles.values()]
                rows = sum(len(d.measured_s) for d in steps)
                lines.append(f"| {gpu_key.upper()} | {model_id} | {tp} | {label} | {rows} | "
                             f"{_cell(_errors(steps, Calibration(), gpu))} | " + " | ".join(cells) + " |")
    return lines


def steps_on_half(vidur: Path, profiles: dict[str, Calibration], models) -> list[str]:
    lines = ["| GPU | steps of | TP | steps | rows | uncalibrated | shipped profile | after --steps on half "
             "(held out) | decode / prefill held out | token tile |", "|---|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for gpu_key in GPUS:
        gpu = resolve_gpu(GPUS[gpu_key])
        initial = profiles[gpu_key]
        with_attention = gpu_key == "a100"
        for model_id, tp in models:
            if model_id == FITTED_ON or not (vidur / "compute" / gpu_key / model_id / "mlp.csv").exists():
                continue
            steps = steps_of(vidur, gpu_key, model_id, tp, with_attention)
            whole = steps[0] if len(steps) == 1 else _concatenate(steps)
            prefill = np.asarray(whole.features["batch"].prefill_tokens) > 0
            kinds = np.where(prefill, "prefill-only", "decode-only")
            result = calibrate_dataset(whole, kinds, gpu, initial, folds=2, label=model_id)
            by_kind = result.report["batch_kinds"]
            split = " / ".join(f"{by_kind[k]['held_out']['mape_pct']:.2f}%" for k in ("decode-only", "prefill-only")
                               if k in by_kind)
            label = "whole" if with_attention else "layers, no attention"
            lines.append(f"| {gpu_key.upper()} | {model_id} | {tp} | {label} | {len(kinds)} | "
                         f"{_cell(by_kind['all']['uncalibrated'])} | {_cell(by_kind['all']['initial'])} | "
                         f"**{_cell(by_kind['all']['held_out'])}** | {split} | {result.report['matmul_token_tile']} |")
    return lines


def distserve_on_half(shared: Path, profiles: dict[str, Calibration]) -> list[str]:
    """``calibrate --steps`` on half of DistServe's whole-step fits (A100, OPT-13B/66B), one fit per TP degree as
    a user's steps CSV holds one (``--tp``); the held-out predictions of every degree judged together."""
    lines = ["| steps of | engine | TP | rows | uncalibrated | shipped profile | after --steps on half (held out) | "
             "decode / prefill held out | token tile by TP | split-KV up to (decodes) by TP |",
             "|---|---|---|---:|---:|---:|---:|---|---|---|"]
    gpu = resolve_gpu(GPUS["a100"])
    for engine in ("vllm", "distserve"):
        path = shared / "profiles" / "distserve" / f"profiler-a100-80g.{engine}.json"
        for steps in cal.load_distserve_steps(path, gpu):
            tp = 1 + np.asarray(steps.features["params"].allreduce_ring_steps) / 2
            prefill = np.asarray(steps.features["batch"].prefill_tokens) > 0
            kinds = np.where(prefill, "prefill-only", "decode-only")
            held_out, tiles, split_kv = np.full(len(tp), np.nan), [], []
            query_heads = np.asarray(steps.features["params"].attention_query_heads)
            heads = {degree: float(query_heads[tp == degree][0]) for degree in np.unique(tp)}
            for degree in np.unique(tp):
                rows = tp == degree
                result = calibrate_dataset(steps.subset(rows), kinds[rows], gpu, profiles["a100"], folds=2,
                                           label=f"{steps.name} TP {degree:.0f}",
                                           split_kv_thresholds=FROM_ROWS if engine == "vllm" else None)
                held_out[rows] = result.held_out_s
                tiles.append(str(result.report["matmul_token_tile"]))
                split_kv.append(f"{result.report['split_kv_max_work'] / heads[degree]:.0f}")
            predictions = {"held_out": held_out,
                           "uncalibrated": np.asarray(cal.predict(steps, Calibration().as_float32(), gpu)),
                           "initial": np.asarray(cal.predict(steps, profiles["a100"].as_float32(), gpu))}
            by_kind = {kind: {label: cal.error_summary(steps.measured_s[mask], predicted[mask])
                              for label, predicted in predictions.items()}
                       for kind, mask in (("all", kinds == kinds), ("decode-only", ~prefill), ("prefill-only", prefill))}
            degrees = ", ".join(f"{degree:.0f}" for degree in np.unique(tp))
            lines.append(f"| {steps.name[5:]} | {engine} | {degrees} | {len(kinds)} | "
                         f"{_cell(by_kind['all']['uncalibrated'])} | {_cell(by_kind['all']['initial'])} | "
                         f"**{_cell(by_kind['all']['held_out'])}** | {by_kind['decode-only']['held_out']['mape_pct']:.2f}%"
                         f" / {by_kind['prefill-only']['held_out']['mape_pct']:.2f}% | {', '.join(tiles)} | "
                         f"{', '.join(split_kv) if engine == 'vllm' else 'not searched'} |")
    return lines


def _concatenate(datasets: list[cal.Dataset]) -> cal.Dataset:
    import jax

    def join(*leaves):
        arrays = [np.broadcast_to(np.asarray(leaf, dtype=np.float64), (len(d.measured_s),))
                  for leaf, d in zip(leaves, datasets)]
        return np.concatenate(arrays)

    features = jax.tree_util.tree_map(join, *[d.features for d in datasets])
    return cal.Dataset(name="steps", kind=datasets[0].kind, measured_s=np.concatenate([d.measured_s for d in datasets]),
                       fold_key=np.concatenate([d.fold_key for d in datasets]), features=features)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=shared_data_dir())
    parser.add_argument("--models", choices=("all", "quick"), default="all")
    args = parser.parse_args(argv)
    if args.shared is None or not (args.shared / "profiles" / "vidur").is_dir():
        parser.error("no Vidur data: give --shared (the folder holding profiles/vidur)")
    vidur = args.shared / "profiles" / "vidur"
    profiles = {key: load_profile(shipped_profile_for(name))[0] for key, name in GPUS.items()
                if shipped_profile_for(name) is not None}
    models = MODELS if args.models == "all" else MODELS[:2]
    print("### Shipped profiles across GPUs (step-time MAPE, worst in brackets)\n")
    print("\n".join(cross_gpu(vidur, profiles, models)))
    print("\n### calibrate --steps on half of each model's steps, judged on the other half (2-fold by shape)\n")
    print("\n".join(steps_on_half(vidur, profiles, models)))
    print("\n### calibrate --steps on half of DistServe's whole-step fits (A100; one fit per TP, 2-fold by token "
          "count)\n")
    print("\n".join(distserve_on_half(args.shared, profiles)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
