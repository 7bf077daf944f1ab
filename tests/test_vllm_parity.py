"""vLLM parity: servetune's schedule is vLLM 0.33's own, checked against the recorded output of vLLM's real
V1 scheduler.

``tests/fixtures/vllm/`` holds workloads and the logs vLLM 0.33.0's ``Scheduler`` and ``AsyncScheduler`` wrote
for them (``benchmarks/vllm_parity.py record``, driven on a virtual clock with a linear step cost): every
batch's tokens per request, its preemptions and its clock, and each request's first-token and finish times.
The reference simulator must reproduce every step; the JAX engine every request's outcome (its float32 step
costs allow 1e-6 of the elapsed time). When vLLM itself is importable, a live test records fresh random
workloads on the spot; CI does not install it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import vllm_parity  # noqa: E402  (benchmarks/ is not a package)
import vllm_replay  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm"
ENGINE_TIME_REL = 1e-6


def _recorded(prefix: str = "") -> list[tuple[dict, dict]]:
    cases = json.loads((FIXTURES / f"{prefix}cases.json").read_text())
    logs = json.loads((FIXTURES / f"{prefix}logs.json").read_text())
    assert [c["name"] for c in cases] == [log["name"] for log in logs]
    return list(zip(cases, logs))


# A model whose every layer slides: vLLM's SlidingWindowManager frees the blocks behind each request's window.
SLIDING = _recorded("sliding_")
RECORDED = _recorded() + SLIDING


@pytest.mark.parametrize("case, log", RECORDED, ids=[case["name"] for case, _ in RECORDED])
def test_reference_schedules_every_step_as_vllm(case, log):
    differences = vllm_replay.schedule_differences(log, vllm_replay.replay_reference(case))
    assert not differences, f"{case['name']} {case['knobs']}:\n" + "\n".join(differences)


def test_engine_serves_every_request_as_vllm():
    failures = {}
    for case, log in RECORDED:
        if found := vllm_replay.outcome_differences(log, vllm_replay.replay_engine(case), ENGINE_TIME_REL):
            failures[case["name"]] = found[:3]
    assert not failures, "\n".join(f"{name}: {lines}" for name, lines in failures.items())


def test_recorded_cases_exercise_every_rule():
    """The fixtures keep covering what parity is about: both policies in both scheduling modes, the
    long-prefill threshold, preemption (also of a request scheduled earlier in the same step, under the
    priority policy), both admission modes, the watermark, a queue limit, chunked prefill off, and both of
    the API server's refusals."""
    def count(predicate) -> int:
        return sum(bool(predicate(case, log)) for case, log in RECORDED)

    def knob(name):
        return lambda case, _: case["knobs"][name]

    def preempted_after_scheduled(case, log):
        # A victim already given tokens earlier in the step shows as preempted with none scheduled for it.
        return case["knobs"]["policy"] == "priority" and any(
            set(step["preempted"]) - {req for req, _ in step["tokens"]} and step["tokens"] for step in log["steps"])

    coverage = {
        "fcfs async": count(lambda c, _: c["knobs"]["policy"] == "fcfs" and c["knobs"]["async_scheduling"]),
        "priority async": count(lambda c, _: c["knobs"]["policy"] == "priority" and c["knobs"]["async_scheduling"]),
        "fcfs sync": count(lambda c, _: c["knobs"]["policy"] == "fcfs" and not c["knobs"]["async_scheduling"]),
        "priority sync": count(lambda c, _: c["knobs"]["policy"] == "priority" and not c["knobs"]["async_scheduling"]),
        "threshold": count(knob("long_prefill_token_threshold")),
        "preemption": count(lambda _, log: any(step["preempted"] for step in log["steps"])),
        "priority preemption": count(preempted_after_scheduled),
        "full prompt not reserved": count(lambda c, _: not c["knobs"]["reserve_full_prompt"]),
        "watermark": count(knob("watermark")),
        "queue limit": count(lambda _, log: any(r["reject_reason"] == "queue_full" for r in log["requests"])),
        "chunked prefill off": count(lambda c, _: not c["knobs"]["enable_chunked_prefill"]),
        "prompt refused": count(lambda _, log: any(r["reject_reason"] == "max_model_len" for r in log["requests"])),
        "max_tokens cut": count(lambda c, log: any(
            r["status"] == "completed" and r["generated"] < o for (_, _, o, _), r in zip(c["requests"], log["requests"]))),
    }
    assert all(coverage.values()), coverage


def test_sliding_window_cases_exercise_the_window():
    """The sliding-window fixtures preempt under both policies in both scheduling modes, most in caches too small
    for one max_model_len request without the window; the others, replayed as full attention, part from vLLM,
    so the block release is what makes them agree."""
    modes = {(c["knobs"]["policy"], c["knobs"]["async_scheduling"]) for c, log in SLIDING
             if any(step["preempted"] for step in log["steps"])}
    assert modes == {("fcfs", False), ("fcfs", True), ("priority", False), ("priority", True)}

    def holds_a_whole_request(case):
        knobs = case["knobs"]
        return knobs["num_gpu_blocks"] - 1 >= -(-knobs["max_model_len"] // knobs["block_size"])

    assert sum(not holds_a_whole_request(c) for c, _ in SLIDING) > len(SLIDING) // 2
    for case, log in SLIDING:
        if holds_a_whole_request(case):
            full_attention = {**case, "knobs": {**case["knobs"], "sliding_window": 0}}
            assert vllm_replay.schedule_differences(log, vllm_replay.replay_reference(full_attention)), case["name"]


def test_vllm_live_scheduler_agrees_on_fresh_workloads(tmp_path):
    """vLLM's real scheduler, run now on workloads nobody recorded: skipped unless vllm is importable."""
    pytest.importorskip("vllm", reason="vllm is not installed (benchmarks/vllm_parity.py says how)")
    vllm_parity.write_tiny_model(str(tmp_path))
    vllm_parity.init_recorder(str(tmp_path))
    for index in range(8):
        case = vllm_parity.random_case(seed=99, index=index, max_requests=60)
        differences = vllm_replay.schedule_differences(vllm_parity.record_case(case),
                                                       vllm_replay.replay_reference(case))
        assert not differences, f"{case['name']} {case['knobs']}:\n" + "\n".join(differences)
