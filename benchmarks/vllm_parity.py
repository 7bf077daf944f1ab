"""Ground truth for servetune's scheduler model: random workloads replayed through vLLM 0.33.0's real scheduler.

Three subcommands:

* ``cases``  -- random workloads (knobs, a linear step-cost model and a request list), deterministic in
  (seed, case index): case ``i`` of seed ``s`` is the same whatever ``--count`` is.
* ``record`` -- drives vLLM's own ``Scheduler`` / ``AsyncScheduler`` on a CPU, with no GPU and no model, on a
  virtual clock, and writes one log per case: every scheduled batch (when it was scheduled, when it ran, how
  many tokens of which request) and every request's fate. It runs in vLLM's venv, which has no servetune, so
  neither ``cases`` nor ``record`` imports servetune.
* ``compare`` -- servetune's reference simulator (step for step) and JAX engine (per request) against the
  logs; it needs servetune, not vLLM.

Install vLLM in a venv of its own (about 9 GB, about 12 minutes)::

    python -m venv /path/venv && /path/venv/bin/pip install vllm==0.33.0

Commands (the 1,000-case set stays out of the repository; the fixtures are in tests/fixtures/vllm/)::

    python benchmarks/vllm_parity.py cases --count 1000 --seed 0 --out /work/parity/cases-1000.json
    /path/venv/bin/python benchmarks/vllm_parity.py record --cases /work/parity/cases-1000.json \\
        --out /work/parity/logs-1000.json --jobs 2
    python benchmarks/vllm_parity.py cases --count 40 --seed 1 --max-requests 40 --edge-cases \\
        --out tests/fixtures/vllm/cases.json
    /path/venv/bin/python benchmarks/vllm_parity.py record --cases tests/fixtures/vllm/cases.json \\
        --out tests/fixtures/vllm/logs.json --jobs 2

Sliding windows (a tiny Mistral-shaped config.json with ``sliding_window``: vLLM gives its layer a
``SlidingWindowSpec`` and the scheduler one ``SlidingWindowManager``; the recorder builds that group itself).
The fixture is eight of the 300 cases, chosen for short logs that cover both policies in both modes with
preemptions::

    python benchmarks/vllm_parity.py cases --count 300 --seed 3 --sliding-window --out /work/parity/swa-300.json
    /path/venv/bin/python benchmarks/vllm_parity.py record --cases /work/parity/swa-300.json \\
        --out /work/parity/swa-300-logs.json
    python benchmarks/vllm_parity.py cases --indices 22,8,6,74,0,20,31,53 --seed 3 --sliding-window \\
        --out tests/fixtures/vllm/sliding_cases.json
    /path/venv/bin/python benchmarks/vllm_parity.py record --cases tests/fixtures/vllm/sliding_cases.json \\
        --out tests/fixtures/vllm/sliding_logs.json

How the recorder stands in for vLLM's engine (file:line refer to the installed vllm 0.33.0 package):

* The scheduler is built as ``EngineCore.__init__`` builds it (v1/engine/core.py:165-180): a ``VllmConfig`` from
  a tiny Llama ``config.json`` (``skip_tokenizer_init``, no weights), a ``KVCacheConfig`` with one
  ``FullAttentionSpec`` group -- a ``SlidingWindowSpec`` one for a case with ``sliding_window``, as
  ``get_kv_cache_groups`` (v1/core/kv_cache_planning.py:1113) groups a model whose every layer slides -- of
  ``num_gpu_blocks`` blocks (``cache_config.num_gpu_blocks`` set as
  core.py:335 sets it), prefix caching off, no stats. The CPU platform switches async scheduling off
  (platforms/cpu.py:346-348), so the knob is put back after the config is built; on a GPU it stays on. The
  KV watermark is ``SchedulerConfig.watermark`` (config/scheduler.py:196-201), which the scheduler hands to
  the ``KVCacheManager`` (v1/core/sched/scheduler.py:366, kv_cache_manager.py:210).
* Admission in front of the engine, as vLLM's API server does it: a prompt of max_model_len tokens or more
  is refused ("max_model_len"; v1/engine/input_processor.py:574-603), and max_tokens is cut to
  max_model_len - prompt (entrypoints/serve/utils/api_utils.py:248-262); with ``max_num_queued_reqs`` set, a
  request that would make (requests added and not yet reported finished) + 1 > max_num_queued_reqs is
  rejected ("queue_full"; 503 at v1/engine/async_llm.py:351-369, which counts the front end's unfinished
  requests).
* Arrivals with arrival_s <= t are added at the top of every engine-loop iteration, i.e. before every
  ``step()`` / ``step_with_batch_queue()`` call (``run_busy_loop``, core.py:1621-1632, drains the input queue
  before each step). When the scheduler has no requests and no batch is in flight the engine blocks on its
  input queue (core.py:1647-1676); the clock jumps to the next arrival.
* The "GPU" is serial with zero host time: a batch launched at t starts at max(t, end of the previous
  launched batch) and ends at start + (base_s + per_token_s * total_num_scheduled_tokens), evaluated in
  that order in float64. A batch that scheduled no tokens costs nothing: it starts and ends at max(t, end
  of the previous batch), like every batch it queues behind earlier work. In the sync loop nothing is in
  flight, so that is t; in the async loop the batch queue is FIFO, so by the time an empty batch is waited
  for the batch before it has been waited for and the clock is already past its end -- so ending it at t
  instead would give the same times.
* The fake model runner: a scheduled request samples one token unless, right after ``schedule()``, it is a
  non-final prefill chunk (``request.is_prefill_chunk``, set by ``_update_after_schedule``,
  scheduler.py:1863-1865; the GPU runner discards those samples, v1/worker/gpu_model_runner.py:2060-2065).
  This is captured at launch because later ``schedule()`` calls change the request. ``update_from_output``
  is called when the batch is waited for, with t = max(t, batch end); the tokens it reports are emitted,
  and the requests it reports finished finish, at that time. Under async scheduling a request preempted
  while its batch is in flight still gets that batch's token (scheduler.py:1825-1835), as on a GPU.
* Sync = ``EngineCore.step`` (core.py:667-697): if the scheduler has requests, schedule, run, wait,
  ``update_from_output``. After the last request finishes one more (empty) step runs, because
  ``has_requests()`` stays true while finished ids wait to be sent to the workers (scheduler.py:3157-3182).
* Async = ``EngineCore.step_with_batch_queue`` (core.py:708-822) with a batch queue of 2
  (``max_concurrent_batches``, config/vllm.py:588-598): if the scheduler has requests, schedule and push the
  batch -- even an empty one -- to the front of the queue, and return without waiting if the queue is not
  full and (the batch has tokens or the scheduler still has requests); otherwise pop the oldest batch and
  wait for it.
* The engine spins (core.py:1693-1694 sleeps 1 ms per empty step) when the scheduler has unfinished
  requests but a step schedules nothing, preempts nothing and nothing with tokens is in flight. Nothing but
  an arrival can change that, so the clock jumps to the next arrival; with none left the run stops and the
  remaining requests are logged "unfinished".
* The model runner is vLLM's V1 runner here (no Triton on this CPU) where a GPU would pick V2
  (config/vllm.py:731-766); with one pipeline stage the scheduler's V2-only branches schedule the same
  tokens (``next_decode_eligible_step`` is always reached, scheduler.py:816 and async_scheduler.py:52-56).

Hand check (one request at t=0: P=32, O=3, token budget 2048, base 0.01 s, 0.001 s per token). Sync: batches
[0, 0.042) with 32 tokens, [0.042, 0.053) and [0.053, 0.064) with 1 token each, so tokens at 0.042, 0.053
and 0.064, finish 0.064, each batch scheduled when the previous one ended. Async gives the same token times,
but each batch is scheduled one batch early: the prefill and the first decode are both scheduled at t=0 (the
decode as a placeholder, queued behind the prefill: [0.042, 0.053)), the second decode at 0.042 when the
prefill is waited for ([0.053, 0.064)); at 0.053 the scheduler sees the last token in flight and schedules
nothing (scheduler.py:800-814). With zero host time the overlap buys nothing, so the times agree. (In the
logs 0.053 is 0.053000000000000005, i.e. 0.042 + 0.011 in float64.)

Log format (one per case, same order as the cases)::

    {"name", "vllm_version",
     "steps": [{"schedule_s", "start_s", "end_s", "tokens": [[req, n], ...], "preempted": [req, ...]}, ...],
     "requests": [{"status": "completed"|"rejected"|"unfinished", "reject_reason": "max_model_len"|"queue_full"|None,
                   "first_token_s", "finish_s", "preemptions", "generated"}, ...]}

``steps`` has every batch that scheduled tokens, plus empty ones that preempted something; ``tokens`` is in
``SchedulerOutput.num_scheduled_tokens`` order; ``preempted`` (sorted) are the requests preempted by that
``schedule()`` call. Times are float64 seconds on the workload's clock, written with ``repr`` precision.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VLLM_VERSION = "0.33.0"

# --------------------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------------------


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniformly spread (the +1 lets hi itself come up)."""
    return min(hi, int(_log_uniform(rng, lo, hi + 1)))


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, cap: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), 1, cap).astype(int)


def random_case(seed: int, index: int, max_requests: int = 300) -> dict:
    """Case ``index`` of ``seed``; its own generator, so a case does not depend on how many come before it."""
    rng = np.random.default_rng([seed, index])
    n = _log_uniform_int(rng, 4, max_requests)

    # Each case gets its own length distribution, so the set spans short chat turns to long documents.
    prompts = _lognormal_lengths(rng, n, _log_uniform(rng, 8, 600), rng.uniform(0.3, 1.2), 2000)
    outputs = _lognormal_lengths(rng, n, _log_uniform(rng, 2, 120), rng.uniform(0.3, 1.2), 300)

    # max_model_len fits every request drawn so far, sometimes exactly (prompt + output == max_model_len is
    # allowed); then about 5% of the requests get a prompt that pushes them past it: refused when the prompt
    # alone reaches it, their max_tokens cut to fit otherwise.
    slack = 0 if rng.random() < 0.3 else int(rng.integers(1, 129))
    max_model_len = int((prompts + outputs).max()) + slack
    too_long = rng.random(n) < 0.05
    prompts = np.where(too_long, max_model_len - outputs + rng.integers(1, 65, n), prompts)
    admitted_lengths = (prompts + outputs)[~too_long]

    block_size = int(rng.choice([16, 8, 32], p=[0.8, 0.1, 0.1]))
    max_num_seqs = _log_uniform_int(rng, 1, 64)
    enable_chunked_prefill = bool(rng.random() >= 0.1)
    max_num_batched_tokens = max(_log_uniform_int(rng, 16, 4096), max_num_seqs)
    if not enable_chunked_prefill:
        # vLLM refuses max_num_batched_tokens < max_model_len without chunked prefill (config/scheduler.py:318-328).
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    threshold = min(_log_uniform_int(rng, 1, 1024), max_model_len) if rng.random() < 0.4 else 0

    # KV from "one max_model_len request and nothing else" (N-1 usable blocks, block 0 is vLLM's null block)
    # up to three times what all admitted requests need at once.
    fewest_blocks = math.ceil(max_model_len / block_size) + 1
    demand = int(sum(math.ceil(length / block_size) for length in admitted_lengths))
    num_gpu_blocks = int(round(_log_uniform(rng, fewest_blocks, max(fewest_blocks, 3 * demand) + 1)))

    knobs = {
        "policy": "priority" if rng.random() < 0.5 else "fcfs",
        "async_scheduling": bool(rng.random() < 0.5),
        "reserve_full_prompt": bool(rng.random() >= 0.15),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_chunked_prefill": enable_chunked_prefill,
        "long_prefill_token_threshold": threshold,
        "block_size": block_size,
        "num_gpu_blocks": num_gpu_blocks,
        "watermark": float(rng.uniform(0.01, 0.1)) if rng.random() < 0.2 else 0.0,
        "max_num_queued_reqs": _log_uniform_int(rng, 1, 2 * max_num_seqs + 16) if rng.random() < 0.15 else None,
        "max_model_len": max_model_len,
    }
    cost = {"base_s": _log_uniform(rng, 1e-3, 2e-2), "per_token_s": _log_uniform(rng, 1e-5, 2e-4)}

    # Offered load relative to a rough service rate: each request costs its tokens, and its decode steps
    # share the per-step base cost with up to max_num_seqs others.
    concurrency = min(max_num_seqs, n)
    work_s = cost["per_token_s"] * (prompts + outputs) + cost["base_s"] * outputs / concurrency
    rate = _log_uniform(rng, 0.05, 10.0) / float(work_s.mean())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))  # full-precision float64, on no grid
    priorities = rng.integers(0, 4, n)

    requests = [[float(a), int(p), int(o), int(q)] for a, p, o, q in zip(arrivals, prompts, outputs, priorities)]
    return {"name": f"rand-{seed}-{index}", "knobs": knobs, "cost": cost, "requests": requests}


def _knobs(**overrides) -> dict:
    knobs = {
        "policy": "fcfs", "async_scheduling": False, "reserve_full_prompt": True, "max_num_seqs": 16,
        "max_num_batched_tokens": 2048, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
        "block_size": 16, "num_gpu_blocks": 1000, "watermark": 0.0, "max_num_queued_reqs": None,
        "max_model_len": 4096,
    }
    knobs.update(overrides)
    return knobs


def edge_cases() -> list[dict]:
    """Hand-made cases for paths that random workloads reach rarely."""
    def case(name, requests, off_grid=True, **knobs):
        # Step boundaries here fall on a 1e-3 s grid; an irrational nudge keeps every arrival clear of them.
        nudge = math.pi * 1e-6 if off_grid else 0.0
        return {"name": name, "knobs": _knobs(**knobs), "cost": {"base_s": 0.01, "per_token_s": 0.001},
                "requests": [[a + nudge, int(p), int(o), int(q)] for a, p, o, q in requests]}

    staggered = [(0.0013 + 0.0171 * i, 40 + 13 * i, 6 + i % 5, i % 4) for i in range(12)]
    return [
        # The docstring's hand check, in both loops.
        case("hand-single-sync", [(0.0, 32, 3, 0)], off_grid=False),
        case("hand-single-async", [(0.0, 32, 3, 0)], off_grid=False, async_scheduling=True),
        # Alone, a long prompt ignores the threshold (scheduler.py:753-763); once a second request arrives
        # mid-prefill, both are capped at it.
        case("edge-long-prompt-threshold", [(0.0001, 1500, 4, 0), (0.0207, 600, 4, 0)],
             max_num_batched_tokens=512, long_prefill_token_threshold=128),
        # A 61-token prompt is refused by max_model_len 60; 59 + 2 gets max_tokens cut to 1; 50 + 10 == 60 fits.
        case("edge-too-long", [(0.0011, 20, 5, 0), (0.0052, 61, 3, 0), (0.0093, 50, 10, 0), (0.0134, 59, 2, 0)],
             max_model_len=60, max_num_batched_tokens=64),
        # Prompts come in 32-token chunks and admission checks only the first chunk (reserve_full_prompt
        # off), so later chunks and decodes run out of blocks and preempt the newest running request.
        case("edge-kv-tight-preempt", [(0.0003 + 0.0041 * i, 70, 60, 0) for i in range(6)],
             reserve_full_prompt=False, num_gpu_blocks=14, max_model_len=200, max_num_batched_tokens=32),
        # A high-priority request arrives second; when its decode needs a block, the victim is the
        # low-priority request scheduled earlier in the same step (scheduler.py:930-975).
        case("edge-priority-preempt-scheduled", [(0.0002, 40, 40, 3), (0.0031, 40, 40, 0)],
             policy="priority", num_gpu_blocks=8, max_model_len=100, max_num_batched_tokens=128),
        # Ten arrivals within a few milliseconds into an engine that holds three at a time.
        case("edge-queue-limit", [(0.0005 + 0.00037 * i, 100, 20, 0) for i in range(10)],
             max_num_queued_reqs=3, max_num_seqs=2),
        # The watermark (5 of 52 blocks) holds back the 8th request, which fits without it, while something
        # runs; it does not apply when the engine is idle (kv_cache_manager.py:518-525).
        case("edge-watermark", [(0.0004 + 0.0023 * i, 90, 30, 0) for i in range(8)],
             watermark=0.1, num_gpu_blocks=52, max_model_len=256),
        # Without chunked prefill a prompt that does not fit the remaining budget waits for the next step.
        case("edge-no-chunked-prefill", [(0.0007 + 0.0009 * i, 150 + 40 * i, 8, 0) for i in range(8)],
             enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=512),
        # One slot and one-token outputs under async scheduling: the first sampled token is the last, so the
        # scheduler skips the step after it (scheduler.py:800-814).
        case("edge-async-one-token", [(0.0009 + 0.0019 * i, 1 + 29 * i, 1 + i % 2, 0) for i in range(8)],
             async_scheduling=True, max_num_seqs=1, max_num_batched_tokens=64),
        # Long idle gaps between requests: the clock jumps to each arrival.
        case("edge-idle-gaps", [(0.5 + 3.1 * i, 1 + 7 * i, 3, 0) for i in range(5)], async_scheduling=True),
        # A token budget equal to max_num_seqs: prefills crawl in 4-token chunks between decodes.
        case("edge-tiny-budget", staggered, policy="priority", max_num_seqs=4, max_num_batched_tokens=4,
             async_scheduling=True, num_gpu_blocks=40, max_model_len=256),
    ]


def sliding_window_case(seed: int, index: int, max_requests: int = 60) -> dict:
    """A random case whose every layer slides (``knobs["sliding_window"]``): a window of a few blocks (rarely a
    multiple of the block size), prompts and outputs well past it, and a KV cache tight enough that requests
    preempt each other, so the blocks the window frees decide who runs."""
    case = random_case(seed, index, max_requests)
    rng = np.random.default_rng([seed, index, 1])
    knobs = case["knobs"]
    block_size = int(rng.choice([16, 8, 4], p=[0.5, 0.3, 0.2]))
    window = int(rng.integers(2 * block_size, 8 * block_size + 1)) if rng.random() < 0.9 else 4 * block_size
    rows = case["requests"]
    prompts = window * rng.uniform(0.3, 6.0, len(rows))
    outputs = window * rng.uniform(0.2, 4.0, len(rows))
    max_model_len = int((prompts + outputs).max()) + 1
    knobs.update(block_size=block_size, sliding_window=window, max_model_len=max_model_len,
                 max_num_seqs=int(rng.integers(2, 17)))
    # A budget of the window's order keeps the admission cap (window + budgets in flight) well below a whole
    # request, so that a cache sized from the cap holds requests only because the window frees their blocks.
    budget = max(int(window * rng.uniform(0.25, 2.0)), knobs["max_num_seqs"])
    if not knobs["enable_chunked_prefill"]:
        budget = max(budget, max_model_len)   # config/scheduler.py:318-328, as in random_case
    knobs["max_num_batched_tokens"] = budget
    knobs["long_prefill_token_threshold"] = min(knobs["long_prefill_token_threshold"], max_model_len)
    # From what one request can hold at its peak (the admission cap's window and batches in flight) to a few
    # times that: a handful of requests at once.
    in_flight = (2 if knobs["async_scheduling"] else 1) * budget
    peak = -(-min(window - 1 + in_flight, max_model_len) // block_size) + 1
    knobs["num_gpu_blocks"] = int(peak + 1 + rng.integers(0, 2 * peak))
    knobs["max_num_queued_reqs"] = None
    # The lengths changed, so the load did: squeeze the arrivals, mostly into overload.
    squeeze = _log_uniform(rng, 0.02, 1.0)
    case["requests"] = [[a * squeeze, int(max(1, p)), int(max(1, o)), q]
                        for (a, _, _, q), p, o in zip(rows, prompts, outputs)]
    case["name"] = f"swa-{seed}-{index}"
    return case


def cmd_cases(args: argparse.Namespace) -> None:
    make = sliding_window_case if args.sliding_window else random_case
    indices = range(args.count) if args.indices is None else [int(i) for i in args.indices.split(",")]
    cases = [make(args.seed, i, args.max_requests) for i in indices]
    if args.edge_cases:
        cases += edge_cases()
    _write_json(args.out, cases)
    print(f"cases: wrote {len(cases)} cases to {args.out}", file=sys.stderr)


def _write_json(path: str, value) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f, separators=(",", ":"))  # floats go out as repr: they read back bit-identical


# --------------------------------------------------------------------------------------------------------------
# record (runs in vLLM's venv)
# --------------------------------------------------------------------------------------------------------------

SAMPLED_TOKEN_ID = 7  # any id: there is no EOS (ignore_eos, no tokenizer) and no stop tokens

# A Llama-shaped config.json: enough for ModelConfig to resolve an architecture; no weights are ever read.
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 1000,
    "max_position_embeddings": 1 << 20, "torch_dtype": "float32", "rms_norm_eps": 1e-6,
}

# Mistral-7B-v0.1's shape of config.json: a "sliding_window" on every layer, which vLLM reads
# (ModelConfig.get_sliding_window, config/model.py:1625-1627) and gives every attention layer, whose KV spec is then
# a SlidingWindowSpec (model_executor/layers/attention/attention.py:624-672): one group, SlidingWindowManager.
TINY_SLIDING_MODEL_CONFIG = {**TINY_MODEL_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}

_vllm = None  # the vLLM names the recorder uses, and the tiny model's folder: set by init_recorder()


def write_tiny_model(folder: str, sliding_window: int = 0) -> None:
    config = {**TINY_SLIDING_MODEL_CONFIG, "sliding_window": sliding_window} if sliding_window else TINY_MODEL_CONFIG
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _model_dir(sliding_window: int) -> str:
    """The tiny model's folder; one per window, written on first use, under init_recorder()'s folder."""
    if not sliding_window:
        return _vllm.model_dir
    folder = os.path.join(_vllm.model_dir, f"sliding-{sliding_window}")
    if not os.path.exists(folder):
        os.makedirs(folder, exist_ok=True)
        write_tiny_model(folder, sliding_window)
    return folder


def init_recorder(model_dir: str) -> None:
    """Import vLLM into this process and point it at a folder holding write_tiny_model()'s config."""
    global _vllm
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Config post-processing warns about CPU performance on every case; none of it matters here.
    for noisy in ("torch", "vllm"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import torch
    import vllm
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    if vllm.__version__ != VLLM_VERSION:
        raise SystemExit(f"record: needs vllm=={VLLM_VERSION}, found {vllm.__version__}")
    _vllm = argparse.Namespace(
        torch=torch, CacheConfig=CacheConfig, ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig,
        VllmConfig=VllmConfig, SamplingParams=SamplingParams, AsyncScheduler=AsyncScheduler, Scheduler=Scheduler,
        FullAttentionSpec=FullAttentionSpec, SlidingWindowSpec=SlidingWindowSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        ModelRunnerOutput=ModelRunnerOutput, Request=Request, StructuredOutputManager=StructuredOutputManager,
        model_dir=model_dir,
    )


def build_scheduler(knobs: dict):
    v = _vllm
    max_model_len = knobs["max_model_len"]
    window = knobs.get("sliding_window", 0)
    model_config = v.ModelConfig(model=_model_dir(window), skip_tokenizer_init=True, max_model_len=max_model_len,
                                 dtype="float32")
    scheduler_config = v.SchedulerConfig(
        max_model_len=max_model_len, is_encoder_decoder=False,
        max_num_seqs=knobs["max_num_seqs"], max_num_batched_tokens=knobs["max_num_batched_tokens"],
        enable_chunked_prefill=knobs["enable_chunked_prefill"],
        long_prefill_token_threshold=knobs["long_prefill_token_threshold"], policy=knobs["policy"],
        async_scheduling=knobs["async_scheduling"], scheduler_reserve_full_isl=knobs["reserve_full_prompt"],
        watermark=knobs["watermark"], max_num_queued_reqs=knobs["max_num_queued_reqs"],
    )
    cache_config = v.CacheConfig(block_size=knobs["block_size"], enable_prefix_caching=False)
    vllm_config = v.VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                               cache_config=cache_config)
    # The CPU platform turns async scheduling off (platforms/cpu.py:346-348); a GPU keeps it.
    vllm_config.scheduler_config.async_scheduling = knobs["async_scheduling"]
    vllm_config.cache_config.num_gpu_blocks = knobs["num_gpu_blocks"]
    _check_config(vllm_config, knobs)

    if window:
        # As the attention layer builds it for a window (attention.py:624-672), with the knob's block size.
        spec = v.SlidingWindowSpec(block_size=knobs["block_size"], num_kv_heads=1, head_size=64,
                                   dtype=v.torch.float32, sliding_window=window)
    else:
        spec = v.FullAttentionSpec(block_size=knobs["block_size"], num_kv_heads=1, head_size=64,
                                   dtype=v.torch.float32)
    kv_cache_config = v.KVCacheConfig(num_blocks=knobs["num_gpu_blocks"], kv_cache_tensors=[],
                                      kv_cache_groups=[v.KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    scheduler_cls = v.AsyncScheduler if knobs["async_scheduling"] else v.Scheduler
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                         structured_output_manager=v.StructuredOutputManager(vllm_config),
                         block_size=knobs["block_size"])


def _check_config(vllm_config, knobs: dict) -> None:
    """Fail loudly if vLLM's config post-processing changed a knob behind our back."""
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    seen = {
        "policy": sc.policy, "async_scheduling": sc.async_scheduling,
        "reserve_full_prompt": sc.scheduler_reserve_full_isl, "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens, "enable_chunked_prefill": sc.enable_chunked_prefill,
        "long_prefill_token_threshold": sc.long_prefill_token_threshold, "block_size": cc.block_size,
        "num_gpu_blocks": cc.num_gpu_blocks, "watermark": sc.watermark,
        "max_num_queued_reqs": sc.max_num_queued_reqs, "max_model_len": vllm_config.model_config.max_model_len,
        "sliding_window": vllm_config.model_config.get_sliding_window() or 0,
    }
    changed = {k: (knobs.get(k, 0), seen[k]) for k in seen if seen[k] != knobs.get(k, 0)}
    if changed or cc.enable_prefix_caching or vllm_config.max_concurrent_batches != (
            2 if knobs["async_scheduling"] else 1):
        raise RuntimeError(f"vLLM changed the config: {changed} (asked, got); "
                           f"prefix caching {cc.enable_prefix_caching}, "
                           f"batch queue {vllm_config.max_concurrent_batches}")


@dataclass
class Batch:
    """A launched SchedulerOutput and what the fake model runner will return for it."""
    scheduler_output: object
    sampling_ids: list  # request ids (str) that sample a token in this batch
    end_s: float

    @property
    def has_tokens(self) -> bool:
        return self.scheduler_output.total_num_scheduled_tokens > 0


class VirtualEngine:
    """One case on a virtual clock: vLLM's scheduler, a serial zero-host-time GPU, and the API server's
    admission rules in front (see the module docstring for where each rule comes from)."""

    BATCH_QUEUE_SIZE = 2  # max_concurrent_batches with async scheduling and one pipeline stage

    def __init__(self, case: dict):
        assert _vllm is not None, "call init_recorder() first"
        self.vllm = _vllm
        self.name = case["name"]
        self.knobs = case["knobs"]
        self.base_s = case["cost"]["base_s"]
        self.per_token_s = case["cost"]["per_token_s"]
        self.arrivals = case["requests"]
        self.scheduler = build_scheduler(self.knobs)

        self.t = 0.0
        self.gpu_free_s = 0.0  # end of the last launched batch
        self.next_arrival = 0  # index into self.arrivals
        self.num_added = 0
        self.num_finished = 0
        self.requests = {}  # request index -> vllm Request, kept after the scheduler drops finished ones
        self.steps = []
        n = len(self.arrivals)
        self.outcome = [{"status": "unfinished", "reject_reason": None, "first_token_s": None, "finish_s": None,
                         "preemptions": 0, "generated": 0} for _ in range(n)]
        total_tokens = sum(p + o for _, p, o, _ in self.arrivals)
        self.iterations_left = 100 * total_tokens + 1000

    # -- the API server ----------------------------------------------------------------------------------------

    def admit_due(self) -> None:
        queue_limit = self.knobs["max_num_queued_reqs"]
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival][0] <= self.t:
            index = self.next_arrival
            self.next_arrival += 1
            arrival_s, prompt, output, priority = self.arrivals[index]
            if prompt >= self.knobs["max_model_len"]:
                self._reject(index, "max_model_len")
            elif queue_limit is not None and (self.num_added - self.num_finished) + 1 > queue_limit:
                self._reject(index, "queue_full")
            else:
                request = self.vllm.Request(
                    request_id=str(index), prompt_token_ids=[index % 1000] * prompt,
                    sampling_params=self.vllm.SamplingParams(
                        max_tokens=min(output, self.knobs["max_model_len"] - prompt), ignore_eos=True),
                    pooling_params=None, arrival_time=arrival_s, priority=priority)
                self.requests[index] = request
                self.scheduler.add_request(request)
                self.num_added += 1

    def _reject(self, index: int, reason: str) -> None:
        self.outcome[index].update(status="rejected", reject_reason=reason)

    def jump_to_next_arrival(self) -> bool:
        """The engine idles until the next request comes; False if none will."""
        if self.next_arrival == len(self.arrivals):
            return False
        self.t = max(self.t, self.arrivals[self.next_arrival][0])
        return True

    # -- the engine core and the GPU ---------------------------------------------------------------------------

    def launch(self) -> Batch:
        schedule_s = self.t
        scheduler_output = self.scheduler.schedule()
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Captured now: the next schedule() moves is_prefill_chunk on.
        sampling_ids = [rid for rid in num_scheduled if not self.scheduler.requests[rid].is_prefill_chunk]
        start_s = max(self.t, self.gpu_free_s)
        total = scheduler_output.total_num_scheduled_tokens
        end_s = start_s + (self.base_s + self.per_token_s * total) if total > 0 else start_s
        self.gpu_free_s = end_s
        preempted = sorted(int(rid) for rid in scheduler_output.preempted_req_ids)
        if total > 0 or preempted:
            self.steps.append({"schedule_s": schedule_s, "start_s": start_s, "end_s": end_s,
                               "tokens": [[int(rid), n] for rid, n in num_scheduled.items()],
                               "preempted": preempted})
        return Batch(scheduler_output, sampling_ids, end_s)

    def wait(self, batch: Batch) -> None:
        self.t = max(self.t, batch.end_s)
        req_ids = list(batch.scheduler_output.num_scheduled_tokens)
        sampling = set(batch.sampling_ids)
        model_output = self.vllm.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[SAMPLED_TOKEN_ID] if rid in sampling else [] for rid in req_ids])
        engine_outputs = self.scheduler.update_from_output(batch.scheduler_output, model_output)
        for client_outputs in engine_outputs.values():
            for output in client_outputs.outputs:
                outcome = self.outcome[int(output.request_id)]
                if output.new_token_ids:
                    outcome["generated"] += len(output.new_token_ids)
                    if outcome["first_token_s"] is None:
                        outcome["first_token_s"] = self.t
                if output.finish_reason is not None:
                    outcome.update(status="completed", finish_s=self.t)
                    self.num_finished += 1

    def stalled(self, batch: Batch, in_flight) -> bool:
        """Nothing scheduled, nothing preempted, nothing with tokens in flight, yet requests remain: only an
        arrival can move the engine on."""
        return (not batch.has_tokens and not batch.scheduler_output.preempted_req_ids
                and not any(b.has_tokens for b in in_flight) and self.scheduler.has_unfinished_requests())

    def tick(self) -> None:
        self.iterations_left -= 1
        if self.iterations_left < 0:
            raise RuntimeError(f"{self.name}: no end after 100 x total tokens engine iterations")

    def run_sync(self) -> None:
        """EngineCore.step, core.py:667-697."""
        while True:
            self.tick()
            self.admit_due()
            if not self.scheduler.has_requests():
                if self.jump_to_next_arrival():
                    continue
                return
            batch = self.launch()
            self.wait(batch)
            if self.stalled(batch, ()) and not self.jump_to_next_arrival():
                return

    def run_async(self) -> None:
        """EngineCore.step_with_batch_queue, core.py:708-822, with a batch queue of 2."""
        batch_queue = deque()
        while True:
            self.tick()
            self.admit_due()
            if not self.scheduler.has_requests() and not batch_queue:
                if self.jump_to_next_arrival():
                    continue
                return
            if self.scheduler.has_requests():
                batch = self.launch()
                if self.stalled(batch, batch_queue) and not self.jump_to_next_arrival():
                    return
                batch_queue.appendleft(batch)
                if len(batch_queue) < self.BATCH_QUEUE_SIZE and (batch.has_tokens
                                                                 or self.scheduler.has_requests()):
                    continue
            self.wait(batch_queue.pop())

    def run(self) -> dict:
        if self.knobs["async_scheduling"]:
            self.run_async()
        else:
            self.run_sync()
        for index, request in self.requests.items():
            self.outcome[index]["preemptions"] = request.num_preemptions
            wanted = request.sampling_params.max_tokens
            if self.outcome[index]["status"] == "completed" and self.outcome[index]["generated"] != wanted:
                raise RuntimeError(f"{self.name}: request {index} finished with "
                                   f"{self.outcome[index]['generated']} of {wanted} tokens")
        return {"name": self.name, "vllm_version": VLLM_VERSION, "steps": self.steps, "requests": self.outcome}


def record_case(case: dict) -> dict:
    return VirtualEngine(case).run()


def cmd_record(args: argparse.Namespace) -> None:
    with open(args.cases) as f:
        cases = json.load(f)
    started = time.monotonic()
    logs = []

    def progress() -> None:
        done = len(logs)
        if done == len(cases) or done % max(1, len(cases) // 50) == 0:
            print(f"record: {done}/{len(cases)} cases, {time.monotonic() - started:.0f} s", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="vllm_parity_model_") as model_dir:
        write_tiny_model(model_dir)
        if args.jobs > 1:
            # spawn, not fork: workers import vLLM (and torch) themselves rather than inherit a half-started copy.
            with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=init_recorder,
                                                           initargs=(model_dir,)) as pool:
                for log in pool.imap(record_case, cases):
                    logs.append(log)
                    progress()
        else:
            init_recorder(model_dir)
            for case in cases:
                logs.append(record_case(case))
                progress()
    _write_json(args.out, logs)
    print(f"record: wrote {len(logs)} logs to {args.out} in {time.monotonic() - started:.0f} s", file=sys.stderr)


# --------------------------------------------------------------------------------------------------------------
# compare: servetune's simulators against the logs (needs servetune, not vLLM)
# --------------------------------------------------------------------------------------------------------------


def _kind(case: dict) -> str:
    knobs = case["knobs"]
    return (f"{knobs['policy']}, {'async' if knobs['async_scheduling'] else 'sync'}, "
            f"threshold {'on' if knobs['long_prefill_token_threshold'] else 'off'}")


def cmd_compare(args: argparse.Namespace) -> None:
    """Every case through servetune's reference (identical schedule every step: clock, tokens per request,
    preempted set) and its JAX engine (identical statuses, tokens and preemptions; first-token and finish
    times within --rel of the time since the first step), tallied by policy, scheduling mode and threshold."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_replay

    with open(args.cases) as f:
        cases = json.load(f)
    with open(args.logs) as f:
        logs = json.load(f)
    if [c["name"] for c in cases] != [log["name"] for log in logs]:
        raise SystemExit(f"compare: {args.logs} does not hold the logs of {args.cases}, in order")
    tally: dict[str, list[int]] = {}
    first_miss: dict[str, str] = {}
    steps = preemptions = 0
    started = time.monotonic()
    for done, (case, log) in enumerate(zip(cases, logs), 1):
        reference = vllm_replay.schedule_differences(log, vllm_replay.replay_reference(case))
        engine = vllm_replay.outcome_differences(log, vllm_replay.replay_engine(case), args.rel)
        row = tally.setdefault(_kind(case), [0, 0, 0])
        row[0] += 1
        row[1] += not reference
        row[2] += not engine
        steps += len(log["steps"])
        preemptions += sum(r["preemptions"] for r in log["requests"])
        for which, found in (("reference", reference), ("engine", engine)):
            if found and which not in first_miss:
                first_miss[which] = f"{case['name']}: {found[0][:400]}"
        print(f"\rcompare: {done}/{len(cases)} cases, {time.monotonic() - started:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    print(f"{len(cases)} cases, {steps:,} vLLM steps, {preemptions:,} preemptions")
    print(f"{'cases':<34} {'n':>5} {'reference identical':>20} {'engine identical':>17}")
    for kind in sorted(tally):
        n, ref, eng = tally[kind]
        print(f"{kind:<34} {n:>5} {ref:>12} ({ref / n:.0%}) {eng:>10} ({eng / n:.0%})")
    n, ref, eng = (sum(row[k] for row in tally.values()) for k in range(3))
    print(f"{'all':<34} {n:>5} {ref:>12} ({ref / n:.0%}) {eng:>10} ({eng / n:.0%})")
    for which, line in first_miss.items():
        print(f"first {which} difference: {line}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cases = sub.add_parser("cases", help="write random workloads")
    cases.add_argument("--count", type=int)
    cases.add_argument("--indices", help="these case indices (comma-separated) instead of the first --count")
    cases.add_argument("--seed", type=int, required=True)
    cases.add_argument("--max-requests", type=int, default=300, help="most requests in a case (at least 4)")
    cases.add_argument("--edge-cases", action="store_true", help="append the hand-made edge cases")
    cases.add_argument("--sliding-window", action="store_true",
                       help="cases of a model whose every layer slides (sliding_window_case)")
    cases.add_argument("--out", required=True)
    cases.set_defaults(func=cmd_cases)

    record = sub.add_parser("record", help="replay cases through vLLM's scheduler (run in vLLM's venv)")
    record.add_argument("--cases", required=True)
    record.add_argument("--out", required=True)
    record.add_argument("--jobs", type=int, default=1)
    record.set_defaults(func=cmd_record)

    compare = sub.add_parser("compare", help="servetune's reference and engine against recorded logs")
    compare.add_argument("--cases", required=True)
    compare.add_argument("--logs", required=True)
    compare.add_argument("--rel", type=float, default=1e-6,
                         help="engine: first-token and finish times agree within this fraction (float32 steps)")
    compare.set_defaults(func=cmd_compare)

    args = parser.parse_args(argv)
    if args.command == "cases" and (args.count is None) == (args.indices is None):
        parser.error("cases: give --count or --indices")
    args.func(args)


if __name__ == "__main__":
    main()
