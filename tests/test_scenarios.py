"""The shipped scenarios load, simulate with every request accounted for, and exercise what each is for."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servetune.config_loader import load_config
from servetune.envs.workload.requests import build_workload
from servetune.pipeline import simulate_config

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"
SHORT = ["workload.num_requests=400"]


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_scenario_runs_with_every_request_accounted_for(path):
    report = simulate_config(load_config(path, SHORT))
    m = report.metrics
    assert m["completed"] + m["rejected"] + m["unfinished"] == m["arrived"] == 400
    assert m["completed"] > 0


def test_rag_scenario_reuses_its_document_prefixes():
    """30 document sets of 6,000 tokens among 400 questions: most prompts are mostly cached, and the cache
    is what keeps TTFT low."""
    cached = simulate_config(load_config(SCENARIOS / "long_context_rag.yaml", SHORT)).metrics
    uncached = simulate_config(load_config(SCENARIOS / "long_context_rag.yaml",
                                           SHORT + ["scheduler.enable_prefix_caching=false"])).metrics
    assert cached["prefix_cache_hit_rate"] > 0.5
    assert uncached["prefix_cache_hit_rate"] is None
    assert cached["mean_ttft_ms"] < 0.5 * uncached["mean_ttft_ms"]


def test_multi_tenant_scenario_reports_each_tenant_against_its_class_slo():
    report = simulate_config(load_config(SCENARIOS / "multi_tenant_api.yaml", SHORT))
    tenants = report.segments["tenant"]
    assert set(tenants) == {"batch", "product", "startup"}
    assert tenants["batch"]["ttft_slo_ms"] == 30000 and tenants["product"]["ttft_slo_ms"] == 1500
    assert sum(segment["arrived"] for segment in tenants.values()) == 400


def test_agent_scenario_calls_arrive_a_tool_run_after_their_predecessors_finish():
    """Sessions of 5 calls, each arriving 0.5-3 s after the previous one finished; prompts carry the history."""
    report = simulate_config(load_config(SCENARIOS / "agent_tool_calls.yaml", SHORT))
    r, workload = report.outcome.requests, report.workload
    follows = workload.think_s > 0
    assert follows.sum() == 400 - 400 // 5
    waited = r.arrival_s[follows] - np.roll(r.finish_s, 1)[follows]
    assert np.all((waited >= 0.5 - 1e-6) & (waited <= 3.0 + 1e-6))
    assert np.all(workload.prompt_tokens[follows] > np.roll(workload.prompt_tokens, 1)[follows])


def test_the_diurnal_day_changes_its_mix_of_work_from_reasoning_at_night_to_chat():
    # examples/diurnal.yaml merges two ServeGen clients, each on its own day: the DeepSeek-R1 client sends
    # only from 00:00 to 07:00 (its trace's windows after 25,200 s are empty), played 120x faster: before
    # 210 s. Its answers are long and its prompts short, the chat client's the other way round.
    config = load_config(SCENARIOS.parent / "diurnal.yaml")
    workload = build_workload(config.workload)
    chat, reasoning = (workload.tenant == workload.tenant_names.index(name) for name in ("chat", "reasoning"))
    assert chat.any() and reasoning.any() and not (chat & reasoning).any() and (chat | reasoning).all()
    assert workload.arrival_s[reasoning].max() < 25_200 / 120 < workload.arrival_s[chat].max()
    assert np.median(workload.output_tokens[reasoning]) > 2 * np.median(workload.output_tokens[chat])
    assert np.median(workload.prompt_tokens[reasoning]) < np.median(workload.prompt_tokens[chat]) / 4
