"""A corpus of hostile inputs, through ``servetune simulate``'s main function in-process: configs with wrong types,
out-of-range numbers, unknown keys, fields that would do nothing, YAML alias bombs and deep nesting; models and
GPUs vLLM would refuse; malformed Hugging Face config.json files; malformed traces in every supported format;
and bad ``--set`` values. Every one must exit 2 with one line that names the file (or the ``--set``), the field,
the value and what was expected, before anything is simulated. A set of valid but odd inputs must run.

The bounds come from what the engine holds (servetune/config.py): token counts in int32 (a request's prompt and
output each at most 2^24 tokens, the KV cache at most 2^28), times in float32 (the clock within 1e8 s).
"""
from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from servetune.cli import main
from servetune.config import MAX_CLOCK_S, MAX_KV_TOKENS, MAX_TOKEN_COUNT, Config, TenantConfig
from servetune.config_loader import FIELD_CHOICES, FIELD_RANGES, MAX_CONFIG_BYTES, Range
from servetune.envs.workload.lengths import LognormalSpec
from test_trace_fuzz import FORMATS, _cases as trace_cases

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAMA_CONFIG_JSON = json.loads((FIXTURES / "hf" / "llama-2-7b.json").read_text())

# Every run has the same shapes (16 requests, fcfs, a linear cost): the engine compiles once for all of them.
BASE: dict[str, Any] = {
    "model": "llama-2-7b",
    "hardware": {"gpu": "a100-80gb", "tp": 1},
    "cost_model": {"kind": "linear", "base_s": 0.01, "per_token_s": 3e-5, "per_context_token_s": 2e-7},
    "workload": {"arrivals": {"kind": "poisson", "rate": 4.0}, "lengths": {"kind": "fixed", "prompt_tokens": 64,
                                                                           "output_tokens": 16},
                 "num_requests": 16, "seed": 0},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "slo": {"ttft_ms": 800, "itl_ms": 60},
}


REMOVE = object()   # in a change: leave the key out


def merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` merged in, mapping by mapping (REMOVE leaves a key out)."""
    out = dict(base)
    for key, value in changes.items():
        if value is REMOVE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def simulate(capsys, *argv) -> tuple[int, str]:
    code = main(["simulate", *map(str, argv)])
    return code, capsys.readouterr().err


def assert_refused(capsys, argv, fragments) -> str:
    code, err = simulate(capsys, *argv)
    lines = err.strip().split("\n")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("servetune: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def write(tmp_path):
    """Write a config (a mapping, as YAML, or raw text or bytes) and return its path."""
    def write_config(content, name: str = "c.yaml") -> Path:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else yaml.safe_dump(content), encoding="utf-8")
        return path
    return write_config


# ------------------------------------------------------------------------------------------------ field values

# Where a field is read, so that a bad value of it is judged by its own rule (a gamma arrival's cv, a tenant's
# share): the config around it, with VALUE where the field goes.
VALUE = object()
CONTEXTS = {
    "workload.arrivals.cv": {"workload": {"arrivals": {"kind": "gamma", "cv": VALUE}}},
    "workload.arrivals.on_s": {"workload": {"arrivals": {"kind": "onoff", "on_s": VALUE, "off_s": 5}}},
    "workload.arrivals.off_s": {"workload": {"arrivals": {"kind": "onoff", "on_s": 5, "off_s": VALUE}}},
    "workload.arrivals.time_scale": {"workload": {"arrivals": {"kind": "piecewise", "rate": REMOVE,
                                                               "profile": [[0, 2.0]], "time_scale": VALUE}}},
    **{f"workload.arrivals.{name}": {"workload": {
        "arrivals": {"kind": "trace", "rate": REMOVE, "path": str(FIXTURES / "tiny_processed.csv"),
                     "format": "processed", name: VALUE}, "lengths": REMOVE, "num_requests": REMOVE}}
       for name in ("window_start_s", "window_s", "jitter_s")},
    **{f"workload.lengths.{side}.{part}": {"workload": {"lengths": {
        "kind": "lognormal", "prompt_tokens": {"median": 64, "sigma": 1}, "output_tokens": {"median": 16, "sigma": 1},
        side: {"median": 64, "sigma": 1, part: VALUE}}}}
       for side in ("prompt_tokens", "output_tokens") for part in ("median", "sigma")},
    "workload.sessions.calls": {"workload": {"sessions": {"calls": VALUE, "think_s": 1.0}}},
    "scheduler.batch_size": {"scheduler": {"policy": "static", "batch_size": VALUE}},
    "scheduler.max_wait_s": {"scheduler": {"policy": "static", "max_wait_s": VALUE}},
    "scheduler.length_prediction_noise": {"scheduler": {"queue_order": "sjf", "length_prediction_noise": VALUE}},
    "cost_model.kind": {"cost_model": {"kind": VALUE, "base_s": REMOVE, "per_token_s": REMOVE,
                                       "per_context_token_s": REMOVE}},
}


def placed(key: str, value: Any) -> tuple[dict, str]:
    """The base config with ``key`` set to ``value`` in its context, and the key as a message names it."""
    if key.startswith("workload.tenants."):
        name = key.rpartition(".")[2]
        return merged(BASE, {"workload": {"tenants": [{"name": "a", name: value}]}}), f"workload.tenants[0].{name}"
    if key in CONTEXTS:
        def fill(node):
            if node is VALUE:
                return value
            return {k: fill(v) for k, v in node.items()} if isinstance(node, dict) else node
        return merged(BASE, fill(CONTEXTS[key])), key
    *sections, name = key.split(".")
    changes: dict = {name: value}
    for section in reversed(sections):
        changes = {section: changes}
    return merged(BASE, changes), key


# Fields whose type hint is Any, and the dataclass their values are checked as.
CHECKED_AS = {"tenants": TenantConfig, "prompt_tokens": LognormalSpec, "output_tokens": LognormalSpec}


def field_type(key: str) -> type:
    """int or float: what a dotted key of FIELD_RANGES holds, read from the config's dataclasses."""
    section: Any = Config
    for part in key.split("."):
        hint = typing.get_type_hints(section)[part]
        if typing.get_origin(hint) is typing.Union:   # Optional[...]
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        section = CHECKED_AS.get(part, hint)
    return section


def bad_values(key: str) -> Iterator[tuple[str, Any]]:
    """Values outside a field's range, of the wrong type, and not finite; (case name, value)."""
    bounds: Range = FIELD_RANGES[key]
    integer = field_type(key) is int
    if bounds.low is not None:
        yield "below", (bounds.low if bounds.low_open else bounds.low - (1 if integer else abs(bounds.low) / 2 + 1e-9))
    if bounds.high is not None:
        yield "above", (bounds.high if bounds.high_open else (bounds.high + 1 if integer else bounds.high * 2 + 1))
    yield "huge", 10**30
    yield "text", "12"
    yield "boolean", True
    yield "list", [1, 2]
    if integer:
        yield "fraction", 1.5
    else:
        yield "nan", math.nan
        yield "infinity", math.inf


FIELD_CASES = [pytest.param(key, value, id=f"{key}-{case}") for key in FIELD_RANGES for case, value in bad_values(key)]


def test_the_field_corpus_covers_every_bounded_field():
    assert {param.values[0] for param in FIELD_CASES} == set(FIELD_RANGES)
    assert len(FIELD_CASES) > 350


@pytest.mark.parametrize("key,value", FIELD_CASES)
def test_a_bad_field_value_is_refused_naming_file_field_value_and_expectation(key, value, write, capsys):
    data, shown = placed(key, value)
    path = write(data)
    assert_refused(capsys, [path], [f"{path}: {shown}: got ", "expected"])


# Choice fields for which null is one of the choices: the model's quantisation as its config.json says.
NULLABLE_CHOICES = {"quantization"}


@pytest.mark.parametrize("key,value", [(key, value) for key in sorted(FIELD_CHOICES)
                                       for value in ("not-a-choice", 3, None)
                                       if not (value is None and key in NULLABLE_CHOICES)])
def test_a_value_outside_a_fields_choices_is_refused(key, value, write, capsys):
    if key == "workload.arrivals.format":   # a format only a trace reads
        data = merged(BASE, {"workload": {"arrivals": {"kind": "trace", "rate": REMOVE, "format": value,
                                                       "path": str(FIXTURES / "tiny_processed.csv")},
                                          "lengths": REMOVE, "num_requests": REMOVE}})
        shown = key
    else:
        data, shown = placed(key, value)
    path = write(data)
    assert_refused(capsys, [path], [f"{path}: {shown}: got ", "expected "])


@pytest.mark.parametrize("changes,key", [
    ({"schedular": {}}, "schedular"),
    ({"scheduler": {"max_num_seq": 8}}, "scheduler.max_num_seq"),
    ({"workload": {"arrivals": {"rat": 2}}}, "workload.arrivals.rat"),
    ({"workload": {"lengths": {"prompt": 2}}}, "workload.lengths.prompt"),
    ({"workload": {"tenants": [{"name": "a", "shares": 2}]}}, "workload.tenants[0].shares"),
    ({"slo": {"ttft": 100}}, "slo.ttft"),
    ({"hardware": {"gpus": 2}}, "hardware.gpus"),
    ({"cost_model": {"base": 0.1}}, "cost_model.base"),
    ({"simulation": {"horizon": 5}}, "simulation.horizon"),
    ({"rl": {"lr": 0.1}}, "rl.lr"),
    ({"search": {"trails": 5}}, "search.trails"),
    ({"source": "x.yaml"}, "source"),
    ({"k" * 3000: 1}, "k" * 60 + "..."),   # shown cut short
])
def test_an_unknown_key_is_refused_naming_it(changes, key, write, capsys):
    path = write(merged(BASE, changes))
    assert_refused(capsys, [path], [f"{path}: {key}: unknown key"])


# ------------------------------------------------------------------------------ fields that would do nothing

@pytest.mark.parametrize("changes,fragments", [
    # The linear coefficients under another cost model, whatever their value (the default ones too).
    ({"cost_model": {"kind": "roofline"}}, ["cost_model.base_s: got 0.01, expected it left out for the roofline"]),
    ({"cost_model": {"kind": "roofline", "base_s": REMOVE}},
     ["cost_model.per_token_s: got 3e-05, expected it left out for the roofline cost model"]),
    ({"cost_model": {"kind": "calibrated", "profile": "llama-2-7b_a100-80gb.json"}}, ["cost_model.base_s: got 0.01"]),
    ({"cost_model": {"profile": "llama-2-7b_a100-80gb.json"}},
     ["cost_model.profile: got 'llama-2-7b_a100-80gb.json', expected null for the linear cost model"]),
    ({"scheduler": {"batch_size": 32}}, ["scheduler.batch_size: got 32, expected it left out with policy continuous"]),
    ({"scheduler": {"max_wait_s": 0.5}}, ["scheduler.max_wait_s: got 0.5, expected it left out"]),
    ({"scheduler": {"length_prediction_noise": 0.5}},
     ["scheduler.length_prediction_noise: got 0.5, expected 0 with queue_order fcfs"]),
    ({"workload": {"arrivals": {"kind": "trace", "path": str(FIXTURES / "tiny_processed.csv"), "format": "processed"},
                   "lengths": REMOVE, "num_requests": REMOVE}},
     ["workload.arrivals.rate: got 4.0, expected it left out for trace arrivals (rate is for poisson, gamma and "
      "onoff)"]),
    ({"workload": {"lengths": {"kind": "empirical", "path": str(FIXTURES.parent.parent / "examples" / "lengths" /
                                                                "sharegpt_sample.csv")}}},
     ["workload.lengths.prompt_tokens: got 64, expected it left out for empirical lengths"]),
    ({"search": {"knobs": {"scheduler.batch_size": {"low": 1, "high": 64}}}},
     ["search.knobs.scheduler.batch_size: searches a field of static batching, but scheduler.policy is continuous"]),
])
def test_a_field_that_would_do_nothing_is_refused(changes, fragments, write, capsys):
    path = write(merged(BASE, changes))
    assert_refused(capsys, [path], [f"{path}: ", *fragments])


# ----------------------------------------------------------------------------------- what the YAML may hold

def alias_bomb(levels: int, width: int = 9) -> str:
    """The billion laughs: each level an anchored list of `width` aliases to the previous level."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


YAML_CASES = [
    ("alias_bomb", alias_bomb(9), ["expands to more than 200,000 values", "aliases repeat"]),
    ("alias_bomb_in_a_section", "workload:\n" + "".join(f"  {line}\n" for line in alias_bomb(9).splitlines()),
     ["expands to more than 200,000 values"]),
    ("wide_alias_bomb", alias_bomb(4, width=500), ["expands to more than 200,000 values"]),
    ("recursive_alias", "model: &a [*a]\n", ["*a repeats a collection inside itself"]),
    ("recursive_mapping", "scheduler: &s {inner: *s}\n", ["*s repeats a collection inside itself"]),
    ("deep_lists", "model: " + "[" * 5000 + "]" * 5000 + "\n", ["nested more than 32 deep"]),
    ("deep_mappings", "model: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", ["nested more than 32 deep"]),
    ("deep_block_mappings", "".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + "  " * 40 + "v\n",
     ["nested more than 32 deep"]),
    ("huge_string", "model: '" + "x" * 1_000_000 + "'\n", ["a value of 1,000,000 characters, expected at most 4,096"]),
    ("huge_key", "scheduler:\n  ? " + "k" * 100_000 + "\n  : 1\n", ["a value of 100,000 characters"]),
    ("number_with_thousands_of_digits", "workload: {seed: " + "9" * 5000 + "}\n", ["a value of 5,000 characters"]),
    ("empty", "", ["the config file is empty"]),
    ("only_a_comment", "# nothing\n", ["the config file is empty"]),
    ("a_list", "- scheduler\n", ["got ['scheduler'], expected a mapping of sections"]),
    ("a_scalar", "42\n", ["got 42, expected a mapping of sections"]),
    ("a_section_that_is_a_list", "scheduler: [1, 2]\n", ["scheduler: got [1, 2], expected a mapping with keys"]),
    ("duplicate_key", "scheduler: {max_num_seqs: 8, max_num_seqs: 9}\n", ["duplicate key 'max_num_seqs'"]),
    ("two_documents", "scheduler: {}\n---\nslo: {}\n", ["invalid YAML"]),
    ("undefined_alias", "scheduler: *nowhere\n", ["found undefined alias"]),
    ("a_tab", "scheduler:\n\tmax_num_seqs: 8\n", ["invalid YAML"]),
    ("unclosed_flow", "scheduler: {max_num_seqs: 8\n", ["invalid YAML"]),
    ("a_list_as_a_key", "? [a, b]\n: 1\n", ["invalid YAML"]),
    ("a_nul_in_a_name", 'model: "a\\0b"\n', ["model: got 'a\\x00b', expected"]),
    ("not_utf8", b"model: \xff\xfe\n", ["not UTF-8 text"]),
    ("binary", bytes(range(256)) * 4, ["not UTF-8 text"]),
    ("too_large", "# " + "x" * (MAX_CONFIG_BYTES + 1) + "\n", ["bytes, expected a config of at most 4,194,304"]),
]


@pytest.mark.parametrize("text,fragments", [pytest.param(text, fragments, id=case)
                                            for case, text, fragments in YAML_CASES])
def test_yaml_that_expands_or_nests_past_the_limits_or_is_no_config_is_one_line(text, fragments, write, capsys):
    path = write(text)
    assert_refused(capsys, [path], [f"{path}: ", *fragments])


def test_a_config_that_is_a_folder_or_missing_is_one_line(tmp_path, capsys):
    assert_refused(capsys, [tmp_path], [f"{tmp_path}: is a folder, expected a YAML config file"])
    assert_refused(capsys, [tmp_path / "absent.yaml"], [f"{tmp_path / 'absent.yaml'}: no such config file"])


# --------------------------------------------------------------------------------- models, GPUs, the KV cache

@pytest.mark.parametrize("changes,fragments", [
    ({"model": "llama-9"}, ["model: got 'llama-9', expected a known model (did you mean"]),
    ({"model": 7}, ["model: got 7, expected a non-empty string"]),
    ({"hardware": {"gpu": "h1000"}}, ["hardware.gpu: got 'h1000', expected a known GPU (did you mean h100-80gb"]),
    ({"hardware": {"tp": 3}}, ["hardware.tp: got 3, expected a divisor of llama-2-7b's 32 attention heads"]),
    ({"hardware": {"tp": 64}}, ["hardware.tp: got 64, expected a divisor of llama-2-7b's 32 attention heads"]),
    ({"model": "qwen2.5-7b", "hardware": {"tp": 7}}, ["hardware.tp: got 7, expected a multiple of qwen2.5-7b's 4 "
                                                       "key/value heads"]),
    # Llama-2-70B's 128.5 GiB of weights on one 24 GiB L4, with the cache given or derived, linear cost or not.
    ({"model": "llama-2-70b", "hardware": {"gpu": "l4"}}, ["hardware.gpu: got 'l4', expected a GPU that holds "
                                                            "llama-2-70b at tp=1"]),
    ({"model": "llama-2-70b", "hardware": {"gpu": "l4"}, "scheduler": {"num_kv_blocks": 100}},
     ["hardware.gpu: got 'l4'", "raise tp or use a larger GPU"]),
    ({"hardware": {"gpu_memory_utilization": 0.1}}, ["hardware.gpu: got 'a100-80gb'", "gpu_memory_utilization 0.1"]),
    # The whole of an A100-80GB holds 8,483 blocks of Llama-2-7B beside its weights and activations.
    ({"scheduler": {"num_kv_blocks": 100_000}}, ["scheduler.num_kv_blocks: got 100000, expected at most 8,483"]),
    ({"scheduler": {"num_kv_blocks": 2**20, "block_size": 512}},
     [f"scheduler.num_kv_blocks: got 1048576, expected at most {MAX_KV_TOKENS // 512:,} blocks of block_size 512"]),
    ({"model": "./absent/config.json"}, ["model: ", "absent/config.json: no such model config"]),
    ({"model": "./"}, ["model: ", "config.json: no such model config"]),
])
def test_a_model_or_gpu_vllm_would_refuse_is_refused_whatever_the_cost_model(changes, fragments, write, capsys):
    path = write(merged(BASE, changes))
    assert_refused(capsys, [path], [f"{path}: ", *fragments])


def hf_variants() -> Iterator[tuple[str, Any, list[str]]]:
    """(case, the config.json's content or raw text, fragments of the message)."""
    def changed(**changes):
        data = dict(LLAMA_CONFIG_JSON)
        for key, value in changes.items():
            if value is None:
                data.pop(key)
            else:
                data[key] = value
        return json.dumps(data)
    yield "broken_json", '{"num_hidden_layers": 32,', ["not valid JSON"]
    yield "deep_json", "[" * 100_000 + "]" * 100_000, ["nesting too deep"]
    yield "a_list", "[1, 2]", ["got [1, 2], expected a Hugging Face config.json"]
    yield "empty", "", ["not valid JSON"]
    yield "not_utf8", b"\xff\xfe{}", ["not UTF-8 text"]
    yield "huge_number", '{"num_hidden_layers": 1' + "0" * 5000 + "}", ["a number with too many digits"]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        yield f"no_{key}", changed(**{key: None}), [f"{key}", "missing, expected a positive integer"]
        for bad in (0, -4, 2.5, True, "32", 10**30):
            yield f"{key}_{bad!r}"[:40], changed(**{key: bad}), [f"{key}: got ", "expected an integer in [1, "]
    yield "moe", changed(num_local_experts=8), ["num_experts_per_tok / experts_per_token / moe_top_k: missing"]
    yield "kv_heads_not_dividing", changed(num_key_value_heads=5), ["num_key_value_heads: got 5 key/value heads"]
    yield "hidden_not_splitting", changed(hidden_size=4097), ["hidden_size: got 4097, expected a multiple"]
    yield "rope_not_an_object", changed(rope_scaling=[1, 2]), ["rope_scaling: got [1, 2], expected a JSON object"]
    for factor in ("x", -2, math.nan, math.inf, 1e300):
        yield f"rope_factor_{factor}", changed(rope_scaling={"type": "linear", "factor": factor}), \
            ["rope_scaling.factor: got "]
    for length in ("4k", 1, 2**60):
        yield f"context_{length}", changed(max_position_embeddings=length), ["max_position_embeddings: got "]
    yield "tied_as_text", changed(tie_word_embeddings="yes"), ['tie_word_embeddings: got "yes", expected true or false']
    # A context past the engine's 2^24 tokens, which max_model_len left unset would take as vLLM does.
    yield "context_past_the_engine", changed(max_position_embeddings=2**30), \
        ["scheduler.max_model_len: got null, expected a length ≤ 16,777,216"]
    # Dimensions that fit their bounds but not the GPU.
    yield "too_big_for_the_gpu", changed(num_hidden_layers=2**20), ["hardware.gpu: got 'a100-80gb', expected a GPU "
                                                                    "that holds"]


@pytest.mark.parametrize("content,fragments", [pytest.param(content, fragments, id=case)
                                               for case, content, fragments in hf_variants()])
def test_a_malformed_hugging_face_config_json_is_refused_naming_the_config_and_the_json(content, fragments, tmp_path,
                                                                                          write, capsys):
    model = tmp_path / "model" / "config.json"
    model.parent.mkdir()
    (model.write_bytes if isinstance(content, bytes) else model.write_text)(content)
    path = write(merged(BASE, {"model": "./model"}))
    assert_refused(capsys, [path], [f"{path}: ", *fragments])


# ----------------------------------------------------------------------------------------------------- traces

def trace_config(write, trace: Path, format: str, **arrivals) -> Path:
    return write(merged(BASE, {"workload": {"arrivals": {"kind": "trace", "rate": REMOVE, "path": str(trace),
                                                         "format": format, **arrivals},
                                            "lengths": REMOVE, "num_requests": REMOVE}}))


TRACE_CASES = [pytest.param(name, content, fragments, id=f"{name}-{case}")
               for name, fmt in FORMATS.items() for case, (content, fragments) in trace_cases(fmt).items()]


@pytest.mark.parametrize("format,content,fragments", TRACE_CASES)
def test_a_malformed_trace_in_any_format_is_refused_naming_the_trace(format, content, fragments, tmp_path, write,
                                                                      capsys):
    trace = tmp_path / f"trace.{format}"
    (trace.write_bytes if isinstance(content, bytes) else trace.write_text)(content)
    assert_refused(capsys, [trace_config(write, trace, format)], [f"{trace}", *fragments])


SERVEGEN_CASES = [
    ("0,-1,1,Gamma,1,1\n", ["row 1", "rate: got '-1', expected a number in [0, 1e+06]"]),
    ("0,1e9,1,Gamma,1,1\n", ["rate: got '1e9'"]),
    ("1e12,1,1,Gamma,1,1\n", ["window_start_s: got '1e12', expected a number of seconds in [0, 1e+08]"]),
    ("0,1,1,Pareto,1,1\n", ["distribution: got 'Pareto', expected one of Gamma, Weibull"]),
    ("0,1,1,Gamma,0,1\n", ["shape: got '0', expected a number > 0"]),
    ("0,1,1,Gamma,nan,1\n", ["shape: got 'nan'"]),
    ("0,1,1,Gamma,1\n", ["got 5 fields, expected 6"]),
    ("600,1,1,Gamma,1,1\n0,1,1,Gamma,1,1\n", ["row 2", "window_start_s: got '0'"]),
    ("0,0,0,,0,0\n", ["every window's rate is 0"]),
    ("", ["the ServeGen trace has no windows"]),
    (b"0,1,1,Gam\xffma,1,1\n", ["not UTF-8"]),
]


@pytest.mark.parametrize("content,fragments", SERVEGEN_CASES)
def test_a_malformed_servegen_trace_is_refused_naming_it(content, fragments, tmp_path, write, capsys):
    trace = tmp_path / "servegen.csv"
    (trace.write_bytes if isinstance(content, bytes) else trace.write_text)(content)
    path = write(merged(BASE, {"workload": {"arrivals": {"kind": "servegen", "rate": REMOVE, "path": str(trace)}}}))
    assert_refused(capsys, [path], [f"{trace}", *fragments])


LENGTH_SAMPLE_CASES = [
    ("num_prefill_tokens\n5\n", ["lacks num_decode_tokens"]),
    ("num_prefill_tokens,num_decode_tokens\n", ["the length sample has no rows"]),
    ("num_prefill_tokens,num_decode_tokens\n0,5\n", ["row 1", "num_prefill_tokens: got '0', expected an integer in "
                                                     "[1, 16777216]"]),
    (f"num_prefill_tokens,num_decode_tokens\n{MAX_TOKEN_COUNT + 1},5\n", [f"got '{MAX_TOKEN_COUNT + 1}'"]),
    ("num_prefill_tokens,num_decode_tokens\n5,x\n", ["num_decode_tokens: got 'x'"]),
    ("num_prefill_tokens,num_decode_tokens\n5,6,7\n", ["got 3 fields, expected 2"]),
    (b"num_prefill_tokens,num_decode_tokens\n5,\xff\n", ["not UTF-8"]),
]


@pytest.mark.parametrize("content,fragments", LENGTH_SAMPLE_CASES)
def test_a_malformed_length_sample_is_refused_naming_it(content, fragments, tmp_path, write, capsys):
    sample = tmp_path / "lengths.csv"
    (sample.write_bytes if isinstance(content, bytes) else sample.write_text)(content)
    path = write(merged(BASE, {"workload": {"lengths": {"kind": "empirical", "path": str(sample),
                                                        "prompt_tokens": REMOVE, "output_tokens": REMOVE}}}))
    assert_refused(capsys, [path], [f"{sample}", *fragments])


# ------------------------------------------------------------------------ workloads past the engine's range

@pytest.mark.parametrize("changes,fragments", [
    # 2,000 arrivals at 1e-5 req/s take about 2e8 s, past the clock's 1e8.
    ({"workload": {"arrivals": {"rate": 1e-5}, "num_requests": 2000}},
     ["workload.arrivals: request ", "expected every arrival within 1e+08 s of simulated time"]),
    ({"workload": {"arrivals": {"rate_scale": 1e-6}, "num_requests": 2000}}, ["workload.arrivals: request "]),
    ({"workload": {"arrivals": {"kind": "onoff", "rate": 1e-3, "on_s": 1, "off_s": 1e8}}},
     ["workload.arrivals: request "]),
    ({"workload": {"tenants": [{"name": "slow", "arrivals": {"kind": "poisson", "rate": 1e-6}}],
                   "arrivals": REMOVE, "num_requests": 1000}}, ["workload.tenants[0].arrivals: request "]),
    # 100,000 requests of 4,000 tokens: 4e8 tokens, past the 2^28 a run's int32 counters take.
    ({"workload": {"num_requests": 100_000, "lengths": {"prompt_tokens": 3000, "output_tokens": 1000}}},
     ["workload: 100,000 requests of 400,000,000 prompt and output tokens in all, expected at most 268,435,456"]),
    # A profile that ends, drawn whole, expecting more arrivals than a workload holds.
    ({"workload": {"arrivals": {"kind": "piecewise", "rate": REMOVE, "profile": [[0, 1e6], [1e5, 0]]},
                   "num_requests": None}},
     ["workload.arrivals.profile: expects 1e+11 arrivals before its last rate 0, expected at most 10,000,000"]),
])
def test_a_drawn_workload_past_the_engines_range_is_refused_before_simulating(changes, fragments, write, capsys):
    path = write(merged(BASE, changes))
    assert_refused(capsys, [path], [f"{path}: ", *fragments])


def test_a_servegen_scale_that_floods_a_window_is_refused(tmp_path, write, capsys):
    trace = tmp_path / "servegen.csv"
    trace.write_text("0,100,1,Gamma,1,1\n")
    path = write(merged(BASE, {"workload": {"arrivals": {"kind": "servegen", "rate": REMOVE, "path": str(trace),
                                                         "rate_scale": 1e6}}}))
    assert_refused(capsys, [path], [f"{path}: workload.arrivals.rate_scale: got 1e+06, expected a scale at which "
                                    f"each window of {trace} brings at most 10,000,000 requests"])


# ------------------------------------------------------------------------------------------------------ --set

@pytest.mark.parametrize("override,fragments", [
    ("scheduler.max_num_seqs", ["--set scheduler.max_num_seqs: expected KEY=VALUE"]),
    ("=3", ["--set =3: expected KEY=VALUE"]),
    ("scheduler.max_num_seq=3", ["--set scheduler.max_num_seq=3: scheduler.max_num_seq: unknown key"]),
    ("scheduler.max_num_seqs.x=3", ["scheduler.max_num_seqs is a value, not a section"]),
    ("scheduler.max_num_seqs=[1,", ["--set scheduler.max_num_seqs=[1,: ", "invalid YAML"]),
    ("scheduler.max_num_seqs=1e3", ["scheduler.max_num_seqs: got 1000.0, expected an integer",
                                    "(from --set scheduler.max_num_seqs=1e3)"]),
    ("scheduler.max_num_seqs=100000", ["scheduler.max_num_seqs: got 100000, expected an integer in [1, 65536]"]),
    ("scheduler.max_num_seqs=null", ["scheduler.max_num_seqs: got null"]),
    ("scheduler.max_num_seqs=", ["scheduler.max_num_seqs: got null"]),
    ("scheduler=5", ["scheduler: got 5, expected a mapping"]),
    ("model=", ["model: got null, expected a non-empty string"]),
    ("workload.tenants=5", ["workload.tenants: got 5, expected a non-empty list of tenants"]),
    ("workload.arrivals.rate=.nan", ["workload.arrivals.rate: got .nan"]),
    ("workload.arrivals.rate=1e-40", ["workload.arrivals.rate: got 1e-40, expected a finite number in [1e-06, "
                                      "1e+06]"]),
    ("simulation.horizon_s=1e300", ["simulation.horizon_s: got 1e+300"]),
    ("workload.lengths.prompt_tokens=2147483647", ["workload.lengths.prompt_tokens: got 2147483647, expected an "
                                                   "integer in [1, 16777216]"]),
    ("scheduler.num_kv_blocks=1000000000000", ["scheduler.num_kv_blocks: got 1000000000000"]),
    ("scheduler.block_size=10000000000", ["scheduler.block_size: got 10000000000"]),
    ("scheduler.max_num_batched_tokens=1000000000000", ["scheduler.max_num_batched_tokens: got 1000000000000"]),
    ("workload.num_requests=10000000000000", ["workload.num_requests: got 10000000000000"]),
    ("search.seed=4294967296", ["search.seed: got 4294967296, expected an integer in [0, 4294967295]"]),
    ("model=" + "x" * 5000, ["characters, expected at most 4,096"]),
    ("scheduler.max_num_seqs=" + "[" * 100 + "]" * 100, ["nested more than 32 deep"]),
    ("cost_model.kind=roofline", ["cost_model.base_s: got 0.01, expected it left out for the roofline cost model"]),
])
def test_a_bad_override_is_refused_naming_it(override, fragments, write, capsys):
    path = write(BASE)
    assert_refused(capsys, [path, "--set", override], fragments)


def test_a_trace_slowed_past_the_engines_clock_is_refused(tmp_path, write, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n1000,10,5\n")
    # 1,000 s at a millionth of the rate: 1e9 s.
    path = trace_config(write, trace, "processed", rate_scale=1e-6)
    assert_refused(capsys, [path], [f"{path}: workload.arrivals: request 2 of 2 arrives at 1e+09 s, expected every "
                                    "arrival within 1e+08 s"])


def test_an_alias_bomb_in_an_override_is_refused(write, capsys):
    bomb = "{" + ", ".join(alias_bomb(9).strip().split("\n")) + "}"
    assert_refused(capsys, [write(BASE), "--set", f"search.scenarios={bomb}"],
                   ["--set search.scenarios=", "expands to more than 200,000 values"])


# --------------------------------------------------------------------------------- valid but odd: they run

ODD_BUT_VALID = {
    "derived_cache": {},   # no num_kv_blocks: derived from the model and GPU as vLLM sizes it
    "the_slowest_rate": {"workload": {"arrivals": {"rate": 1e-6}}},   # 16 arrivals over ~1.6e7 s
    "the_fastest_rate": {"workload": {"arrivals": {"rate": 1e6}}},
    "free_steps": {"cost_model": {"base_s": 0, "per_token_s": 0, "per_context_token_s": 0}},
    "the_smallest_model_len": {"scheduler": {"max_model_len": 2},
                               "workload": {"lengths": {"prompt_tokens": 1, "output_tokens": 1}}},
    "prompts_at_the_token_limit_cut_to_the_model": {"workload": {"lengths": {"prompt_tokens": MAX_TOKEN_COUNT},
                                                                 "max_model_len": 4096}},
    "one_token_blocks": {"scheduler": {"block_size": 1}},
    "the_longest_horizon_and_slos": {"simulation": {"horizon_s": MAX_CLOCK_S},
                                     "slo": {"ttft_ms": MAX_CLOCK_S * 1000, "itl_ms": MAX_CLOCK_S * 1000}},
    "unicode_tenants": {"workload": {"tenants": [{"name": "チーム", "share": 1},
                                                 {"name": "équipe ☕", "share": 3}]}},
    "a_config_json_model": {"model": str(FIXTURES / "hf" / "llama-2-7b.json")},
    "the_largest_seed": {"workload": {"seed": 2**32 - 1}},
    "a_nearly_full_watermark": {"scheduler": {"watermark": 0.99}},
}


def test_odd_but_valid_configs_run(write, capsys):
    for case, changes in ODD_BUT_VALID.items():
        code, err = simulate(capsys, write(merged(BASE, changes), f"{case}.yaml"))
        assert code == 0, (case, err)


def test_yaml_anchors_that_stay_small_are_fine(write, capsys):
    path = write("""model: llama-2-7b
cost_model: {kind: linear, base_s: 0.01, per_token_s: 3.0e-5, per_context_token_s: 2.0e-7}
slo: &tight {ttft_ms: 800, itl_ms: 60}
workload:
  arrivals: {kind: poisson, rate: 4.0}
  lengths: &short {kind: fixed, prompt_tokens: 64, output_tokens: 16}
  num_requests: 16
  tenants:
    - {name: a, slo: *tight, lengths: *short}
    - {name: b, slo: *tight}
""")
    assert simulate(capsys, path)[0] == 0
