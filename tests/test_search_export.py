"""Exports: every file parses back to the chosen knobs, vLLM's keys and rules hold, knobs an engine cannot
express are warned about, and values an engine would refuse are refused."""
from __future__ import annotations

import argparse
import dataclasses
import shlex

import optuna
import pytest
import yaml

from search_configs import study_config
from servetune.config_loader import load_config
from servetune.cost_models.factory import derive_num_kv_blocks
from servetune.errors import UserError
from servetune.pipeline import resolve
from servetune.search import cli as search_cli
from servetune.search.evaluate import use_persistent_compilation_cache
from servetune.search.export import Policy, export
from servetune.search.provenance import config_hash
from servetune.search.study import run_study

optuna.logging.set_verbosity(optuna.logging.WARNING)

# vLLM 0.33's accepted keys, typed from ../shared/reference/engines.md (not imported from the exporter).
VLLM_033_KEYS = {"max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill", "long-prefill-token-threshold",
                 "scheduling-policy", "max-num-queued-reqs", "max-num-queued-tokens", "watermark", "block-size",
                 "gpu-memory-utilization", "enable-prefix-caching", "max-model-len"}
VLLM_REMOVED = {"max-num-partial-prefills", "max-long-partial-prefills", "preemption-mode", "swap-space"}


def _config(*overrides):
    return resolve(load_config("examples/chat.yaml", list(overrides)))


def _policy(*overrides, blocks_given=True):
    return Policy(_config(*overrides), kv_blocks_given=blocks_given)


def _vllm_rules_hold(keys: dict) -> None:
    assert set(keys) <= VLLM_033_KEYS and not set(keys) & VLLM_REMOVED
    assert keys["max-num-batched-tokens"] >= keys["max-num-seqs"]
    if not keys["enable-chunked-prefill"]:
        assert keys["max-num-batched-tokens"] >= keys["max-model-len"]
    assert 0 <= keys.get("watermark", 0) < 1
    assert 0 < keys["gpu-memory-utilization"] <= 1


@pytest.mark.parametrize("overrides", [
    (),
    ("scheduler.enable_chunked_prefill=false", "scheduler.max_num_batched_tokens=4096"),
    ("scheduler.long_prefill_token_threshold=256", "scheduler.watermark=0.01", "scheduler.max_num_queued_reqs=100"),
])
def test_vllm_file_parses_back_with_only_033_keys_and_its_rules_holding(overrides):
    policy = _policy(*overrides)
    keys = yaml.safe_load(export(policy, "vllm").text)
    _vllm_rules_hold(keys)
    s = policy.config.scheduler
    assert keys["max-num-seqs"] == s.max_num_seqs
    assert keys["max-num-batched-tokens"] == s.max_num_batched_tokens
    assert keys["enable-chunked-prefill"] == s.enable_chunked_prefill
    assert keys.get("long-prefill-token-threshold", 0) == s.long_prefill_token_threshold
    assert keys.get("watermark", 0.0) == s.watermark
    assert keys.get("max-num-queued-reqs") == s.max_num_queued_reqs
    assert keys["scheduling-policy"] == "fcfs"


def test_a_block_count_becomes_the_smallest_memory_share_that_holds_it():
    config = _config()   # chat.yaml gives 8,192 blocks
    share = yaml.safe_load(export(Policy(config, kv_blocks_given=True), "vllm").text)["gpu-memory-utilization"]

    def blocks(utilization):
        hardware = dataclasses.replace(config.hardware, gpu_memory_utilization=utilization)
        return derive_num_kv_blocks(dataclasses.replace(config, hardware=hardware))

    assert blocks(share) >= 8192 > blocks(round(share - 0.001, 3))
    derived = resolve(load_config("examples/chat.yaml", ["scheduler.num_kv_blocks=null"]))
    kept = yaml.safe_load(export(Policy(derived, kv_blocks_given=False), "vllm").text)
    assert kept["gpu-memory-utilization"] == 0.92


@pytest.mark.parametrize("overrides,message", [
    (("scheduler.max_num_seqs=512", "scheduler.max_num_batched_tokens=256"),
     "vllm: max-num-batched-tokens 256 < max-num-seqs 512; vLLM requires max-num-batched-tokens ≥ max-num-seqs"),
    (("scheduler.num_kv_blocks=100000",),
     "scheduler.num_kv_blocks: got 100000, expected at most"),
])
def test_a_knob_outside_the_engines_range_is_refused(overrides, message):
    with pytest.raises(UserError) as error:
        export(_policy(*overrides), "vllm")
    assert message in str(error.value)


def test_tgi_refuses_a_prefill_budget_larger_than_the_kv_cache():
    with pytest.raises(UserError, match="--max-batch-prefill-tokens 16384 > --max-batch-total-tokens 8000"):
        export(_policy("scheduler.num_kv_blocks=500", "scheduler.max_num_batched_tokens=16384"), "tgi")


def test_every_engine_file_parses_back_to_the_knobs():
    policy = _policy("scheduler.max_num_seqs=48", "scheduler.max_num_batched_tokens=1024",
                     "scheduler.max_num_queued_reqs=200")
    sglang = yaml.safe_load(export(policy, "sglang").text)
    assert (sglang["max-running-requests"], sglang["chunked-prefill-size"], sglang["max-queued-requests"]) == \
        (48, 1024, 200)
    trtllm = yaml.safe_load(export(policy, "trtllm").text)
    assert (trtllm["max_batch_size"], trtllm["max_num_tokens"], trtllm["enable_chunked_prefill"]) == (48, 1024, True)
    assert trtllm["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION"
    words = shlex.split(" ".join(line for line in export(policy, "tgi").text.splitlines() if not line.startswith("#")))
    tgi = dict(zip(words[::2], words[1::2]))
    assert tgi == {"--max-batch-size": "48", "--max-batch-prefill-tokens": "1024",
                   "--max-batch-total-tokens": str(8192 * 16), "--max-concurrent-requests": "248"}
    own = yaml.safe_load(export(policy, "servetune").text)
    assert own["scheduler"] == dataclasses.asdict(policy.config.scheduler)
    static = yaml.safe_load(export(_policy("scheduler.policy=static", "scheduler.batch_size=24"), "trtllm").text)
    assert static["scheduler_config"]["capacity_scheduler_policy"] == "STATIC_BATCH"
    assert static["max_batch_size"] == 24
    unchunked = yaml.safe_load(export(_policy("scheduler.enable_chunked_prefill=false",
                                              "scheduler.max_num_batched_tokens=4096"), "sglang").text)
    assert unchunked["chunked-prefill-size"] == -1


def test_knobs_an_engine_cannot_express_are_warned_about_in_the_result_and_the_file():
    policy = _policy("scheduler.long_prefill_token_threshold=256", "scheduler.watermark=0.05")
    sglang = export(policy, "sglang")
    assert "sglang cannot express scheduler.long_prefill_token_threshold=256" in sglang.warnings
    assert "sglang cannot express scheduler.watermark=0.05" in sglang.warnings
    assert "# warning: sglang cannot express scheduler.watermark=0.05" in sglang.text
    assert not [w for w in export(policy, "vllm").warnings if "long_prefill" in w or "watermark" in w]
    static = export(_policy("scheduler.policy=static", "scheduler.max_wait_s=0.5"), "vllm")
    assert "vllm cannot express scheduler.policy=static" in static.warnings
    assert "vllm cannot express scheduler.max_wait_s=0.5" in static.warnings
    assert "trtllm cannot express scheduler.policy=static" not in export(
        _policy("scheduler.policy=static"), "trtllm").warnings


def test_priority_direction_is_stated_per_engine():
    assert "# request priority: lower value served first" in export(_policy(), "vllm").text
    assert "# request priority: higher value served first" in export(_policy(), "sglang").text


def test_export_from_a_study_through_the_command_line(tmp_path):
    use_persistent_compilation_cache()
    config = study_config(trials=4, sampler="random", batch_size=4, workload_seeds=[1, 2])
    storage = str(tmp_path / "s.db")
    study = run_study(config, "exp", storage, show_progress=False)
    parser = argparse.ArgumentParser()
    search_cli.register(parser.add_subparsers())
    best = max(study.trials, key=lambda t: t.value)
    for engine in ("vllm", "servetune"):
        out = tmp_path / f"exp.{engine}.yaml"
        args = parser.parse_args(["export", "--study", "exp", "--storage", storage, "--engine", engine,
                                  "--out", str(out)])
        assert args.func(args) == 0
        document = yaml.safe_load(out.read_text())
        if engine == "vllm":
            _vllm_rules_hold(document)
            assert document["max-num-seqs"] == best.params["scheduler.max_num_seqs"]
        else:
            assert document["provenance"]["trial"] == best.number
            assert document["provenance"]["config_hash"] == config_hash(config)
            assert document["predicted"]["request_goodput"] == best.value
            assert document["spread"]["request_goodput"]["runs"] == 2
            assert document["scheduler"]["max_num_batched_tokens"] == \
                best.params["scheduler.max_num_batched_tokens"]
    missing = parser.parse_args(["export", "--study", "nope", "--storage", storage])
    with pytest.raises(UserError, match="--study nope: no such study"):
        missing.func(missing)


def test_a_context_capped_by_the_budget_is_warned_about():
    """Without chunked prefill vLLM needs max-model-len <= the budget; capping the deployed context must
    not pass silently."""
    capped = export(_policy("scheduler.enable_chunked_prefill=false", "scheduler.max_num_batched_tokens=4096"), "vllm")
    assert yaml.safe_load(capped.text)["max-model-len"] == 4096
    assert any("max-model-len" in w and "4096" in w for w in capped.warnings)
    assert "# warning: vllm: max-model-len" in capped.text
    assert not any("max-model-len" in w for w in export(_policy(), "vllm").warnings)


def test_queue_orders_and_prefix_caching_map_to_each_engine_or_are_warned():
    priority = _policy("scheduler.queue_order=priority", "scheduler.enable_prefix_caching=true")
    vllm = yaml.safe_load(export(priority, "vllm").text)
    assert vllm["scheduling-policy"] == "priority" and vllm["enable-prefix-caching"] is True
    sglang_export = export(priority, "sglang")
    sglang = yaml.safe_load(sglang_export.text)
    assert sglang["schedule-policy"] == "priority" and sglang["schedule-low-priority-values-first"] is True
    assert sglang["disable-radix-cache"] is False
    assert "# request priority: lower value served first" in sglang_export.text
    assert yaml.safe_load(export(priority, "trtllm").text)["kv_cache_config"] == {"enable_block_reuse": True}
    # vLLM caches prefixes by default: a simulation without the cache says so explicitly.
    assert yaml.safe_load(export(_policy(), "vllm").text)["enable-prefix-caching"] is False
    fair = export(_policy("scheduler.queue_order=fair"), "vllm")
    assert any("cannot express scheduler.queue_order=fair" in w for w in fair.warnings)
    assert yaml.safe_load(fair.text)["scheduling-policy"] == "fcfs"
