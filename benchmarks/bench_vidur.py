"""servetune against Vidur on one shared configuration (issue 16): the requests Vidur simulated, replayed.

    python benchmarks/bench_vidur.py [--requests N] [--variants] [--batches BATCHES.csv]

The fixture (results/experiments/vidur/, made by run_vidur.py there, whose ATTRIBUTION.md gives the Vidur commit and
command) holds every request of one Vidur run: CodeLlama-34B on two A100s (TP 2), Vidur's Sarathi scheduler with
512-token chunks and 128 seats, Azure conversation lengths, Poisson arrivals at 2.5 req/s. Those requests (same
arrivals, same lengths) are replayed through servetune's engine with the matching vLLM knobs (max_num_seqs 128,
max_num_batched_tokens 512, chunked prefill) and the shipped calibrated A100 profile, and the table compares
TTFT, TPOT and E2EL (p50, p99, mean) with the relative error (servetune - Vidur) / Vidur.

TPOT is vLLM's: (E2EL - TTFT) / (output tokens - 1), requests of one output token left out, on both sides (Vidur's
own decode metric divides by the output tokens, and is not used). Vidur emits a request's first token when its
prefill completes, as vLLM does, so TTFT is prefill completion - arrival there.

--variants replays the same requests under the changes that could explain a gap (Vidur's KV block count,
synchronous scheduling, no host time, no eager launches beyond vLLM's CUDA-graph capture size) and prints one
line of errors each; the last line is Vidur's step semantics (synchronous, no host time, every batch priced
alike) under servetune's GPU model. --batches prices the batches Vidur
priced (run_vidur.py's BATCHES.csv, too large to ship) with servetune's cost model, batch by batch.
"""
from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

import numpy as np

from servetune.paths import REPO_ROOT

FIXTURE = REPO_ROOT / "results" / "experiments" / "vidur" / "codellama34b_tp2_a100_sarathi_conv.csv"
PROFILE = REPO_ROOT / "cost_models" / "profiles" / "llama-2-7b_a100-80gb.json"
METRICS = ("ttft", "tpot", "e2el")
# The host terms of a profile; "no host time" sets them to the smallest value a profile accepts.
HOST_FIELDS = ("per_step_overhead_s", "per_request_overhead_s", "host_multi_gpu_overhead_s")
# The launch cost a step beyond vLLM's CUDA-graph capture size pays per kernel; "no eager launches" zeroes it so,
# as in Vidur, every batch is priced alike whatever its size.
EAGER_FIELDS = ("eager_launch_overhead_s",)


def read_fixture(path: Path = FIXTURE, limit: int | None = None) -> dict:
    """The fixture's columns as arrays (rows in arrival order), and its `# key: value` header lines."""
    header = {}
    with open(path, newline="") as f:
        lines = []
        for line in f:
            if line.startswith("#"):
                key, _, value = line[1:].partition(":")
                header[key.strip()] = value.strip()
            else:
                lines.append(line)
    rows = list(csv.DictReader(lines))[:limit]
    columns = {name: np.array([float(r[name]) if r[name] else np.nan for r in rows]) for name in rows[0]}
    for name in ("prompt_tokens", "output_tokens", "restarts"):
        columns[name] = columns[name].astype(np.int64)
    return {"header": header, **columns}


def tpot(ttft: np.ndarray, e2el: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """vLLM's TPOT per request; NaN for one-token answers, which have no inter-token time."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(output_tokens > 1, (e2el - ttft) / (output_tokens - 1), np.nan)


def _config_text(trace: Path, profile: Path, num_kv_blocks: int | None, async_scheduling: bool) -> str:
    config = {
        "model": "codellama-34b",
        "hardware": {"gpu": "a100-80gb", "tp": 2},
        "cost_model": {"kind": "calibrated", "profile": str(profile)},
        "workload": {"arrivals": {"kind": "trace", "path": str(trace), "format": "processed"},
                     "num_requests": None},
        "scheduler": {"policy": "continuous", "max_num_seqs": 128, "max_num_batched_tokens": 512,
                      "enable_chunked_prefill": True, "async_scheduling": async_scheduling,
                      **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {})},
    }
    return json.dumps(config)   # JSON is YAML


def replay(fixture: dict, *, num_kv_blocks: int | None = None, async_scheduling: bool = True,
           host_time: bool = True, eager_launches: bool = True) -> dict:
    """Replay the fixture's requests through servetune; per-request TTFT, TPOT, E2EL (s) in fixture order, and
    the run's engine figures."""
    from servetune.api import simulate

    folder = Path(tempfile.mkdtemp(prefix="bench_vidur_"))
    trace = folder / "requests.csv"
    with open(trace, "w") as f:
        f.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
        for a, p, o in zip(fixture["arrival_s"], fixture["prompt_tokens"], fixture["output_tokens"]):
            f.write(f"{float(a)!r},{p},{o}\n")
    profile = PROFILE
    removed = (() if host_time else HOST_FIELDS) + (() if eager_launches else EAGER_FIELDS)
    if removed:
        document = json.loads(PROFILE.read_text())
        document["calibration"].update(dict.fromkeys(removed, 1e-12))
        profile = folder / "profile.json"
        profile.write_text(json.dumps(document))
    config = folder / "config.yaml"
    config.write_text(_config_text(trace, profile, num_kv_blocks, async_scheduling))
    run = simulate(config)
    req = run.requests
    order = np.argsort(req["arrival_s"], kind="stable")
    assert len(order) == len(fixture["arrival_s"]), "every fixture request arrives"
    assert np.allclose(req["arrival_s"][order], fixture["arrival_s"]), "replayed in fixture order"
    first, finish, arrival = req["first_token_s"][order], req["finish_s"][order], req["arrival_s"][order]
    ttft, e2el = first - arrival, finish - arrival
    return {"ttft": ttft, "e2el": e2el, "tpot": tpot(ttft, e2el, fixture["output_tokens"]),
            "completed": int(np.sum(req["status"] == "completed")), "preemptions": run.metrics["preemptions"],
            "num_kv_blocks": run.config.scheduler.num_kv_blocks, "engine_steps": run.metrics["engine_steps"],
            "mean_batch_size": run.metrics["mean_batch_size"]}


def sarathi_replay(fixture: dict, *, host_time: bool = False, eager_launches: bool = True) -> dict:
    """The fixture's requests scheduled by Vidur's Sarathi rules, written here from its source (microsoft/vidur @
    7d47513, vidur/scheduler/replica_scheduler/sarathi_replica_scheduler.py, ``_get_next_batch`` lines 86-186), one
    batch at a time and synchronously (one stage: a batch starts when the last ends, base_replica_scheduler.py),
    each batch priced by servetune's cost model as ``replay`` builds it (TP 2, chunk 512, 128 seats): decodes of
    running requests first, then running prefills, then waiting requests in arrival order while the 512-token
    budget and the 128 seats last, each chunk min(prompt left, budget left). A second implementation of the
    schedule, so that ``replay``'s can be checked against it; KV capacity is not modelled (the fixture's run
    evicts nothing). Per-request TTFT, TPOT, E2EL (s) in fixture order, and the batch count."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from servetune.cost_models import roofline
    from servetune.cost_models.catalog import resolve_gpu, resolve_model
    from servetune.cost_models.profile import load_profile
    from servetune.types import StepBatch

    calibration, _ = load_profile(PROFILE)
    removed = (() if host_time else HOST_FIELDS) + (() if eager_launches else EAGER_FIELDS)
    calibration = dataclasses.replace(calibration, **{name: jnp.float32(1e-12) for name in removed})
    seats, budget = 128, 512
    capture = roofline.vllm_cudagraph_capture_size(seats, budget)
    params = roofline.build_roofline_params(resolve_model("codellama-34b"), resolve_gpu("a100-80gb"), 2, calibration,
                                            cudagraph_capture_size=capture)
    price = jax.jit(lambda batch: roofline.step_time_s(params, batch))
    arrival, prompt, output = fixture["arrival_s"], fixture["prompt_tokens"], fixture["output_tokens"]
    n = len(arrival)
    prefilled, generated = np.zeros(n, np.int64), np.zeros(n, np.int64)
    ttft, e2el = np.full(n, np.nan), np.full(n, np.nan)
    waiting, running = [], []
    clock, arrived, batches = 0.0, 0, 0
    while arrived < n or waiting or running:
        while arrived < n and arrival[arrived] <= clock:
            waiting.append(arrived)
            arrived += 1
        if not waiting and not running:
            clock = float(arrival[arrived])
            continue
        decodes = [r for r in running if prefilled[r] == prompt[r]]
        chunks, used = [], len(decodes)
        for r in running:
            if prefilled[r] < prompt[r] and used < budget:
                chunks.append((r, int(min(prompt[r] - prefilled[r], budget - used))))
                used += chunks[-1][1]
        while waiting and len(running) < seats and used < budget:
            r = waiting.pop(0)
            running.append(r)
            chunks.append((r, int(min(prompt[r], budget - used))))
            used += chunks[-1][1]
        q = np.array([c for _, c in chunks], dtype=np.float64)
        cached = np.array([prefilled[r] for r, _ in chunks], dtype=np.float64)
        attended = sum(float(prompt[r] + generated[r]) for r in decodes)   # its cached tokens and the new one
        shape = (len(chunks), q.sum(), (cached + q).sum(), (q * (cached + q / 2)).sum(), (q * q / 2).sum(),
                 len(decodes), attended)
        clock += float(price(StepBatch(*(jnp.float32(x) for x in shape))))
        batches += 1
        for r in decodes:
            generated[r] += 1
        for r, c in chunks:
            prefilled[r] += c
            if prefilled[r] == prompt[r]:
                generated[r], ttft[r] = 1, clock - arrival[r]   # the prefill's last chunk emits the first token
        for r in [r for r in running if prefilled[r] == prompt[r] and generated[r] >= output[r]]:
            e2el[r] = clock - arrival[r]
            running.remove(r)
    return {"ttft": ttft, "e2el": e2el, "tpot": tpot(ttft, e2el, output), "engine_steps": batches}


def vidur_metrics(fixture: dict) -> dict:
    return {"ttft": fixture["ttft_s"], "tpot": fixture["tpot_s"], "e2el": fixture["e2el_s"]}


def stats(values: np.ndarray) -> dict:
    values = values[np.isfinite(values)]
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "mean": float(np.mean(values))}


def errors(vidur: dict, ours: dict) -> dict:
    """(servetune - Vidur) / Vidur for every metric and statistic."""
    out = {}
    for metric in METRICS:
        v, o = stats(vidur[metric]), stats(ours[metric])
        out[metric] = {k: (o[k] - v[k]) / v[k] for k in v}
    return out


def table(vidur: dict, ours: dict) -> str:
    lines = ["| metric | stat | Vidur (ms) | servetune (ms) | error |", "|---|---|---:|---:|---:|"]
    err = errors(vidur, ours)
    for metric in METRICS:
        v, o = stats(vidur[metric]), stats(ours[metric])
        for k in ("p50", "p99", "mean"):
            lines.append(f"| {metric.upper()} | {k} | {v[k] * 1e3:,.1f} | {o[k] * 1e3:,.1f} | {err[metric][k]:+.1%} |")
    return "\n".join(lines)


def _error_line(name: str, vidur: dict, ours: dict) -> str:
    err = errors(vidur, ours)
    cells = " | ".join(f"{err[m][k]:+.1%}" for m in METRICS for k in ("p50", "p99"))
    blocks = "-" if ours["num_kv_blocks"] is None else f"{ours['num_kv_blocks']:,}"
    return f"| {name} | {cells} | {blocks} | {ours['preemptions']:,} |"


def price_batches(path: Path) -> str:
    """Vidur's batches priced by servetune's GPU model: the ratio servetune / Vidur per batch kind, total and by
    part (Vidur's parts are per layer; servetune's matmul and element-wise work are compared with the rest of
    Vidur's layer, and its GPU time includes the LM head, which Vidur does not price)."""
    import jax.numpy as jnp

    from servetune.cost_models import roofline
    from servetune.cost_models.catalog import resolve_gpu, resolve_model
    from servetune.cost_models.profile import load_profile
    from servetune.types import StepBatch

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    col = {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}
    calibration, _ = load_profile(PROFILE)
    if "prefill_causal_pairs" not in col:
        # a log from before run_vidur.py wrote the column: harmless while every pair is priced alike
        if float(calibration.attention_causal_pair_ratio) != 1.0:
            raise SystemExit(f"{path}: no prefill_causal_pairs column, which {PROFILE.name}'s "
                             f"attention_causal_pair_ratio {float(calibration.attention_causal_pair_ratio):g} needs: "
                             f"rerun results/experiments/vidur/run_vidur.py")
        col["prefill_causal_pairs"] = np.zeros(len(rows))
    model = resolve_model("codellama-34b", None, None, "auto")
    params = roofline.build_roofline_params(model, resolve_gpu("a100-80gb"), 2, calibration)
    batch = StepBatch(*(jnp.asarray(col[k], jnp.float32) for k in (
        "num_prefill_seqs", "prefill_tokens", "prefill_context_tokens", "prefill_attention_pairs",
        "prefill_causal_pairs", "num_decode_seqs", "decode_context_tokens")))
    costs = roofline.step_costs(params, batch)
    layers = model.num_layers
    ours = {"gpu": np.asarray(costs.gpu_s), "attention decode": np.asarray(costs.attention_decode_s),
            "attention prefill": np.asarray(costs.attention_prefill_s),
            "all-reduce": np.asarray(costs.communication_s),
            "rest": np.asarray(costs.gpu_s - costs.attention_decode_s - costs.attention_prefill_s
                               - costs.communication_s)}
    theirs = {"gpu": col["model_time_s"], "attention decode": col["attn_decode_ms"] * layers / 1e3,
              "attention prefill": col["attn_prefill_ms"] * layers / 1e3,
              "all-reduce": 2 * col["all_reduce_ms"] * layers / 1e3}
    theirs["rest"] = theirs["gpu"] - theirs["attention decode"] - theirs["attention prefill"] - theirs["all-reduce"]
    kinds = {"decode only": col["num_prefill_seqs"] == 0, "with a prefill chunk": col["num_prefill_seqs"] > 0,
             "all": np.ones(len(rows), bool)}
    lines = ["| batches | count | Vidur mean step (ms) | " + " | ".join(f"{p} ratio" for p in ours) + " |",
             "|---|---:|---:|" + "---:|" * len(ours)]
    for name, mask in kinds.items():
        cells = []
        for part in ours:
            t = theirs[part][mask].sum()
            cells.append(f"{ours[part][mask].sum() / t:.3f}" if t > 0 else "-")
        lines.append(f"| {name} | {mask.sum():,} | {theirs['gpu'][mask].mean() * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--variants", action="store_true", help="also replay the candidate causes of a gap")
    parser.add_argument("--batches", type=Path, default=None, help="run_vidur.py's BATCHES.csv to price")
    args = parser.parse_args()
    fixture = read_fixture(args.fixture, args.requests)
    vidur = vidur_metrics(fixture)
    n = len(fixture["arrival_s"])
    print(f"{n:,} requests from {args.fixture.name} ({fixture['header'].get('vidur', 'Vidur')}); "
          f"Vidur KV blocks {fixture['header'].get('vidur_num_blocks', '?')}")
    ours = replay(fixture)
    print(f"servetune: {ours['completed']:,} completed, {ours['preemptions']:,} preemptions, "
          f"{ours['num_kv_blocks']:,} KV blocks, {ours['engine_steps']:,} steps, mean batch {ours['mean_batch_size']:.1f}")
    print(table(vidur, ours))
    if args.variants:
        vidur_blocks = int(float(fixture["header"]["vidur_num_blocks"]))
        variants = [("servetune as configured (async, derived KV)", {}),
                    ("Vidur's KV block count", {"num_kv_blocks": vidur_blocks}),
                    ("synchronous scheduling", {"async_scheduling": False}),
                    ("synchronous, no host time", {"async_scheduling": False, "host_time": False}),
                    ("no eager launches", {"eager_launches": False}),
                    ("synchronous, no host time, no eager launches (Vidur's step)",
                     {"async_scheduling": False, "host_time": False, "eager_launches": False})]
        print()
        print("| replay | " + " | ".join(f"{m.upper()} {k}" for m in METRICS for k in ("p50", "p99"))
              + " | KV blocks | preemptions |")
        print("|---|" + "---:|" * (2 * len(METRICS) + 2))
        for name, kwargs in variants:
            print(_error_line(name, vidur, ours if not kwargs else replay(fixture, **kwargs)))
        # the same schedule written a second time, from Vidur's source: equal to the synchronous, no-host line
        sarathi = sarathi_replay(fixture)
        print(_error_line(f"Vidur's Sarathi rules in Python ({sarathi['engine_steps']:,} batches), synchronous, "
                          f"no host time", vidur, {**sarathi, "num_kv_blocks": None, "preemptions": 0}))
    if args.batches is not None:
        print()
        print(price_batches(args.batches))


if __name__ == "__main__":
    main()
