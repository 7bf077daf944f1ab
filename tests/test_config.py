"""Config loading: the examples, defaults, --set overrides, and one clear line for every kind of bad input."""
from __future__ import annotations

import dataclasses
import json

import pytest

from servetune.config import (
    ArrivalsConfig,
    Config,
    CostModelConfig,
    HardwareConfig,
    LengthsConfig,
    SchedulerConfig,
    SearchConfig,
    SessionsConfig,
    SloConfig,
    TenantConfig,
    WorkloadConfig,
)
from servetune.config_loader import apply_overrides, config_from_dict, load_config
from servetune.envs.workload.lengths import LognormalSpec
from servetune.envs.workload.traces import TRACE_PARSERS
from servetune.errors import ConfigError, UserError
from servetune.paths import REPO_ROOT
from servetune.pipeline import resolve
from servetune.search.provenance import config_data, config_from_data

EXAMPLES = REPO_ROOT / "examples"
FIXTURES = REPO_ROOT / "tests" / "fixtures"
TRACE_FORMATS = ", ".join(TRACE_PARSERS)


def config_error(data: dict, **kwargs) -> str:
    """The message config_from_dict raises for ``data`` (source "c.yaml"), checked to be one line."""
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data, source="c.yaml", **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_chat_example_is_the_issue_config():
    expected = Config(
        model="llama-2-7b",
        hardware=HardwareConfig(gpu="a100-80gb", tp=1),
        cost_model=CostModelConfig(kind="linear", base_s=0.010, per_token_s=0.00003, per_context_token_s=0.0000002),
        workload=WorkloadConfig(
            arrivals=ArrivalsConfig(kind="poisson", rate=4.0),
            lengths=LengthsConfig(kind="fixed", prompt_tokens=512, output_tokens=128),
            num_requests=2000,
            seed=0,
        ),
        scheduler=SchedulerConfig(
            policy="continuous", max_num_seqs=64, max_num_batched_tokens=2048, enable_chunked_prefill=True,
            long_prefill_token_threshold=0, block_size=16, num_kv_blocks=8192, watermark=0.0, max_num_queued_reqs=None,
            enable_prefix_caching=False,
        ),
        slo=SloConfig(ttft_ms=800.0, itl_ms=60.0, attainment_target=0.9),
        # Most configs serve the shipped load in full, so goodput ties: the study searches capacity instead.
        search=SearchConfig(objectives=("capacity",)),
    )
    config = load_config(EXAMPLES / "chat.yaml")
    assert config == expected
    assert config.source == str(EXAMPLES / "chat.yaml")
    assert isinstance(config.slo.ttft_ms, float)   # written as the integer 800


def test_static_example_is_chat_with_static_batching():
    chat, static = load_config(EXAMPLES / "chat.yaml"), load_config(EXAMPLES / "static.yaml")
    assert (static.scheduler.policy, static.scheduler.batch_size, static.scheduler.max_wait_s) == ("static", 32, 0.5)
    assert static.workload == chat.workload and static.cost_model == chat.cost_model and static.slo == chat.slo


def test_azure_example_replays_the_shipped_trace_whole_with_its_own_lengths():
    config = load_config(EXAMPLES / "azure_conv.yaml")
    arrivals = config.workload.arrivals
    assert (arrivals.kind, arrivals.format, arrivals.rate_scale) == ("trace", "azure", 0.7)
    assert arrivals.path == str(EXAMPLES / "traces" / "AzureLLMInferenceTrace_conv.csv")   # resolved, absolute
    assert config.workload.num_requests is None
    assert config.workload.lengths.kind == "trace"
    assert config.cost_model == load_config(EXAMPLES / "chat.yaml").cost_model
    scheduler = config.scheduler
    assert (scheduler.policy, scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == ("continuous", 256, 2048)
    assert (scheduler.enable_chunked_prefill, scheduler.num_kv_blocks) == (True, 8192)
    assert (config.slo.ttft_ms, config.slo.itl_ms) == (800.0, 60.0)


def test_omitted_keys_take_the_dataclass_defaults():
    assert config_from_dict({}) == Config()
    config = config_from_dict({"scheduler": {"max_num_seqs": 8}, "hardware": {"tp": 2}})
    assert config.scheduler == SchedulerConfig(max_num_seqs=8)
    assert config.hardware == HardwareConfig(tp=2)
    assert config.workload == WorkloadConfig()


def test_trace_arrivals_default_to_every_row_and_the_trace_lengths():
    config = config_from_dict(
        {"workload": {"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed"}}},
        base_dir=FIXTURES,
    )
    assert config.workload.arrivals.path == str(FIXTURES / "tiny_processed.csv")
    assert config.workload.num_requests is None
    assert config.workload.lengths == LengthsConfig(kind="trace")
    explicit_null = config_from_dict(
        {"workload": {"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed"},
                      "lengths": None}},
        base_dir=FIXTURES,
    )
    assert explicit_null.workload.lengths == LengthsConfig(kind="trace")


def test_fixed_lengths_may_override_a_traces_token_counts():
    config = config_from_dict(
        {"workload": {"arrivals": {"kind": "trace", "path": "tiny_azure.csv", "format": "azure"},
                      "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10}, "num_requests": 3}},
        base_dir=FIXTURES,
    )
    assert config.workload.lengths == LengthsConfig(kind="fixed", prompt_tokens=100, output_tokens=10)
    assert config.workload.num_requests == 3


def test_uniform_ranges_become_tuples():
    config = config_from_dict({"workload": {"lengths": {"kind": "uniform", "prompt_tokens": [1, 4],
                                                        "output_tokens": [7, 7]}}})
    assert config.workload.lengths.prompt_tokens == (1, 4)
    assert config.workload.lengths.output_tokens == (7, 7)
    hash(config)   # frozen all the way down


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # PyYAML alone reads `3e-5` as the string '3e-5' (YAML 1.1).
    path = tmp_path / "c.yaml"
    path.write_text("cost_model: {kind: linear, per_token_s: 3e-5, per_context_token_s: 2E-7, base_s: 1e-2}\n")
    cost = load_config(path).cost_model
    assert (cost.per_token_s, cost.per_context_token_s, cost.base_s) == (3e-5, 2e-7, 1e-2)


# --- overrides ---------------------------------------------------------------------------------------------

def test_overrides_set_nested_fields_null_booleans_and_lists():
    config = load_config(
        EXAMPLES / "chat.yaml",
        [
            "scheduler.max_num_seqs=128",
            "scheduler.num_kv_blocks=null",
            "scheduler.enable_chunked_prefill=false",
            "workload.arrivals.rate=0.5",
            "workload.lengths.kind=uniform",
            "workload.lengths.prompt_tokens=[1, 4]",
            "workload.lengths.output_tokens=[2, 8]",
            "slo.tpot_ms=50",
            "simulation.horizon_s=600",
            "model=llama-2-13b",
        ],
    )
    assert config.scheduler.max_num_seqs == 128
    assert config.scheduler.num_kv_blocks is None
    assert config.scheduler.enable_chunked_prefill is False
    assert config.workload.arrivals.rate == 0.5
    assert config.workload.lengths == LengthsConfig(kind="uniform", prompt_tokens=(1, 4), output_tokens=(2, 8))
    assert config.slo.tpot_ms == 50.0 and config.simulation.horizon_s == 600.0
    assert config.model == "llama-2-13b"
    assert config.scheduler.block_size == 16   # untouched fields stay as the file has them


def test_apply_overrides_copies_creates_missing_sections_and_later_overrides_win():
    data = {"scheduler": {"max_num_seqs": 64}, "workload": {"lengths": None}}
    result = apply_overrides(data, ["slo.ttft_ms=300", "workload.lengths.kind=fixed", "slo.ttft_ms=400"])
    assert result == {"scheduler": {"max_num_seqs": 64}, "workload": {"lengths": {"kind": "fixed"}},
                      "slo": {"ttft_ms": 400}}
    assert data == {"scheduler": {"max_num_seqs": 64}, "workload": {"lengths": None}}   # input untouched


def test_an_overridden_trace_path_is_relative_to_the_current_folder(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    config = load_config(EXAMPLES / "azure_conv.yaml", ["workload.arrivals.path=tiny_azure.csv"])
    assert config.workload.arrivals.path == str(FIXTURES / "tiny_azure.csv")


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("scheduler.max_num_seq=3", ["--set scheduler.max_num_seq=3", "scheduler.max_num_seq: unknown key",
                                     "did you mean scheduler.max_num_seqs?"]),
        ("schedular.max_num_seqs=3", ["schedular: unknown key", "did you mean scheduler?"]),
        ("scheduler.max_num_seqs.limit=3", ["scheduler.max_num_seqs is a value, not a section", "limit"]),
        ("source=x.yaml", ["source: unknown key"]),
        ("rl.bounds={max_num_seq: [1, 64]}", ["rl.bounds.max_num_seq: unknown key", "did you mean rl.bounds.max_num_seqs?"]),
        ("scheduler.max_num_seqs", ["expected KEY=VALUE"]),
        ("=3", ["expected KEY=VALUE"]),
        ("workload.lengths.prompt_tokens=[1, 4", ["--set workload.lengths.prompt_tokens=[1, 4", "invalid YAML"]),
    ],
)
def test_bad_overrides_are_named(override, fragments):
    with pytest.raises(ConfigError) as raised:
        load_config(EXAMPLES / "chat.yaml", [override])
    message = str(raised.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_an_invalid_value_from_an_override_names_the_file_field_and_override():
    with pytest.raises(ConfigError) as raised:
        load_config(EXAMPLES / "chat.yaml", ["scheduler.max_num_seqs=-3"])
    assert str(raised.value) == (
        f"{EXAMPLES / 'chat.yaml'}: scheduler.max_num_seqs: got -3, expected an integer in [1, 65536] "
        "(from --set scheduler.max_num_seqs=-3)"
    )


# --- bad input ---------------------------------------------------------------------------------------------

def test_message_names_file_field_value_and_expectation(tmp_path):
    path = tmp_path / "chat.yaml"
    path.write_text((EXAMPLES / "chat.yaml").read_text().replace("max_num_seqs: 64", "max_num_seqs: -3"))
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"{path}: scheduler.max_num_seqs: got -3, expected an integer in [1, 65536]"


GPU_FORMS = ("a catalogue GPU name (servetune gpus), the path of a .yaml/.yml/.json file defining a GPU, or a mapping "
             "{name, memory_gib, memory_gb_per_s, bf16_tflops, fp8_tflops, int8_tops, interconnect_gb_per_s}")


@pytest.mark.parametrize(
    "section,field,value,expected",
    [
        # types
        ("scheduler", "max_num_seqs", 3.5, "got 3.5, expected an integer in [1, 65536]"),
        ("scheduler", "max_num_seqs", True, "got true, expected an integer in [1, 65536]"),
        ("scheduler", "max_num_seqs", "64", "got '64', expected an integer in [1, 65536]"),
        ("scheduler", "enable_chunked_prefill", 1, "got 1, expected true or false"),
        ("slo", "ttft_ms", "fast", "got 'fast', expected a finite number in (0, 1e+11] or null"),
        ("slo", "ttft_ms", float("nan"), "got .nan, expected a finite number in (0, 1e+11] or null"),
        ("simulation", "horizon_s", float("inf"), "got .inf, expected a finite number in (0, 1e+08] or null"),
        ("hardware", "gpu", 100, f"got 100, expected {GPU_FORMS}"),
        ("hardware", "gpu", "", f"got '', expected {GPU_FORMS}"),
        # ranges
        ("hardware", "tp", 0, "got 0, expected an integer in [1, 1024]"),
        ("hardware", "gpu_memory_utilization", 0, "got 0, expected a finite number in (0, 1]"),
        ("hardware", "gpu_memory_utilization", 1.5, "got 1.5, expected a finite number in (0, 1]"),
        ("cost_model", "per_token_s", -1e-5, "got -1e-05, expected a finite number in [0, 1]"),
        ("scheduler", "max_num_batched_tokens", 0, "got 0, expected an integer in [1, 16777216]"),
        ("scheduler", "block_size", 0, "got 0, expected an integer in [1, 16777216]"),
        ("scheduler", "num_kv_blocks", 0, "got 0, expected an integer in [1, 268435456] or null"),
        ("scheduler", "batch_size", 0, "got 0, expected an integer in [1, 65536]"),
        ("scheduler", "long_prefill_token_threshold", -1, "got -1, expected an integer in [0, 16777216]"),
        ("scheduler", "watermark", 1.0, "got 1.0, expected a finite number in [0, 1)"),
        ("scheduler", "watermark", -0.1, "got -0.1, expected a finite number in [0, 1)"),
        ("scheduler", "max_num_queued_reqs", -1, "got -1, expected an integer in [0, 10000000] or null"),
        ("scheduler", "max_wait_s", -0.5, "got -0.5, expected a finite number in [0, 1e+08]"),
        ("scheduler", "max_model_len", 1, "got 1, expected an integer in [2, 16777216] or null"),
        ("scheduler", "max_model_len", 4096.5, "got 4096.5, expected an integer in [2, 16777216] or null"),
        ("scheduler", "async_scheduling", "on", "got 'on', expected true or false or null"),
        ("scheduler", "reserve_full_prompt", None, "got null, expected true or false"),
        ("slo", "itl_ms", 0, "got 0, expected a finite number in (0, 1e+11] or null"),
        ("slo", "attainment_target", 0, "got 0, expected a finite number in (0, 1]"),
        ("slo", "attainment_target", 1.01, "got 1.01, expected a finite number in (0, 1]"),
        ("simulation", "horizon_s", 0, "got 0, expected a finite number in (0, 1e+08] or null"),
        # choices
        ("scheduler", "policy", "dynamic", "got 'dynamic', expected one of continuous, static"),
        ("cost_model", "kind", "quadratic", "got 'quadratic', expected one of linear, roofline, calibrated"),
        # the rl section
        ("rl", "interval_s", 0, "got 0, expected a finite number in [0.001, 1e+08]"),
        ("rl", "gamma", 1.5, "got 1.5, expected a finite number in [0, 1]"),
        ("rl", "num_envs", 0, "got 0, expected an integer in [1, 65536]"),
        ("rl", "miss_penalty", -1, "got -1, expected a finite number in [0, 1e+06]"),
        ("rl", "hidden", [64, 0], "got [64, 0], expected a non-empty list of at most 64 layer widths, integers in "
                                  "[1, 65536], such as [64, 64]"),
        ("rl", "bounds", [1, 64], "got [1, 64], expected a mapping of knob to [low, high], such as "
                                  "{max_num_seqs: [1, 64]}"),
        ("rl", "num_minibatches", 7, "got 7, expected a divisor of num_envs × num_steps = 16384"),
    ],
)
def test_bad_field_values_are_named(section, field, value, expected):
    assert config_error({section: {field: value}}) == f"c.yaml: {section}.{field}: {expected}"


def test_a_bad_rl_bound_names_its_knob():
    assert config_error({"rl": {"bounds": {"max_num_seqs": [64, 1]}}}) == (
        "c.yaml: rl.bounds.max_num_seqs: got [64, 1], expected [low, high], integers with 1 ≤ low < high ≤ 65536 "
        "(scheduler.max_num_seqs's range)")


@pytest.mark.parametrize(
    "workload,expected",
    [
        ({"arrivals": {"rate": 0}},
         "workload.arrivals.rate: got 0, expected a finite number in [1e-06, 1e+06] or null"),
        ({"arrivals": {"rate": None}},
         "workload.arrivals.rate: got null, expected a number in [1e-06, 1e+06] for poisson arrivals"),
        ({"arrivals": {"kind": "hawkes"}}, "workload.arrivals.kind: got 'hawkes', expected one of poisson, gamma, "
                                           "onoff, piecewise, servegen, trace"),
        ({"arrivals": {"format": "csv"}}, f"workload.arrivals.format: got 'csv', expected one of {TRACE_FORMATS}"),
        ({"arrivals": {"rate_scale": 0}},
         "workload.arrivals.rate_scale: got 0, expected a finite number in [1e-06, 1e+06]"),
        ({"num_requests": 0}, "workload.num_requests: got 0, expected an integer in [1, 10000000] or null"),
        ({"num_requests": None}, "workload.num_requests: got null, expected an integer ≥ 1 for poisson arrivals"),
        ({"seed": -1}, "workload.seed: got -1, expected an integer in [0, 4294967295]"),
        ({"lengths": {"kind": "zipf"}}, "workload.lengths.kind: got 'zipf', expected one of fixed, uniform, "
                                        "geometric, lognormal, empirical, trace"),
        ({"lengths": {"kind": "trace"}}, "workload.lengths.kind: got 'trace', expected one of fixed, uniform, "
                                         "geometric, lognormal, empirical with poisson arrivals (trace lengths need "
                                         "trace arrivals)"),
        ({"lengths": None}, "workload.lengths: got null, expected a mapping with kind one of fixed, uniform, "
                            "geometric, lognormal, empirical for poisson arrivals"),
        ({"lengths": {"prompt_tokens": 0}}, "workload.lengths.prompt_tokens: got 0, expected an integer in "
                                            "[1, 16777216] for fixed lengths"),
        ({"lengths": {"output_tokens": [1, 4]}}, "workload.lengths.output_tokens: got [1, 4], expected an integer"),
        ({"lengths": {"output_tokens": 2**31}}, "got 2147483648, expected an integer in [1, 16777216]"),
        ({"lengths": {"kind": "uniform"}}, "workload.lengths.prompt_tokens: got 512, expected [low, high]"),
        ({"lengths": {"kind": "uniform", "prompt_tokens": [5, 1], "output_tokens": [1, 2]}},
         "workload.lengths.prompt_tokens: got [5, 1], expected [low, high] for uniform lengths: integers in "
         "[1, 16777216] with low ≤ high"),
        ({"lengths": {"kind": "uniform", "prompt_tokens": [0, 5], "output_tokens": [1, 2]}},
         "workload.lengths.prompt_tokens: got [0, 5]"),
        ({"lengths": {"kind": "uniform", "prompt_tokens": [1, 5], "output_tokens": [1, 2, 3]}},
         "workload.lengths.output_tokens: got [1, 2, 3]"),
        ({"lengths": {"kind": "uniform", "prompt_tokens": [1, 5.5], "output_tokens": [1, 2]}},
         "workload.lengths.prompt_tokens: got [1, 5.5]"),
        ({"arrivals": {"kind": "trace", "format": "azure"}},
         "workload.arrivals.path: got null, expected the path of a trace file for trace arrivals"),
        ({"arrivals": {"kind": "trace", "path": "tiny_azure.csv"}},
         f"workload.arrivals.format: got null, expected one of {TRACE_FORMATS} for trace arrivals"),
        ({"arrivals": {"kind": "trace", "path": "absent.csv", "format": "azure"}},
         "workload.arrivals.path: got 'absent.csv', expected an existing trace file "
         f"(no file {FIXTURES / 'absent.csv'})"),
    ],
)
def test_bad_workloads_are_named(workload, expected):
    message = config_error({"workload": workload}, base_dir=FIXTURES)
    assert message.startswith("c.yaml: workload")
    assert expected in message


# --- generated workloads: arrival processes, length distributions, tenants ---------------------------------

_TENANT = {"name": "a"}
_OWN = {"kind": "poisson", "rate": 2}   # a tenant's own arrival process


@pytest.mark.parametrize(
    "workload,expected",
    [
        # arrival kinds: what each needs, and fields the kind would ignore
        ({"arrivals": {"kind": "gamma", "rate": 2}}, "workload.arrivals.cv: got null, expected a number in [0.001, "
                                                     "1000] for gamma "
                                                     "arrivals"),
        ({"arrivals": {"kind": "gamma", "cv": 0}},
         "workload.arrivals.cv: got 0, expected a finite number in [0.001, 1000] or null"),
        ({"arrivals": {"kind": "gamma", "cv": 2}, "num_requests": None},
         "workload.num_requests: got null, expected an integer ≥ 1 for gamma arrivals"),
        ({"arrivals": {"cv": 2}},
         "workload.arrivals.cv: got 2.0, expected null for poisson arrivals (cv is for gamma)"),
        ({"arrivals": {"kind": "onoff", "off_s": 5}}, "workload.arrivals.on_s: got null, expected a number in (0, "
                                                      "1e+08] for "
                                                      "onoff arrivals"),
        ({"arrivals": {"kind": "onoff", "on_s": 5}}, "workload.arrivals.off_s: got null, expected a number in [0, "
                                                     "1e+08] for "
                                                     "onoff arrivals"),
        ({"arrivals": {"kind": "onoff", "on_s": 0, "off_s": 5}}, "workload.arrivals.on_s: got 0, expected a finite "
                                                                 "number in (0, 1e+08] or null"),
        ({"arrivals": {"kind": "onoff", "on_s": 5, "off_s": -1}}, "workload.arrivals.off_s: got -1, expected a finite "
                                                                  "number in [0, 1e+08] or null"),
        ({"arrivals": {"kind": "gamma", "cv": 1, "on_s": 5}}, "workload.arrivals.on_s: got 5.0, expected null for "
                                                              "gamma arrivals (on_s is for onoff)"),
        ({"arrivals": {"kind": "piecewise"}}, "workload.arrivals.profile: got null, expected a list of [start_s, rate] "
                                              "pairs for piecewise arrivals"),
        ({"arrivals": {"kind": "piecewise", "profile": [[1, 2]]}},
         "workload.arrivals.profile[0]: got [1, 2], expected a first segment starting at 0"),
        ({"arrivals": {"kind": "piecewise", "profile": [[0, 1], [60, 2], [60, 3]]}},
         "workload.arrivals.profile[2]: got [60, 3], expected a start after the previous segment's 60"),
        ({"arrivals": {"kind": "piecewise", "profile": [[0, 1], [60, -2]]}},
         "workload.arrivals.profile[1]: got [60, -2], expected a rate of 0 or in [1e-06, 1e+06]"),
        ({"arrivals": {"kind": "piecewise", "profile": [[0, 0], [60, 0]]}},
         "workload.arrivals.profile: got [[0, 0], [60, 0]], expected at least one segment with a rate > 0"),
        ({"arrivals": {"kind": "piecewise", "profile": [[0, "fast"]]}},
         "workload.arrivals.profile[0]: got [0, 'fast'], expected a pair [start_s, rate] of finite numbers"),
        ({"arrivals": {"kind": "piecewise", "profile": [0, 1]}},
         "workload.arrivals.profile[0]: got 0, expected a pair [start_s, rate] of finite numbers"),
        ({"arrivals": {"kind": "piecewise", "profile": [[0, 1]], "time_scale": 0}},
         "workload.arrivals.time_scale: got 0, expected a finite number in [1e-06, 1e+06]"),
        ({"arrivals": {"time_scale": 2}}, "workload.arrivals.time_scale: got 2.0, expected 1.0 for poisson arrivals "
                                          "(time_scale is for piecewise and servegen)"),
        ({"arrivals": {"kind": "servegen"}}, "workload.arrivals.path: got null, expected the path of a file for "
                                             "servegen arrivals"),
        ({"arrivals": {"kind": "servegen", "path": "absent.csv"}},
         f"workload.arrivals.path: got 'absent.csv', expected an existing ServeGen trace.csv (no file "
         f"{FIXTURES / 'absent.csv'})"),
        ({"arrivals": {"path": "tiny_processed.csv"}}, "workload.arrivals.path: got 'tiny_processed.csv', expected "
                                                       "null for poisson arrivals (path is for servegen and trace)"),
        ({"arrivals": {"window_s": 60}}, "workload.arrivals.window_s: got 60.0, expected null for poisson arrivals "
                                         "(window_s is for trace)"),
        ({"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed", "window_start_s": -1}},
         "workload.arrivals.window_start_s: got -1, expected a finite number in [0, 1e+08]"),
        ({"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed", "window_s": 0}},
         "workload.arrivals.window_s: got 0, expected a finite number in (0, 1e+08] or null"),
        ({"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed", "jitter_s": -3}},
         "workload.arrivals.jitter_s: got -3, expected a finite number in [0, 1e+08]"),
        ({"arrivals": {"jitter_s": 3}}, "workload.arrivals.jitter_s: got 3.0, expected 0.0 for poisson arrivals "
                                        "(jitter_s is for trace)"),
        ({"max_model_len": 1}, "workload.max_model_len: got 1, expected an integer in [2, 16777216] or null"),
        # length kinds
        ({"lengths": {"kind": "geometric", "prompt_tokens": 0.5}}, "workload.lengths.prompt_tokens: got 0.5, expected "
                                                                   "the mean, a number in [1, 16777216], for "
                                                                   "geometric lengths"),
        ({"lengths": {"kind": "geometric", "output_tokens": [1, 4]}}, "workload.lengths.output_tokens: got [1, 4]"),
        ({"lengths": {"kind": "lognormal"}}, "workload.lengths.prompt_tokens: got 512, expected {median: m, sigma: s} "
                                             "for lognormal lengths"),
        ({"lengths": {"kind": "lognormal", "prompt_tokens": {"median": 100, "sigma": 1},
                      "output_tokens": {"median": 20}}},
         "workload.lengths.output_tokens.sigma: missing; expected a number in [0, 20] for lognormal lengths"),
        ({"lengths": {"kind": "lognormal", "prompt_tokens": {"median": 0, "sigma": 1}}},
         "workload.lengths.prompt_tokens.median: got 0, expected a finite number in [1, 16777216]"),
        ({"lengths": {"kind": "lognormal", "prompt_tokens": {"median": 10, "sigma": -1}}},
         "workload.lengths.prompt_tokens.sigma: got -1, expected a finite number in [0, 20]"),
        ({"lengths": {"kind": "lognormal", "prompt_tokens": {"median": 10, "sigma": 1, "mean": 3}}},
         "workload.lengths.prompt_tokens.mean: unknown key; did you mean workload.lengths.prompt_tokens.median?"),
        ({"lengths": {"kind": "empirical"}},
         "workload.lengths.path: got null, expected the path of a CSV length sample with columns "
         "num_prefill_tokens,num_decode_tokens"),
        ({"lengths": {"kind": "empirical", "path": "absent.csv"}},
         f"workload.lengths.path: got 'absent.csv', expected an existing length sample (no file "
         f"{FIXTURES / 'absent.csv'})"),
        ({"lengths": {"path": "tiny_processed.csv"}}, "workload.lengths.path: got 'tiny_processed.csv', expected null "
                                                      "for fixed lengths (path is for empirical lengths)"),
        # tenants: their own fields, and their lengths and SLO under the lengths' and the slo section's rules
        ({"tenants": []}, "workload.tenants: got [], expected a non-empty list of tenants"),
        ({"tenants": {"name": "a"}}, "workload.tenants: got {name: 'a'}, expected a non-empty list of tenants"),
        ({"tenants": [5]}, "workload.tenants[0]: got 5, expected a mapping with keys name, share, arrivals, priority"),
        ({"tenants": [_TENANT, {"name": "b", "share": 0}]}, "workload.tenants[1].share: got 0, expected a finite "
                                                            "number in (0, 1e+06]"),
        ({"tenants": [{"name": "a", "shares": 2}]}, "workload.tenants[0].shares: unknown key; did you mean "
                                                    "workload.tenants[0].share?"),
        ({"tenants": [_TENANT, _TENANT]}, "workload.tenants[1].name: got 'a', expected a name no earlier tenant has"),
        ({"tenants": [{"name": ""}]}, "workload.tenants[0].name: got '', expected a non-empty string"),
        ({"tenants": [{"name": "a", "priority": 1.5}]}, "workload.tenants[0].priority: got 1.5, expected an integer"),
        ({"tenants": [{"name": "a", "prefix_tokens": -1}]}, "workload.tenants[0].prefix_tokens: got -1, expected an "
                                                            "integer in [0, 16777215]"),
        ({"tenants": [{"name": "a", "prefix_groups": 0}]}, "workload.tenants[0].prefix_groups: got 0, expected an "
                                                           "integer in [1, 10000000]"),
        ({"tenants": [{"name": "a", "prefix_tokens": 99}], "max_model_len": 100},
         "workload.tenants[0].prefix_tokens: got 99, expected ≤ max_model_len - 2 = 98"),
        ({"tenants": [{"name": "a", "slo": {"ttft_ms": 0}}]}, "workload.tenants[0].slo.ttft_ms: got 0, expected a "
                                                              "finite number in (0, 1e+11] or null"),
        ({"tenants": [{"name": "a", "slo": {"ttft": 100}}]}, "workload.tenants[0].slo.ttft: unknown key; did you mean "
                                                             "workload.tenants[0].slo.ttft_ms?"),
        ({"tenants": [{"name": "a", "slo": 5}]},
         "workload.tenants[0].slo: got 5, expected a mapping with keys ttft_ms"),
        ({"tenants": [{"name": "a", "lengths": {"kind": "zipf"}}]},
         "workload.tenants[0].lengths.kind: got 'zipf', expected one of fixed, uniform"),
        ({"tenants": [{"name": "a", "lengths": {"kind": "uniform"}}]},
         "workload.tenants[0].lengths.prompt_tokens: got 512, expected [low, high] for uniform lengths"),
        ({"tenants": [{"name": "a", "lengths": {"kind": "trace"}}]},
         "workload.tenants[0].lengths.kind: got 'trace', expected one of fixed, uniform, geometric, lognormal, "
         "empirical with poisson arrivals"),
        ({"tenants": [{"name": "a", "lengths": {"kind": "empirical", "path": "absent.csv"}}]},
         "workload.tenants[0].lengths.path: got 'absent.csv', expected an existing length sample"),
        ({"tenants": [{"name": "a", "lengths": {"kind": "lognormal", "prompt_tokens": {"median": 9}}}]},
         "workload.tenants[0].lengths.prompt_tokens.sigma: missing"),
        # tenants with their own arrivals: every tenant or none, no share, no workload arrivals, no trace
        ({"tenants": [{"name": "a", "arrivals": _OWN}, {"name": "b"}]},
         "workload.tenants[1].arrivals: expected arrivals here too: either every tenant has its own arrivals or "
         "none has"),
        ({"tenants": [{"name": "a", "share": 2, "arrivals": _OWN}]},
         "workload.tenants[0].share: got 2.0, expected none with the tenant's own arrivals"),
        ({"arrivals": {"kind": "poisson", "rate": 2}, "tenants": [{"name": "a", "arrivals": _OWN}]},
         "workload.arrivals: expected none when every tenant has its own arrivals"),
        ({"tenants": [{"name": "a", "arrivals": {"kind": "trace", "path": "tiny_processed.csv",
                                                 "format": "processed"}}]},
         "workload.tenants[0].arrivals.kind: got 'trace', expected a generated kind for a tenant's own arrivals"),
        ({"tenants": [{"name": "a", "arrivals": {"kind": "gamma", "rate": 2}}]},
         "workload.tenants[0].arrivals.cv: got null, expected a number in [0.001, 1000] for gamma arrivals"),
        ({"tenants": [{"name": "a", "arrivals": {"kind": "poisson", "rte": 2}}]},
         "workload.tenants[0].arrivals.rte: unknown key; did you mean workload.tenants[0].arrivals.rate?"),
        ({"tenants": [{"name": "a", "arrivals": {"kind": "poisson", "rate": 2, "cv": 3}}]},
         "workload.tenants[0].arrivals.cv: got 3.0, expected null for poisson arrivals (cv is for gamma)"),
        ({"num_requests": None, "tenants": [{"name": "a", "arrivals": {"kind": "poisson", "rate": 2}}]},
         "workload.num_requests: got null, expected an integer ≥ 1 for poisson arrivals"),
        ({"num_requests": None, "arrivals": {"kind": "piecewise", "profile": [[0, 1], [10, 2]]}},
         "workload.num_requests: got null, expected an integer ≥ 1 for piecewise arrivals whose last rate is not 0"),
    ],
)
def test_bad_generated_workloads_are_named(workload, expected):
    message = config_error({"workload": workload}, base_dir=FIXTURES)
    assert message.startswith(f"c.yaml: {expected}")


def test_a_bad_tenant_from_an_override_names_the_override():
    with pytest.raises(ConfigError) as raised:
        load_config(EXAMPLES / "chat.yaml", ["workload.tenants=[{name: a}, {name: b, slo: {itl_ms: -1}}]"])
    assert str(raised.value) == (
        f"{EXAMPLES / 'chat.yaml'}: workload.tenants[1].slo.itl_ms: got -1, expected a finite number in (0, 1e+11] or "
        "null "
        "(from --set workload.tenants=[{name: a}, {name: b, slo: {itl_ms: -1}}])"
    )


GENERATED = {
    "arrivals": {"kind": "piecewise", "profile": [[0, 1], [60, 4.5]], "time_scale": 2},
    "lengths": {"kind": "lognormal", "prompt_tokens": {"median": 300, "sigma": 1},
                "output_tokens": {"median": 50, "sigma": 0.5}},
    "max_model_len": 4096,
    "tenants": [
        {"name": "chat", "share": 3, "prefix_tokens": 200, "prefix_groups": 4},
        {"name": "batch", "share": 1, "priority": 2, "slo": {"ttft_ms": 5000},
         "lengths": {"kind": "empirical", "path": "../../examples/lengths/sharegpt_sample.csv"}},
        {"name": "agent", "lengths": {"kind": "geometric", "prompt_tokens": 900, "output_tokens": 40}},
    ],
}


def test_generated_workload_fields_become_frozen_typed_values():
    workload = config_from_dict({"workload": GENERATED}, base_dir=FIXTURES).workload
    assert workload.arrivals.profile == ((0.0, 1.0), (60.0, 4.5))
    assert workload.lengths.prompt_tokens == LognormalSpec(median=300.0, sigma=1.0)
    chat, batch, agent = workload.tenants
    assert chat == TenantConfig(name="chat", share=3.0, prefix_tokens=200, prefix_groups=4)
    assert (batch.priority, batch.slo) == (2, SloConfig(ttft_ms=5000.0))
    assert batch.lengths == LengthsConfig(kind="empirical", path=str(EXAMPLES / "lengths" / "sharegpt_sample.csv"))
    assert agent.lengths == LengthsConfig(kind="geometric", prompt_tokens=900.0, output_tokens=40.0)
    hash(workload)   # the search caches workloads by their config


def test_generated_workloads_survive_the_round_trip_a_study_records():
    # Studies store the config as JSON (search/provenance.py) and read it back with config_from_dict.
    config = config_from_dict({"workload": GENERATED}, base_dir=FIXTURES)
    recorded = json.loads(json.dumps(config.to_dict()))
    assert config_from_dict(recorded) == config


def test_servegen_and_empirical_paths_resolve_against_the_config_folder(tmp_path):
    (tmp_path / "trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n")
    (tmp_path / "lengths.csv").write_text("num_prefill_tokens,num_decode_tokens\n5,6\n")
    (tmp_path / "c.yaml").write_text("workload: {arrivals: {kind: servegen, path: trace.csv}, "
                                     "lengths: {kind: empirical, path: lengths.csv}}\n")
    workload = load_config(tmp_path / "c.yaml").workload
    assert workload.arrivals.path == str(tmp_path / "trace.csv")
    assert workload.lengths.path == str(tmp_path / "lengths.csv")
    assert workload.num_requests == 2000   # a cap on the generated requests, as for the other generated kinds


AGENT = {"arrivals": {"kind": "poisson", "rate": 0.5}, "num_requests": 12, "sessions": {"calls": 3, "think_s": 2}}


def test_sessions_become_frozen_typed_values():
    workload = config_from_dict({"workload": AGENT}).workload
    assert workload.sessions == SessionsConfig(calls=3, think_s=2.0, history=False)
    assert isinstance(workload.sessions.think_s, float)
    ranged = config_from_dict({"workload": {**AGENT, "sessions": {"calls": 4, "think_s": [1, 3], "history": True}}})
    assert ranged.workload.sessions == SessionsConfig(calls=4, think_s=(1.0, 3.0), history=True)
    hash(ranged.workload)
    recorded = json.loads(json.dumps(ranged.to_dict()))
    assert config_from_dict(recorded) == ranged
    assert config_from_dict({}).workload.sessions is None


def with_sessions(**sessions) -> dict:
    return {"workload": {**AGENT, "sessions": {**AGENT["sessions"], **sessions}}}


@pytest.mark.parametrize(
    "data, expected",
    [
        (with_sessions(calls=0), "workload.sessions.calls: got 0, expected an integer in [1, 10000000]"),
        (with_sessions(calls=2.5), "workload.sessions.calls: got 2.5, expected an integer in [1, 10000000]"),
        (with_sessions(think_s=0), "workload.sessions.think_s: got 0, expected seconds: a number ≥ 1e-06, or "
                                   "[low, high] with 1e-06 ≤ low ≤ high"),
        (with_sessions(think_s=-1.5), "workload.sessions.think_s: got -1.5, expected seconds"),
        (with_sessions(think_s=[3, 1]), "workload.sessions.think_s: got [3, 1], expected seconds"),
        (with_sessions(think_s=[0, 1]), "workload.sessions.think_s: got [0, 1], expected seconds"),
        (with_sessions(think_s=[1, 2, 3]), "workload.sessions.think_s: got [1, 2, 3], expected seconds"),
        (with_sessions(think_s="fast"), "workload.sessions.think_s: got 'fast', expected seconds"),
        (with_sessions(think_s=None), "workload.sessions.think_s: got null, expected seconds"),
        (with_sessions(think_s=float("inf")), "workload.sessions.think_s: got .inf, expected seconds"),
        (with_sessions(history="yes"), "workload.sessions.history: got 'yes', expected true or false"),
        (with_sessions(turns=3), "workload.sessions.turns: unknown key; expected one of calls, think_s, history"),
        ({"workload": {**AGENT, "sessions": 3}},
         "workload.sessions: got 3, expected a mapping with keys calls, think_s, history"),
        ({"workload": {**AGENT, "num_requests": 10}},
         "workload.num_requests: got 10, expected a multiple of workload.sessions.calls (3): it counts calls"),
        ({"workload": {**AGENT, "tenants": [{"name": "a"}]}},
         "workload.tenants: expected none with workload.sessions (sessions have no tenants)"),
        ({"workload": {**AGENT, "arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed"}}},
         "workload.arrivals.kind: got 'trace', expected a generated kind with workload.sessions"),
        ({"workload": AGENT, "scheduler": {"queue_order": "edf"}},
         "scheduler.queue_order: got 'edf', expected fcfs with workload.sessions"),
        ({"workload": AGENT, "scheduler": {"enable_prefix_caching": True}},
         "scheduler.enable_prefix_caching: got true, expected false with workload.sessions"),
        ({"workload": AGENT, "search": {"knobs": {"scheduler.queue_order": {"choices": ["fcfs", "sjf"]}}}},
         "search.knobs.scheduler.queue_order: may only be 'fcfs' with workload.sessions"),
        ({"workload": AGENT, "search": {"knobs": {"scheduler.enable_prefix_caching": {"choices": [True, False]}}}},
         "search.knobs.scheduler.enable_prefix_caching: may only be false with workload.sessions"),
    ],
)
def test_bad_sessions_are_named(data, expected):
    assert config_error(data, base_dir=FIXTURES).startswith(f"c.yaml: {expected}")


def test_cross_field_rules():
    assert config_error({"scheduler": {"long_prefill_token_threshold": 256, "enable_chunked_prefill": False}}) == (
        "c.yaml: scheduler.long_prefill_token_threshold: got 256, expected 0 when enable_chunked_prefill is false "
        "(the threshold caps prefill chunks)"
    )
    # Without a profile, the calibrated model takes the one shipped for the GPU; a GPU without one has none.
    assert config_from_dict({"cost_model": {"kind": "calibrated"}}).cost_model.profile is None
    assert config_error({"hardware": {"gpu": "l40s"}, "cost_model": {"kind": "calibrated"}}) == (
        "c.yaml: cost_model.profile: got null, expected a fitted profile for the calibrated cost model on l40s: a "
        "calibrate output (servetune calibrate), or kind: roofline (profiles are shipped for a100-80gb, h100-80gb "
        "only)"
    )
    chunked = config_from_dict({"scheduler": {"long_prefill_token_threshold": 256}})
    assert chunked.scheduler.long_prefill_token_threshold == 256
    calibrated = config_from_dict({"cost_model": {"kind": "calibrated", "profile": "llama-2-7b_a100-80gb.json"}})
    assert calibrated.cost_model.profile == "llama-2-7b_a100-80gb.json"


# --- vLLM 0.33's start-up rules, checked on the resolved config --------------------------------------------

def test_static_batching_refuses_async_scheduling():
    assert config_error({"scheduler": {"policy": "static", "async_scheduling": True}}) == (
        "c.yaml: scheduler.async_scheduling: got true, expected false or null with policy static (static batching "
        "has no vLLM engine to pipeline: it is always synchronous)")
    assert not config_from_dict({"scheduler": {"policy": "static", "async_scheduling": False}}).scheduler.pipelined
    assert not config_from_dict({"scheduler": {"policy": "static"}}).scheduler.pipelined
    assert config_from_dict({}).scheduler.pipelined   # vLLM 0.33's default for continuous batching
    assert not config_from_dict({"scheduler": {"async_scheduling": False}}).scheduler.pipelined


def refusal(data: dict) -> str:
    """The one-line error resolving ``data`` raises (source "c.yaml"); loading it alone raises nothing."""
    config = config_from_dict(data, source="c.yaml")
    with pytest.raises(ConfigError) as raised:
        resolve(config)
    message = str(raised.value)
    assert "\n" not in message
    return message


# Defaults where unset: Llama-2-7B, whose config.json allows 4,096 tokens (max_position_embeddings); 8,192 KV
# blocks of 16 tokens.
@pytest.mark.parametrize(
    "data,fragments",
    [
        ({"scheduler": {"max_num_seqs": 512, "max_num_batched_tokens": 256}},
         ["c.yaml: scheduler.max_num_batched_tokens: 256", "max_num_seqs 512",
          "max_num_batched_tokens >= max_num_seqs"]),
        ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048, "max_model_len": 4096}},
         ["c.yaml: scheduler.max_num_batched_tokens: 2048", "max_model_len 4096", "chunked prefill",
          "max_num_batched_tokens >= max_model_len"]),
        # Unset, max_model_len is the workload's ...
        ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192},
          "workload": {"max_model_len": 16384}},
         ["c.yaml: scheduler.max_num_batched_tokens: 8192", "max_model_len 16384"]),
        # ... else the model's, as vLLM's default.
        ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}},
         ["c.yaml: scheduler.max_num_batched_tokens: 2048", "max_model_len 4096"]),
        # The model's, uncapped: vLLM refuses to start when its cache cannot hold it (4,096 / 16 = 256 blocks).
        ({"scheduler": {"num_kv_blocks": 200}}, ["c.yaml: scheduler.max_model_len: 4096", "256 KV blocks",
                                                 "199 usable"]),
        ({"scheduler": {"max_model_len": 1024, "long_prefill_token_threshold": 2048}},
         ["c.yaml: scheduler.long_prefill_token_threshold: 2048", "max_model_len 1024",
          "long_prefill_token_threshold <= max_model_len"]),
        # 4,096 tokens need 4096 / 16 = 256 blocks; 256 blocks leave 255 once vLLM's null block is out.
        ({"scheduler": {"num_kv_blocks": 256, "max_model_len": 4096}},
         ["c.yaml: scheduler.max_model_len: 4096", "256 KV blocks", "255 usable"]),
        # Beyond the model's context (Llama-2-7B's config.json: max_position_embeddings 4096), from either field.
        ({"scheduler": {"max_model_len": 4097}},
         ["c.yaml: scheduler.max_model_len: got 4097, expected at most 4096", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"]),
        ({"workload": {"max_model_len": 5000}},
         ["c.yaml: workload.max_model_len: got 5000, expected at most 4096", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"]),
    ],
)
def test_knobs_vllm_would_refuse_to_start_with_are_one_line_naming_the_field_value_and_rule(data, fragments):
    message = refusal(data)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("scheduler", [
    {"max_num_seqs": 256, "max_num_batched_tokens": 256},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096, "max_model_len": 4096},
    {"max_model_len": 2048, "long_prefill_token_threshold": 2048},
    {"num_kv_blocks": 257, "max_model_len": 4096},   # 256 usable blocks hold 4,096 tokens exactly
])
def test_knobs_on_the_edge_of_vllms_rules_resolve(scheduler):
    assert resolve(config_from_dict({"scheduler": scheduler})).scheduler.vllm_refusal() is None


def test_a_derived_kv_cache_is_checked_once_resolved():
    # Llama-2-7B keeps 2 x 32 layers x 4,096 x 2 bytes = 512 KiB of KV per token: an A100-80GB holds under
    # 163,840 tokens however its memory is shared, far from 10,000,000.
    data = {"scheduler": {"num_kv_blocks": None, "max_model_len": 10_000_000}}
    assert config_from_dict(data).scheduler.num_kv_blocks is None   # derived from the model and GPU on resolving
    assert refusal(data).startswith("c.yaml: scheduler.max_model_len: 10000000 tokens need 625000 KV blocks")


@pytest.fixture
def lengthless_model(tmp_path):
    """Llama-2-7B's config.json without max_position_embeddings: a model whose context length is unknown."""
    data = json.loads((FIXTURES / "hf" / "llama-2-7b.json").read_text())
    del data["max_position_embeddings"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("scheduler_len,workload_len,resolved_len", [
    (2048, 3000, 2048),    # the scheduler's own
    (None, 3000, 3000),    # else the workload's
    (None, None, 4096),    # else the model's: Llama-2-7B's config.json has max_position_embeddings 4096
])
def test_max_model_len_resolves_from_the_scheduler_then_the_workload_then_the_model(scheduler_len, workload_len,
                                                                                   resolved_len):
    config = config_from_dict({"scheduler": {"max_model_len": scheduler_len},
                               "workload": {"max_model_len": workload_len}})
    scheduler = resolve(config).scheduler
    assert scheduler.max_model_len == scheduler.model_len_limit == resolved_len


def test_without_any_max_model_len_the_engine_takes_what_the_kv_cache_holds(lengthless_model):
    scheduler = resolve(config_from_dict({"model": lengthless_model})).scheduler
    assert scheduler.max_model_len is None
    # The cache derived for Llama-2-7B on an A100-80GB (test_cost_models.py's sizes by hand): 80 GiB x 0.92
    # = 79,027,398,246.4 B, less 13,476,298,752 B of weights and a reserve of 2,048 tokens x 82,432 B
    # + 256 seqs x 32,000 x 8 B + 1 GiB = 1,308,098,560 B, over 16 x 524,288 B a block: 7,658 blocks.
    assert scheduler.num_kv_blocks == 7658
    assert scheduler.model_len_limit == (7658 - 1) * 16   # vLLM's null block is no request's
    assert refusal({"model": lengthless_model, "scheduler": {"enable_chunked_prefill": False,
                                                             "max_num_batched_tokens": 16384}}).startswith(
        # a budget of 16,384 tokens reserves 16,384 x 82,432 B for activations: 7,517 blocks, 7,516 usable
        "c.yaml: scheduler.max_num_batched_tokens: 16384 is below max_model_len 120256")


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"schedular": {}}, "c.yaml: schedular: unknown key; did you mean scheduler?"),
        ({"scheduler": {"max_num_seq": 8}}, "c.yaml: scheduler.max_num_seq: unknown key; did you mean "
                                            "scheduler.max_num_seqs?"),
        ({"workload": {"arrivals": {"rat": 2}}}, "c.yaml: workload.arrivals.rat: unknown key; did you mean "
                                                 "workload.arrivals.rate?"),
        ({"slo": {"zzz": 1}}, "c.yaml: slo.zzz: unknown key; expected one of ttft_ms, itl_ms, tpot_ms, e2el_ms, "
                              "attainment_target"),
        ({"source": "x"}, "c.yaml: source: unknown key"),
        ({"scheduler": 64}, "c.yaml: scheduler: got 64, expected a mapping with keys policy, max_num_seqs"),
        ({"simulation": None}, "c.yaml: simulation: got null, expected a mapping with keys horizon_s"),
    ],
)
def test_unknown_keys_and_misshapen_sections_are_named(data, expected):
    assert config_error(data).startswith(expected)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("scheduler:\n  max_num_seqs: 64\n\tblock_size: 16\n",
         "line 3, column 1: invalid YAML (found character '\\t' that cannot start any token)"),
        ("scheduler: {max_num_seqs: 64\nslo: {}\n",
         "line 2, column 4: invalid YAML (expected ',' or '}', but got ':')"),
        ("scheduler:\n  max_num_seqs: 64\n  max_num_seqs: 32\n", "line 3, column 3: invalid YAML (duplicate key "
                                                                  "'max_num_seqs')"),
        ("", "the config file is empty, expected a mapping of sections such as scheduler"),
        ("- scheduler\n", "got ['scheduler'], expected a mapping of sections such as scheduler"),
    ],
)
def test_unreadable_files_are_named_with_their_position(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    assert "\n" not in message
    assert message == f"{path}: {expected}"


def test_missing_and_non_text_config_files(tmp_path):
    with pytest.raises(ConfigError, match="absent.yaml: no such config file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    (tmp_path / "binary.yaml").write_bytes(b"model: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(tmp_path / "binary.yaml")


def test_config_errors_are_user_errors_with_one_line():
    assert issubclass(ConfigError, UserError)
    assert str(ConfigError("a.yaml: line 1\n  (detail)\n")) == "a.yaml: line 1 (detail)"


def test_a_recorded_config_with_tenants_own_arrivals_loads_back_as_it_was():
    # Studies and policy files record every field, defaults included (a tenant's share of 1, the workload's
    # unused default arrivals): reading the record back must give the same config.
    config = load_config(EXAMPLES / "diurnal.yaml")
    assert config.workload.tenant_arrivals
    assert config_from_data(config_data(config), str(EXAMPLES / "diurnal.yaml")) == config


# --- the KV cache, the model and the GPU (issue 21, items 2 and 3) ------------------------------------------

def test_an_omitted_kv_cache_is_derived_as_vllm_sizes_it():
    assert SchedulerConfig().num_kv_blocks is None   # omitted means derived, not a fixed 8,192
    config = config_from_dict({})
    assert config.scheduler.num_kv_blocks is None
    # Llama-2-7B on an A100-80GB at 0.92 (test_cost_models.py's sizes by hand): 80 GiB x 0.92 = 79,027,398,246.4 B,
    # less 13,476,298,752 B of weights and 2,048 x 82,432 + 256 x 32,000 x 8 + 2^30 = 1,308,098,560 B of
    # activations (vLLM's 256 seats on an A100), over 16 x 524,288 B a block: 7,658 blocks.
    assert resolve(config).scheduler.num_kv_blocks == 7658
    # The GPU, TP and memory share change it as they change vLLM's.
    assert resolve(config_from_dict({"hardware": {"gpu_memory_utilization": 0.5}})).scheduler.num_kv_blocks < 7658
    assert resolve(config_from_dict({"hardware": {"tp": 2}})).scheduler.num_kv_blocks > 2 * 7658 - 2000


@pytest.mark.parametrize("data,expected", [
    ({"model": "llama2-7b"}, "c.yaml: model: got 'llama2-7b', expected a known model (did you mean llama-2-7b, "),
    ({"hardware": {"gpu": "h1000"}}, "c.yaml: hardware.gpu: got 'h1000', expected a known GPU (did you mean "),
    ({"hardware": {"tp": 3}}, "c.yaml: hardware.tp: got 3, expected a divisor of llama-2-7b's 32 attention heads "
                              "(vLLM splits them evenly over the GPUs)"),
    # 80 layers x 855,638,016 weights + 2 x 32,000 x 8,192 embeddings, 2 B each: 128.5 GiB on a 24 GiB GPU, with the
    # cache given; activations 2,048 x 102,400 x 2 B + 256 x 32,000 x 8 B + 1 GiB.
    ({"model": "llama-2-70b", "hardware": {"gpu": "l4"}, "scheduler": {"num_kv_blocks": 1000}},
     "c.yaml: hardware.gpu: got 'l4', expected a GPU that holds llama-2-70b at tp=1: its weights take 128.5 GiB per "
     "GPU and activations ~1.5 GiB of the 22.1 GiB that gpu_memory_utilization 0.92 allows, leaving no room for one "
     "KV block; raise tp or use a larger GPU"),
    ({"model": "./absent.json"}, f"c.yaml: model: {FIXTURES / 'absent.json'}: no such model config"),
    # A given cache beyond what all of the GPU's memory holds beside the model (8,477 blocks here).
    ({"scheduler": {"num_kv_blocks": 9000}}, "c.yaml: scheduler.num_kv_blocks: got 9000, expected at most 8,477: "
                                             "that is what llama-2-7b leaves on a100-80gb ×1 with all of its memory, "
                                             "so vLLM could not allocate more"),
    ({"scheduler": {"num_kv_blocks": 2**20, "block_size": 512}},
     "c.yaml: scheduler.num_kv_blocks: got 1048576, expected at most 524,288 blocks of block_size 512: the engine "
     "takes at most 268,435,456 KV tokens"),
])
def test_every_config_is_checked_for_a_model_and_gpu_vllm_would_refuse(data, expected):
    assert config_error(data, base_dir=FIXTURES).startswith(expected)


def test_a_search_variant_whose_model_does_not_fit_names_the_config_and_field():
    from servetune.pipeline import fill_derived

    config = config_from_dict({}, source="c.yaml")
    variant = dataclasses.replace(config, hardware=dataclasses.replace(config.hardware, tp=3))
    with pytest.raises(ConfigError, match=r"^c\.yaml: hardware\.tp: got 3, expected a divisor of llama-2-7b's 32 "):
        fill_derived(variant)


# --- fields that would do nothing (item 14) ----------------------------------------------------------------

def test_linear_coefficients_under_another_cost_model_are_refused():
    # A recorded config (config_from_dict) holds the defaults for every kind: only another value is refused there.
    assert config_error({"cost_model": {"kind": "roofline", "base_s": 0.02}}) == (
        "c.yaml: cost_model.base_s: got 0.02, expected it left out for the roofline cost model (base_s is the linear "
        "model's: set cost_model.kind: linear to use it)")
    assert config_from_dict({"cost_model": {"kind": "roofline", "base_s": 0.01}}).cost_model.kind == "roofline"


def test_a_file_that_writes_a_field_its_settings_do_not_read_is_refused_whatever_the_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cost_model: {kind: roofline, base_s: 0.01}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == (f"{path}: cost_model.base_s: got 0.01, expected it left out for the roofline cost "
                                 "model (base_s is the linear model's: set cost_model.kind: linear to use it)")
    with pytest.raises(ConfigError, match="cost_model.base_s: got 0.01, expected it left out"):
        load_config(EXAMPLES / "chat.yaml", ["cost_model.kind=roofline"])
    assert load_config(EXAMPLES / "chat.yaml", ["cost_model={kind: roofline}"]).cost_model.kind == "roofline"
    # And its recorded form reads back.
    config = load_config(EXAMPLES / "chat.yaml", ["cost_model={kind: roofline}", "search.knobs=null"])
    assert config_from_data(config_data(config), str(EXAMPLES / "chat.yaml")).cost_model == config.cost_model


@pytest.mark.parametrize("data,expected", [
    ({"cost_model": {"kind": "linear", "profile": "llama-2-7b_a100-80gb.json"}},
     "cost_model.profile: got 'llama-2-7b_a100-80gb.json', expected null for the linear cost model"),
    ({"cost_model": {"kind": "calibrated", "profile": "absent.json"}},
     "cost_model.profile: got 'absent.json', expected an existing calibrate output or one of "),
    ({"scheduler": {"batch_size": 8}}, "scheduler.batch_size: got 8, expected it left out with policy continuous "
                                       "(batch_size is for static batching)"),
    ({"scheduler": {"length_prediction_noise": 0.3}}, "scheduler.length_prediction_noise: got 0.3, expected 0 with "
                                                      "queue_order fcfs"),
    ({"workload": {"arrivals": {"kind": "trace", "path": "tiny_processed.csv", "format": "processed", "rate": 8}}},
     "workload.arrivals.rate: got 8.0, expected it left out for trace arrivals (rate is for poisson, gamma and onoff)"),
    ({"workload": {"lengths": {"kind": "empirical", "path": "tiny_processed.csv", "prompt_tokens": 100}}},
     "workload.lengths.prompt_tokens: got 100, expected it left out for empirical lengths (the counts come from the "
     "sample)"),
    ({"search": {"knobs": {"scheduler.max_wait_s": {"low": 0.1, "high": 1.0}}}},
     "search.knobs.scheduler.max_wait_s: searches a field of static batching, but scheduler.policy is continuous"),
])
def test_other_fields_their_settings_do_not_read_are_refused(data, expected):
    assert config_error(data, base_dir=FIXTURES).startswith(f"c.yaml: {expected}")


# --- what a YAML config may expand to (item 10) -------------------------------------------------------------

@pytest.mark.parametrize("text,expected", ids=["alias_bomb", "deep_nesting", "huge_string", "recursive_alias"],
                         argvalues=[
    # 9 levels of 9 aliases: 387,420,489 values from 400 bytes.
    ("".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9)),
     "line 6, column 25: the config expands to more than 200,000 values (aliases repeat what they name), expected "
     "at most 200,000"),
    ("model: " + "[" * 5000 + "]" * 5000 + "\n", "line 1, column 39: collections nested more than 32 deep, expected "
                                                 "at most 32"),
    ("model: '" + "x" * 1_000_000 + "'\n", "line 1, column 8: a value of 1,000,000 characters, expected at most "
                                           "4,096"),
    ("model: &m [*m]\n", "line 1, column 12: *m repeats a collection inside itself, expected aliases to finished "
                         "values only"),
])
def test_yaml_past_what_a_config_may_hold_is_refused_in_one_line(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"{path}: {expected}"


def test_small_yaml_anchors_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("slo: &slo {ttft_ms: 500}\nworkload:\n  tenants: [{name: a, slo: *slo}, {name: b, slo: *slo}]\n")
    assert [tenant.slo.ttft_ms for tenant in load_config(path).workload.tenants] == [500.0, 500.0]
