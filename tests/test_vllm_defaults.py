"""A config that leaves a key out runs what ``vllm serve`` 0.33 runs (issue 47): the batch limits of
``EngineArgs.get_batch_defaults`` for the OpenAI API server (vllm/engine/arg_utils.py, lines 2940-3039) and the caps
of ``_set_default_max_num_seqs_and_batched_tokens_args`` (lines 3151-3239), CacheConfig's prefix caching, and the
cost model the GPU has a measured profile for; the values taken are said, and a profile of another GPU is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servetune.cli import main
from servetune.config_loader import config_from_dict, load_config
from servetune.cost_models.catalog import resolve_gpu
from servetune.errors import ConfigError
from servetune.pipeline import resolve
from servetune.vllm_defaults import batch_defaults

# vLLM's tiers for each catalogue GPU, by the memory the device reports (the datasheet's GB as GiB less a little:
# an H200 reports 139.8 GiB, below the 160 GiB tier; a B200 178 GiB and an MI300X 192 GiB, above it) and "a100" in
# its name: 1,024 seats and 16,384 tokens from 160 GiB; 1,024 and 8,192 from 70 GiB unless an A100; 256 and 2,048.
VLLM_TIERS = {
    "a100-40gb": (256, 2048), "a100-80gb": (256, 2048), "a100-40gb-pcie": (256, 2048),
    "a100-80gb-pcie": (256, 2048), "h100-80gb": (1024, 8192), "h100-80gb-pcie": (1024, 8192), "h200": (1024, 8192),
    "l40s": (256, 2048), "l4": (256, 2048), "a10g": (256, 2048), "a40": (256, 2048), "b200": (1024, 16384),
    "h20": (1024, 8192), "mi300x": (1024, 16384),
}


@pytest.mark.parametrize("gpu,expected", VLLM_TIERS.items())
def test_each_gpu_gets_vllm_serves_batch_limits(gpu, expected):
    tier = batch_defaults(resolve_gpu(gpu))
    assert (tier.max_num_seqs, tier.max_num_batched_tokens) == expected
    scheduler = config_from_dict({"hardware": {"gpu": gpu}, "model": "llama-3.1-8b"}).scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == expected


def defaulted(config) -> dict:
    return {key: (value, origin) for key, value, origin in config.defaulted}


def test_a_written_key_is_kept_and_only_the_others_are_defaulted_and_said():
    config = config_from_dict({"hardware": {"gpu": "h100-80gb"}, "scheduler": {"max_num_seqs": 64}})
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 8192)
    said = defaulted(config)
    assert "scheduler.max_num_seqs" not in said
    value, origin = said["scheduler.max_num_batched_tokens"]
    assert value == 8192 and "get_batch_defaults" in origin and "h100-80gb" in origin
    assert said["scheduler.enable_prefix_caching"][0] is True
    assert said["hardware.gpu_memory_utilization"][0] == 0.92   # vLLM 0.33's CacheConfig, not 0.9
    assert said["scheduler.max_model_len"][0] == 4096            # Llama-2-7B's max_position_embeddings
    # A recorded config holds every key: nothing is defaulted when it loads back.
    assert config_from_dict(config.to_dict()).defaulted == ()


@pytest.mark.parametrize("data,expected", [
    # A budget left out is capped at seats x max_model_len: 2 x 512 = 1,024 below 2,048.
    ({"scheduler": {"max_num_seqs": 2}, "workload": {"max_model_len": 512}}, (2, 1024)),
    # Seats left out are capped at the budget.
    ({"scheduler": {"max_num_batched_tokens": 128}}, (128, 128)),
    # Without chunked prefill a budget left out is raised to max_model_len (Llama-2-7B's 4,096).
    ({"scheduler": {"enable_chunked_prefill": False}}, (256, 4096)),
    # A budget given is never moved: vLLM refuses to start instead (test_config.py).
    ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}}, (256, 8192)),
])
def test_vllms_caps_on_defaulted_limits(data, expected):
    scheduler = config_from_dict(data).scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == expected


def test_prefix_caching_is_on_unless_servetune_cannot_simulate_it_and_then_says_why():
    assert config_from_dict({}).scheduler.enable_prefix_caching
    assert not config_from_dict({"scheduler": {"enable_prefix_caching": False}}).scheduler.enable_prefix_caching
    sessions = config_from_dict({"workload": {"arrivals": {"kind": "poisson", "rate": 0.5}, "num_requests": 12,
                                              "sessions": {"calls": 3, "think_s": 2}}})
    value, origin = defaulted(sessions)["scheduler.enable_prefix_caching"]
    assert value is False and "closed-loop sessions" in origin
    sliding = config_from_dict({"model": "mistral-7b"})
    value, origin = defaulted(sliding)["scheduler.enable_prefix_caching"]
    assert value is False and "sliding window" in origin
    resolve(sliding)   # runs: the combination servetune refuses is not what it defaults to


def test_the_cost_model_is_the_gpus_measured_profile_else_its_roofline():
    a100 = config_from_dict({})
    assert (a100.cost_model.kind, a100.cost_model.profile) == ("calibrated", None)
    assert defaulted(a100)["cost_model.profile"][0] == "llama-2-7b_a100-80gb.json"
    l40s = config_from_dict({"hardware": {"gpu": "l40s"}})
    assert l40s.cost_model.kind == "roofline"
    assert "no shipped profile was measured on l40s" in defaulted(l40s)["cost_model.kind"][1]
    assert config_from_dict({"cost_model": {"kind": "linear"}}).cost_model.kind == "linear"


def test_a_profile_of_another_gpu_is_refused_or_applied_with_a_warning_naming_both(tmp_path: Path, capsys):
    data = {"hardware": {"gpu": "h100-80gb-pcie"}, "cost_model": {"kind": "calibrated",
                                                                   "profile": "llama-2-7b_h100-80gb.json"}}
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data, source="c.yaml")
    assert str(raised.value) == (
        "c.yaml: cost_model.profile: got 'llama-2-7b_h100-80gb.json', expected a profile measured on h100-80gb-pcie, "
        "the config's GPU (this one was measured on h100-80gb): fit one with servetune calibrate, use kind: roofline, "
        "or set cost_model.allow_other_gpu: true to apply it anyway")
    data["cost_model"]["allow_other_gpu"] = True
    config = config_from_dict(data, source="c.yaml")
    assert len(config.warnings) == 1 and "h100-80gb and is applied to h100-80gb-pcie" in config.warnings[0]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    load_config(path)
    assert capsys.readouterr().err == f"servetune: warning: {path}: {config.warnings[0].split(': ', 1)[1]}\n"
    with pytest.raises(ConfigError, match="cost_model.allow_other_gpu: got true, expected false for the roofline"):
        config_from_dict({"cost_model": {"kind": "roofline", "allow_other_gpu": True}}, source="c.yaml")


def test_a_replica_group_on_another_gpu_takes_that_gpus_defaults():
    groups = [{"count": 1}, {"count": 1, "hardware": {"gpu": "h100-80gb"}}]
    config = config_from_dict({"cluster": {"replicas": groups, "router": "round_robin"}})
    a100, h100 = (group.scheduler for group in config.cluster.replicas)
    assert (a100.max_num_seqs, h100.max_num_seqs, h100.max_num_batched_tokens) == (256, 1024, 8192)
    assert defaulted(config)["cluster.replicas[1].scheduler.max_num_seqs"][0] == 1024
    # A value the top-level scheduler writes is every group's.
    written = config_from_dict({"scheduler": {"max_num_seqs": 64},
                                "cluster": {"replicas": groups, "router": "round_robin"}})
    assert [group.scheduler.max_num_seqs for group in written.cluster.replicas] == [64, 64]


def test_a_scenario_on_another_gpu_takes_that_gpus_defaults():
    from servetune.search.study.scenarios import variants

    config = config_from_dict({"search": {"scenarios": [{"hardware.gpu": "h100-80gb"}, {"workload.seed": 1}]}})
    h100, a100 = (variant.config for variant in variants(config))
    assert (h100.scheduler.max_num_seqs, h100.scheduler.max_num_batched_tokens) == (1024, 8192)
    assert h100.cost_model.kind == "calibrated" and h100.cost_model.profile is None   # the H100's shipped profile
    assert a100.scheduler.max_num_seqs == 256


def test_simulate_says_which_values_it_took_and_from_what(tmp_path: Path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("hardware: {gpu: h100-80gb}\n"
                    "workload: {arrivals: {kind: poisson, rate: 2}, num_requests: 20,\n"
                    "           lengths: {kind: fixed, prompt_tokens: 64, output_tokens: 8}}\n")
    assert main(["simulate", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "left out of the file, so as vllm serve 0.33 runs" in out
    for fragment in ("scheduler.max_num_seqs", "1,024", "scheduler.max_num_batched_tokens", "8,192",
                     "llama-2-7b_h100-80gb.json"):
        assert fragment in out
    assert load_config(path).defaulted   # and the config itself says the same
