"""Exports: every file parses back to the chosen knobs, vLLM's keys and rules hold, knobs an engine cannot
express are warned about, and values an engine would refuse are refused."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from search_configs import study_config
from servetune.config_loader import load_config
from servetune.cost_models.factory import derive_num_kv_blocks
from servetune.errors import ConfigError, UserError
from servetune.pipeline import resolve
from servetune.search import cli as search_cli
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.export import Policy, check_vllm, export
from servetune.search.provenance import config_hash
from servetune.search.study.optimize import run_study

optuna.logging.set_verbosity(optuna.logging.WARNING)

# vLLM 0.33's accepted keys, typed from ../shared/reference/engines.md and, for the last four, from vLLM 0.33's
# vllm/engine/arg_utils.py and vllm/config/parallel.py (ParallelConfig.tensor_parallel_size), not imported from the
# exporter.
VLLM_033_KEYS = {"max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill", "long-prefill-token-threshold",
                 "scheduling-policy", "max-num-queued-reqs", "max-num-queued-tokens", "watermark", "block-size",
                 "gpu-memory-utilization", "enable-prefix-caching", "max-model-len", "async-scheduling",
                 "scheduler-reserve-full-isl", "num-gpu-blocks-override", "tensor-parallel-size"}
VLLM_REMOVED = {"max-num-partial-prefills", "max-long-partial-prefills", "preemption-mode", "swap-space"}


def _config(*overrides):
    return resolve(load_config("examples/chat.yaml", list(overrides)))


def _policy(*overrides, blocks_given=True):
    return Policy(_config(*overrides), kv_blocks_given=blocks_given)


def _tgi_flags(text: str) -> dict:
    words = shlex.split(" ".join(line for line in text.splitlines() if not line.startswith("#")))
    return dict(zip(words[::2], words[1::2]))


def _vllm_rules_hold(keys: dict) -> None:
    assert set(keys) <= VLLM_033_KEYS and not set(keys) & VLLM_REMOVED
    assert keys["max-num-batched-tokens"] >= keys["max-num-seqs"]
    if not keys["enable-chunked-prefill"]:
        assert keys["max-num-batched-tokens"] >= keys["max-model-len"]
    if "max-model-len" in keys and "num-gpu-blocks-override" in keys:
        # The cache holds max-model-len in the blocks left beside vLLM's null block.
        assert -(-keys["max-model-len"] // keys["block-size"]) <= keys["num-gpu-blocks-override"] - 1
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
    assert "num-gpu-blocks-override" not in kept   # vLLM sizes the cache itself, as the simulation did


def test_a_given_block_count_is_pinned_as_vllms_block_count_null_block_included():
    # servetune's 8,192 blocks are vLLM's num_gpu_blocks: vLLM holds block 0 back (its null block), leaving
    # 8,191 usable in both, so the override is 8,192, not 8,191 or 8,193.
    keys = yaml.safe_load(export(_policy(), "vllm").text)
    assert keys["num-gpu-blocks-override"] == 8192


@pytest.mark.parametrize("overrides,fragments", [
    # Refused as the config resolves, before any file is written.
    (("scheduler.max_num_seqs=512", "scheduler.max_num_batched_tokens=256"),
     ["examples/chat.yaml: scheduler.max_num_batched_tokens: 256", "max_num_seqs 512"]),
    (("scheduler.num_kv_blocks=100000",),
     ["scheduler.num_kv_blocks: got 100000, expected at most"]),
])
def test_a_knob_outside_the_engines_range_is_refused(overrides, fragments):
    with pytest.raises(UserError) as error:
        export(_policy(*overrides), "vllm")
    for fragment in fragments:
        assert fragment in str(error.value)


def test_a_vllm_file_whose_cache_cannot_hold_max_model_len_is_refused():
    keys = {"max-num-seqs": 64, "max-num-batched-tokens": 2048, "enable-chunked-prefill": True, "block-size": 16,
            "gpu-memory-utilization": 0.9, "max-model-len": 4096, "num-gpu-blocks-override": 256}
    # 4,096 tokens need 4096 / 16 = 256 blocks; 256 leave 255 beside the null block, 257 leave 256.
    with pytest.raises(UserError, match="4096 tokens need 256 KV blocks of 16, but num_kv_blocks 256 leaves 255 "
                                        "usable"):
        check_vllm(keys, _config())
    check_vllm({**keys, "num-gpu-blocks-override": 257}, _config())


def test_a_vllm_file_is_read_back_with_the_cache_vllm_would_size_and_refused_if_it_cannot_start():
    # No block count pinned: vLLM sizes the cache from gpu-memory-utilization. Llama-2-7B's 12.6 GiB of weights
    # on a 24 GiB A10G at 0.6 leave under 2 GiB, fewer blocks than 4,096 tokens need.
    config = _config("hardware.gpu=a10g", "scheduler.num_kv_blocks=1000")
    keys = {"max-num-seqs": 64, "max-num-batched-tokens": 2048, "enable-chunked-prefill": True, "block-size": 16,
            "gpu-memory-utilization": 0.6, "max-model-len": 4096}
    small = dataclasses.replace(config, hardware=dataclasses.replace(config.hardware, gpu_memory_utilization=0.6))
    assert 1 < derive_num_kv_blocks(small) < 4096 // 16 + 1
    with pytest.raises(UserError, match="vllm: the exported file would not start vLLM: scheduler.max_model_len: 4096"):
        check_vllm(keys, config)
    check_vllm({**keys, "gpu-memory-utilization": 0.9}, config)
    # No max-model-len in the file: vLLM takes the model's context length, 4,096, and the same rule applies.
    with pytest.raises(UserError, match="scheduler.max_model_len: 4096"):
        check_vllm({key: value for key, value in keys.items() if key != "max-model-len"}, config)
    # vLLM's rule on the prefill cap, which the file must keep too.
    with pytest.raises(UserError, match="long_prefill_token_threshold: 8192 is above max_model_len 4096"):
        check_vllm({**keys, "gpu-memory-utilization": 0.9, "long-prefill-token-threshold": 8192}, config)


def test_max_model_len_beyond_the_models_context_length_is_refused_with_the_limit():
    # Llama-2-7B's config.json has max_position_embeddings 4,096; vLLM refuses a longer max_model_len
    # (vllm/config/model.py, _get_and_verify_max_len), and so would every engine.
    with pytest.raises(ConfigError, match="scheduler.max_model_len: got 5666, expected at most 4096"):
        _policy("scheduler.max_model_len=5666")   # refused as the config resolves, before any simulation
    # A policy whose knobs were changed after it resolved is still checked as each engine's file is written.
    config = _config()
    policy = Policy(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_model_len=5666)),
                    kv_blocks_given=True)
    for engine in ("vllm", "sglang", "trtllm", "tgi"):
        with pytest.raises(UserError, match="max_model_len 5666 is above llama-2-7b's context length 4096.*"
                                            "at most 4096"):
            export(policy, engine)
    with pytest.raises(UserError, match="vllm: max-model-len 5666 is above llama-2-7b's context length 4096"):
        check_vllm({**yaml.safe_load(export(_policy(), "vllm").text), "max-model-len": 5666}, _config())
    assert yaml.safe_load(export(_policy("scheduler.max_model_len=4096"), "vllm").text)["max-model-len"] == 4096


def test_tgi_refuses_a_prefill_budget_larger_than_the_kv_cache():
    # 500 blocks of 16 tokens, one of them vLLM's null block: 499 x 16 = 7,984 tokens for requests.
    with pytest.raises(UserError, match="--max-batch-prefill-tokens 16384 > --max-batch-total-tokens 7984"):
        export(_policy("scheduler.num_kv_blocks=500", "scheduler.max_num_batched_tokens=16384"), "tgi")


def test_every_engine_file_parses_back_to_the_knobs():
    policy = _policy("scheduler.max_num_seqs=48", "scheduler.max_num_batched_tokens=1024",
                     "scheduler.max_num_queued_reqs=200")
    sglang = yaml.safe_load(export(policy, "sglang").text)
    assert (sglang["max-running-requests"], sglang["chunked-prefill-size"]) == (48, 1024)
    trtllm = yaml.safe_load(export(policy, "trtllm").text)
    assert (trtllm["max_batch_size"], trtllm["max_num_tokens"], trtllm["enable_chunked_prefill"]) == (48, 1024, True)
    assert trtllm["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION"
    assert _tgi_flags(export(policy, "tgi").text) == {"--max-batch-size": "48", "--max-batch-prefill-tokens": "1024",
                   "--max-batch-total-tokens": str(8191 * 16), "--num-shard": "1", "--max-concurrent-requests": "200"}
    own = yaml.safe_load(export(policy, "servetune").text)
    assert own["scheduler"] == dataclasses.asdict(policy.config.scheduler)
    static = yaml.safe_load(export(_policy("scheduler.policy=static", "scheduler.batch_size=24"), "trtllm").text)
    assert static["scheduler_config"]["capacity_scheduler_policy"] == "STATIC_BATCH"
    assert static["max_batch_size"] == 24
    unchunked = yaml.safe_load(export(_policy("scheduler.enable_chunked_prefill=false",
                                              "scheduler.max_num_batched_tokens=4096"), "sglang").text)
    assert unchunked["chunked-prefill-size"] == -1


def test_tensor_parallelism_goes_to_every_engine_under_its_own_name():
    # The names, typed from each engine's source: vLLM's --tensor-parallel-size (vllm/config/parallel.py,
    # ParallelConfig.tensor_parallel_size), SGLang's --tp-size (python/sglang/srt/server_args.py; its --config
    # turns a key into --KEY), the LlmArgs field tensor_parallel_size that trtllm-serve's --tp_size sets and its
    # YAML overwrites (tensorrt_llm/commands/serve.py), TGI's --num-shard (text-generation-launcher's arguments).
    exported = {engine: export(_policy("hardware.tp=2"), engine) for engine in ("vllm", "sglang", "trtllm", "tgi")}
    vllm = yaml.safe_load(exported["vllm"].text)
    _vllm_rules_hold(vllm)
    assert vllm["tensor-parallel-size"] == 2
    assert yaml.safe_load(exported["sglang"].text)["tp-size"] == 2
    assert yaml.safe_load(exported["trtllm"].text)["tensor_parallel_size"] == 2
    assert _tgi_flags(exported["tgi"].text)["--num-shard"] == "2"
    for engine, file in exported.items():
        assert not [w for w in file.warnings if "hardware.tp" in w], (engine, file.warnings)
    # One GPU is the default of vLLM, SGLang and trtllm-serve (each of the sources above), so their files leave
    # it out; TGI shards over every GPU it can see unless --num-shard says otherwise, so its file always says.
    one = {engine: export(_policy(), engine).text for engine in ("vllm", "sglang", "trtllm", "tgi")}
    assert "tensor-parallel-size" not in yaml.safe_load(one["vllm"])
    assert "tp-size" not in yaml.safe_load(one["sglang"])
    assert "tensor_parallel_size" not in yaml.safe_load(one["trtllm"])
    assert _tgi_flags(one["tgi"])["--num-shard"] == "1"


def test_a_vllm_file_is_read_back_on_the_gpus_it_names():
    # Llama-2-70B's BF16 weights, 68.98e9 x 2 bytes = 128.5 GiB, fit four A100-80GBs (32.1 GiB each) but not one
    # (0.92 x 80 GiB = 73.6 GiB), so the file's tensor-parallel-size is what lets vLLM start at all.
    config = _config("model=llama-2-70b", "hardware.tp=4", "scheduler.num_kv_blocks=null")
    keys = yaml.safe_load(export(Policy(config, kv_blocks_given=False), "vllm").text)
    assert keys["tensor-parallel-size"] == 4
    check_vllm(keys, config)
    with pytest.raises(UserError, match="vllm: the exported file would not start vLLM: .*llama-2-70b at tp=1"):
        check_vllm({key: value for key, value in keys.items() if key != "tensor-parallel-size"}, config)


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


def test_a_full_attention_model_draws_no_sliding_window_warning():
    # Every engine reads the window from the model's config.json, so an unset window (full attention) is not a
    # knob an engine leaves out.
    for engine in ("vllm", "sglang", "trtllm", "tgi"):
        warnings = export(_policy(), engine).warnings
        assert not [w for w in warnings if "sliding_window" in w], (engine, warnings)


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
    best = max(study.get_trials(states=(TrialState.COMPLETE,)), key=lambda t: t.value)
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


def test_max_model_len_is_exported_as_resolved_and_an_unknown_one_is_warned_about(tmp_path):
    own = export(_policy("scheduler.max_model_len=2048", "workload.max_model_len=3000"), "vllm")
    assert yaml.safe_load(own.text)["max-model-len"] == 2048
    assert not any("max-model-len" in w for w in own.warnings)
    assert yaml.safe_load(export(_policy("workload.max_model_len=3000"), "vllm").text)["max-model-len"] == 3000
    assert yaml.safe_load(export(_policy(), "vllm").text)["max-model-len"] == 4096   # Llama-2-7B's context
    # A model whose config.json names no context length: the simulation took what chat.yaml's cache holds,
    # (8192 - 1) x 16 = 131,056 tokens, and the file leaves the key to vLLM, saying so.
    model = json.loads(Path("tests/fixtures/hf/llama-2-7b.json").read_text())
    del model["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(model))
    unknown = export(_policy(f"model={tmp_path / 'config.json'}"), "vllm")
    assert "max-model-len" not in yaml.safe_load(unknown.text)
    assert any("max-model-len" in w and "131056" in w for w in unknown.warnings)
    assert "# warning: vllm: max-model-len is left to vLLM" in unknown.text


def test_async_scheduling_and_full_prompt_reservation_are_said_either_way():
    keys = yaml.safe_load(export(_policy(), "vllm").text)
    assert (keys["async-scheduling"], keys["scheduler-reserve-full-isl"]) == (True, True)   # vLLM 0.33's defaults
    off = yaml.safe_load(export(_policy("scheduler.async_scheduling=false", "scheduler.reserve_full_prompt=false"),
                                "vllm").text)
    assert (off["async-scheduling"], off["scheduler-reserve-full-isl"]) == (False, False)
    static = yaml.safe_load(export(_policy("scheduler.policy=static"), "vllm").text)
    assert static["async-scheduling"] is False   # static batching was simulated synchronous


def test_other_engines_are_warned_only_of_settings_away_from_their_defaults():
    # At vLLM's scheduling defaults and the model's own context length (4,096) they lose nothing.
    assert not [w for w in export(_policy(), "sglang").warnings
                if "async_scheduling" in w or "reserve_full_prompt" in w or "max_model_len" in w]
    shorter = export(_policy("scheduler.max_model_len=2048", "scheduler.async_scheduling=false"), "sglang")
    assert "sglang cannot express scheduler.max_model_len=2048" in shorter.warnings
    assert "sglang cannot express scheduler.async_scheduling=false" in shorter.warnings


def test_queue_orders_and_prefix_caching_map_to_each_engine_or_are_warned():
    priority = _policy("scheduler.queue_order=priority", "scheduler.enable_prefix_caching=true")
    vllm = yaml.safe_load(export(priority, "vllm").text)
    assert vllm["scheduling-policy"] == "priority" and vllm["enable-prefix-caching"] is True
    sglang_export = export(priority, "sglang")
    sglang = yaml.safe_load(sglang_export.text)
    assert sglang["schedule-policy"] == "priority" and sglang["schedule-low-priority-values-first"] is True
    assert sglang["disable-radix-cache"] is False
    assert "# request priority: lower value served first" in sglang_export.text
    assert yaml.safe_load(export(priority, "trtllm").text)["kv_cache_config"]["enable_block_reuse"] is True
    # vLLM caches prefixes by default: a simulation without the cache says so explicitly.
    assert yaml.safe_load(export(_policy(), "vllm").text)["enable-prefix-caching"] is False
    fair = export(_policy("scheduler.queue_order=fair"), "vllm")
    assert any("cannot express scheduler.queue_order=fair" in w for w in fair.warnings)
    assert yaml.safe_load(fair.text)["scheduling-policy"] == "fcfs"


def test_sglang_and_trtllm_set_the_block_size_and_the_kv_cache_size_instead_of_warning():
    # 2,048 blocks of 32 tokens, vLLM's null block among them: 2,047 x 32 = 65,504 tokens for requests.
    policy = _policy("scheduler.block_size=32", "scheduler.num_kv_blocks=2048")
    sglang = export(policy, "sglang")
    keys = yaml.safe_load(sglang.text)
    assert (keys["page-size"], keys["max-total-tokens"]) == (32, 65504)
    trtllm = export(policy, "trtllm")
    cache = yaml.safe_load(trtllm.text)["kv_cache_config"]
    assert (cache["tokens_per_block"], cache["max_tokens"]) == (32, 65504)
    for exported in (sglang, trtllm):
        assert not [w for w in exported.warnings if "block_size" in w or "num_kv_blocks" in w], exported.warnings


def test_trtllm_refuses_a_block_size_that_is_not_a_power_of_two():
    with pytest.raises(UserError, match="tokens_per_block 24 is not a power of two"):
        export(_policy("scheduler.block_size=24", "scheduler.num_kv_blocks=4096"), "trtllm")


def test_the_queue_limit_keeps_vllms_meaning_of_waiting_plus_running_in_every_engine():
    # 200 unfinished requests at most (waiting + running, as vLLM's async_llm.py counts them) beside 48 seats.
    policy = _policy("scheduler.max_num_seqs=48", "scheduler.max_num_queued_reqs=200")
    assert yaml.safe_load(export(policy, "vllm").text)["max-num-queued-reqs"] == 200
    tgi = export(policy, "tgi").text
    assert "--max-concurrent-requests 200" in tgi   # TGI's permits are held from arrival to the last token
    sglang = export(policy, "sglang")
    assert yaml.safe_load(sglang.text)["max-queued-requests"] == 200 - 48   # SGLang counts waiting ones only
    assert any("counts waiting requests only" in w and "200 unfinished" in w for w in sglang.warnings)
    # A limit below the seats: SGLang needs room for one waiting arrival, or it would refuse every request.
    tight = _policy("scheduler.max_num_seqs=48", "scheduler.max_num_queued_reqs=16")
    assert yaml.safe_load(export(tight, "sglang").text)["max-queued-requests"] == 1
