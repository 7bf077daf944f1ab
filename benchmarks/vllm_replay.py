"""Replay a case recorded from vLLM's real scheduler (benchmarks/vllm_parity.py) through servetune, and compare.

A case is a workload, scheduler knobs named as vLLM names them, and a linear step cost (base + per scheduled
token). ``replay_reference`` serves it with servetune's reference simulator and writes the schedule in the
recorder's log format; ``schedule_differences`` lists where two logs part. ``replay_engine`` serves many cases
with the JAX engine, for the per-request comparison (first-token and finish times, preemptions).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from servetune.config import SchedulerConfig
from servetune.cost_models.linear import LinearCostParams, step_time_s
from servetune.envs.sim.outcome import REJECT_NAMES, STATUS_NAMES, SimulationOutcome
from servetune.envs.sim.reference import simulate_reference_detailed
from servetune.envs.workload.requests import Workload

TIME_REL = 1e-9   # float64 sums taken in different orders


def workload_of(case: dict) -> Workload:
    rows = np.asarray(case["requests"], dtype=np.float64).reshape(-1, 4)
    return Workload(arrival_s=rows[:, 0].copy(), prompt_tokens=rows[:, 1].astype(np.int64),
                    output_tokens=rows[:, 2].astype(np.int64), priority=rows[:, 3].astype(np.int64))


# Knobs servetune names as vLLM does; the case's num_gpu_blocks and policy are num_kv_blocks and queue_order.
SAME_NAMES = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
              "block_size", "watermark", "max_num_queued_reqs", "max_model_len", "async_scheduling",
              "reserve_full_prompt")


def scheduler_of(case: dict) -> SchedulerConfig:
    knobs = case["knobs"]
    # Cases recorded before sliding windows have no such knob: full attention.
    return SchedulerConfig(**{name: knobs[name] for name in SAME_NAMES}, num_kv_blocks=knobs["num_gpu_blocks"],
                           queue_order=knobs["policy"], sliding_window=knobs.get("sliding_window", 0))


def cost_of(case: dict) -> LinearCostParams:
    return LinearCostParams(base_s=float(case["cost"]["base_s"]), per_token_s=float(case["cost"]["per_token_s"]),
                            per_context_token_s=0.0)


def requests_log(outcome: SimulationOutcome) -> list[dict]:
    r = outcome.requests

    def time(x):
        return None if math.isnan(x) else float(x)

    return [{"status": STATUS_NAMES[int(r.status[i])], "reject_reason": REJECT_NAMES[int(r.reject_reason[i])] or None,
             "first_token_s": time(r.first_token_s[i]), "finish_s": time(r.finish_s[i]),
             "preemptions": int(r.preemptions[i]), "generated": int(r.generated_tokens[i])}
            for i in range(len(r.status))]


def replay_reference(case: dict) -> dict:
    """The case served by the reference simulator, as a log in the recorder's format."""
    outcome, _, _, steps = simulate_reference_detailed(workload_of(case), scheduler_of(case), step_time_s,
                                                       cost_of(case))
    return {"name": case["name"],
            "steps": [{"start_s": s.start_s, "end_s": s.end_s, "tokens": [list(t) for t in s.tokens],
                       "preempted": list(s.preempted)} for s in steps],
            "requests": requests_log(outcome)}


def _close(a: Optional[float], b: Optional[float], rel: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def schedule_differences(vllm: dict, servetune: dict, limit: int = 3) -> list[str]:
    """Where servetune's log parts from vLLM's: the first steps that differ (clock, tokens per request,
    preempted set), then per-request outcomes. Empty when they agree."""
    found: list[str] = []
    steps_v, steps_s = vllm["steps"], servetune["steps"]
    for k, (v, s) in enumerate(zip(steps_v, steps_s)):
        same_tokens = [tuple(t) for t in v["tokens"]] == [tuple(t) for t in s["tokens"]]
        same_clock = not v["tokens"] or (_close(v["start_s"], s["start_s"], TIME_REL)
                                         and _close(v["end_s"], s["end_s"], TIME_REL))
        if not (same_tokens and same_clock and sorted(v["preempted"]) == sorted(s["preempted"])):
            found.append(f"step {k}: vLLM {v} / servetune {s}")
            if len(found) >= limit:
                return found
    if len(steps_v) != len(steps_s):
        found.append(f"{len(steps_v)} steps in vLLM's log, {len(steps_s)} in servetune's")
    for i, (v, s) in enumerate(zip(vllm["requests"], servetune["requests"])):
        same = (v["status"] == s["status"] and v["reject_reason"] == s["reject_reason"]
                and v["preemptions"] == s["preemptions"] and v["generated"] == s["generated"]
                and _close(v["first_token_s"], s["first_token_s"], TIME_REL)
                and _close(v["finish_s"], s["finish_s"], TIME_REL))
        if not same:
            found.append(f"request {i}: vLLM {v} / servetune {s}")
            if len(found) >= limit:
                break
    return found


# The engine compiles once per table shape, so every case runs on one: requests padded to a power of two
# (at least 64) with ones that would arrive after a horizon no case reaches, 64 slots (vLLM's cases run at
# most 64 seats) and a queue pool as long as the workload.
PAD_ARRIVAL_S = 2e9
PAD_HORIZON_S = 1e9
SLOTS = 64


def _padded(workload: Workload) -> Workload:
    n = workload.num_requests
    pad = max(64, 1 << (n - 1).bit_length()) - n
    return Workload(arrival_s=np.concatenate([workload.arrival_s, np.full(pad, PAD_ARRIVAL_S)]),
                    prompt_tokens=np.concatenate([workload.prompt_tokens, np.ones(pad, np.int64)]),
                    output_tokens=np.concatenate([workload.output_tokens, np.ones(pad, np.int64)]),
                    priority=np.concatenate([workload.priority, np.zeros(pad, np.int64)]))


def replay_engine(case: dict) -> list[dict]:
    """The case served by the JAX engine: per-request outcomes in the recorder's format."""
    from servetune.envs.sim import engine
    from servetune.envs.sim.simulator import device_trace, engine_params, iteration_guard, outcome_from_state

    workload, scheduler = workload_of(case), scheduler_of(case)
    if scheduler.max_num_seqs > SLOTS:
        raise ValueError(f"{case['name']}: max_num_seqs {scheduler.max_num_seqs} > the replay's {SLOTS} slots")
    padded = _padded(workload)
    params = engine_params(scheduler, cost_of(case), PAD_HORIZON_S, iteration_guard(padded))
    shape = None if scheduler.queue_order == "fcfs" else engine.QueueShape(padded.num_requests, 1)
    state = engine.run_jit(device_trace(padded), params, step_time_s, SLOTS, shape)
    return requests_log(outcome_from_state(padded, state, PAD_HORIZON_S))[:workload.num_requests]


def outcome_differences(vllm: dict, requests: list[dict], rel: float) -> list[str]:
    """Requests whose outcome differs from vLLM's: status, reason, tokens and preemptions exactly, first-token
    and finish times within ``rel`` of the time since the first arrival."""
    origin = vllm["requests"] and min((s["start_s"] for s in vllm["steps"]), default=0.0)
    found = []
    for i, (v, s) in enumerate(zip(vllm["requests"], requests)):
        same = all(v[key] == s[key] for key in ("status", "reject_reason", "preemptions", "generated"))
        for key in ("first_token_s", "finish_s"):
            a, b = v[key], s[key]
            same &= (a is None and b is None) or (a is not None and b is not None
                                                  and abs(a - b) <= rel * max(abs(a - origin), 1e-3))
        if not same:
            found.append(f"request {i}: vLLM {v} / servetune {s}")
    return found
