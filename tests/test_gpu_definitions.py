"""GPUs the catalogue lacks (``hardware.gpu`` as a mapping or a file, ``--gpu FILE``) and the catalogue's B200, H20
and MI300X entries against their datasheets (issue 20)."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

from servetune.cli import main
from servetune.config import GpuDefinition
from servetune.config_loader import config_from_dict, load_config
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.factory import build_cost_model
from servetune.cost_models.gpus import GIB, GPUS
from servetune.cost_models.roofline import Calibration, build_roofline_params, step_time_s
from servetune.errors import ConfigError
from servetune.pipeline import resolve, simulate_config
from servetune.search.provenance import config_data, config_from_data, config_hash
from servetune.types import StepBatch
from servetune.vllm_defaults import vllm_default_knobs

# The H100 SXM's datasheet numbers (cost_models/gpus.py, [H100]) under another name: a GPU of the user's own.
MY_H100 = {"name": "my-h100", "memory_gib": 80, "memory_gb_per_s": 3350, "bf16_tflops": 989, "fp8_tflops": 1979,
           "int8_tops": 1979, "interconnect_gb_per_s": 900}
MY_H100_YAML = "\n".join(f"{key}: {value}" for key, value in MY_H100.items()) + "\n"
# A small run that the roofline costs: every step's time comes from the GPU's numbers.
TINY = {"model": "llama-2-7b", "cost_model": {"kind": "roofline"},
        "workload": {"arrivals": {"kind": "poisson", "rate": 40.0}, "num_requests": 12,
                     "lengths": {"kind": "fixed", "prompt_tokens": 96, "output_tokens": 12}},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}


def _with_gpu(gpu, **hardware) -> dict:
    return {**TINY, "hardware": {"gpu": gpu, **hardware}}


def _errors(data: dict, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data, source="c.yaml", **kwargs)
    return list(raised.value.lines)


def _comparable(metrics: dict) -> dict:
    return {key: "nan" if isinstance(value, float) and math.isnan(value) else value for key, value in metrics.items()}


# --- a GPU of one's own runs as the catalogue GPU with the same numbers ------------------------------------------

def test_a_defined_gpu_inline_and_in_files_simulates_as_the_catalogue_gpu_with_its_numbers(tmp_path):
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "my-h100.yaml").write_text(MY_H100_YAML)
    (tmp_path / "my-h100.json").write_text(json.dumps(MY_H100))
    config_file = tmp_path / "c.yaml"
    config_file.write_text(json.dumps(_with_gpu("gpus/my-h100.yaml")))   # a path relative to the config's folder
    configs = {"catalogue": config_from_dict(_with_gpu("h100-80gb"), source="c.yaml"),
               "inline": config_from_dict(_with_gpu(MY_H100), source="c.yaml"),
               "yaml file": load_config(config_file),
               "json file, --set": load_config(config_file, [f"hardware.gpu={tmp_path / 'my-h100.json'}"])}
    for name, config in configs.items():
        if name != "catalogue":
            assert config.hardware.gpu == GpuDefinition(**MY_H100), name
    # The KV cache as vLLM sizes it, by hand (test_config.py's sizing for 80 GiB): 80 GiB x 0.92, less 13,476,298,752
    # B of Llama-2-7B weights and 256 x 82,432 + 8 x 32,000 x 8 + 2^30 B of activations, over 16 x 524,288 B a block.
    blocks = int((80 * GIB * 0.92 - 13_476_298_752 - (256 * 82_432 + 8 * 32_000 * 8 + 2**30)) // (16 * 524_288))
    assert blocks == 7683
    assert {name: resolve(config).scheduler.num_kv_blocks for name, config in configs.items()} == \
        dict.fromkeys(configs, blocks)
    # Every number the roofline reads, and so every step's cost.
    leaves = {name: jax.tree_util.tree_leaves(build_cost_model(config)[1]) for name, config in configs.items()}
    for name, values in leaves.items():
        assert [float(v) for v in values] == [float(v) for v in leaves["catalogue"]], name
    runs = {name: simulate_config(config) for name, config in configs.items()}
    assert runs["catalogue"].metrics["completed"] == 12 and runs["catalogue"].metrics["mean_ttft_ms"] > 0
    for name, run in runs.items():
        assert _comparable(run.metrics) == _comparable(runs["catalogue"].metrics), name


def test_a_defined_gpu_is_the_catalogue_entry_in_the_catalogue_units():
    spec = resolve_gpu(GpuDefinition(**MY_H100))
    catalogue = GPUS["h100-80gb"]
    assert spec.memory_bytes == 80 * 2**30 and spec.memory_bytes_per_s == 3.35e12 and spec.peak_flops_per_s == 989e12
    assert dataclasses.replace(spec, name=catalogue.name, description=catalogue.description,
                               interconnect=catalogue.interconnect, source=catalogue.source) == catalogue
    # Step costs at TP 2, where the all-reduce reads the interconnect.
    llama = resolve_model("llama-2-7b")
    step = StepBatch(*(jnp.float32(x) for x in (1, 512, 512, 512 * 256, 512 * 256, 16, 16 * 1025)))
    ours, theirs = (float(step_time_s(build_roofline_params(llama, gpu, 2, Calibration()), step))
                    for gpu in (spec, catalogue))
    assert ours == theirs > 0
    # null rates: a GPU without FP8 or INT8 tensor cores, as the catalogue's A10G
    bare = resolve_gpu(GpuDefinition(**{**MY_H100, "fp8_tflops": None, "int8_tops": None}))
    assert bare.peak_fp8_flops_per_s is None and bare.peak_int8_ops_per_s is None


def test_the_hash_follows_the_definition_and_a_record_needs_no_file(tmp_path):
    gpu_file = tmp_path / "gpu.yaml"
    gpu_file.write_text(MY_H100_YAML)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(json.dumps(_with_gpu("gpu.yaml")))
    first = load_config(config_file)
    assert config_hash(load_config(config_file)) == config_hash(first)
    gpu_file.write_text(MY_H100_YAML.replace("3350", "3351"))
    assert config_hash(load_config(config_file)) != config_hash(first)
    record = config_data(first)
    assert record["hardware"]["gpu"] == {**MY_H100, "description": None}
    gpu_file.unlink()   # a recorded config holds the definition, not the file's path
    assert config_from_data(record, str(config_file)) == first


def test_a_scenarios_gpu_file_is_read_from_the_configs_folder(tmp_path, monkeypatch):
    from servetune.search.study.scenarios import variants

    (tmp_path / "my-h100.yaml").write_text(MY_H100_YAML)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(json.dumps({**_with_gpu("h100-80gb"), "search": {
        "scenarios": [{"hardware.gpu": "my-h100.yaml"}, {"hardware.gpu": "b200"}]}}))
    monkeypatch.chdir(tmp_path.parent)   # elsewhere: the variants are built away from the file
    config = load_config(config_file)
    assert [variant.config.hardware.gpu_name for variant in variants(config)] == ["my-h100", "b200"]
    assert config_from_data(config_data(config), str(config_file)) == config


# --- bad definitions ------------------------------------------------------------------------------------------

def test_every_bad_field_of_a_definition_is_one_line_naming_it_and_its_range():
    bad = {"name": "my gpu", "memory_gib": 0, "memory_gb_per_s": 2e6, "bf16_tflops": "fast", "fp8_tflops": -1,
           "interconnect_gb_per_s": 900, "memroy_gib": 80}
    assert _errors(_with_gpu(bad)) == [
        "c.yaml: hardware.gpu.name: got 'my gpu', expected a name of at most 64 letters, digits, '.', '_' and '-', "
        "starting with a letter or digit, such as my-gpu",
        "c.yaml: hardware.gpu.memory_gib: got 0, expected a finite number in [1, 65536]",
        "c.yaml: hardware.gpu.memory_gb_per_s: got 2000000.0, expected a finite number in [1, 1e+06]",
        "c.yaml: hardware.gpu.bf16_tflops: got 'fast', expected a finite number in [0.1, 1e+06]",
        "c.yaml: hardware.gpu.fp8_tflops: got -1, expected a number in [0.1, 1e+06], or null for a GPU without such "
        "tensor cores",
        "c.yaml: hardware.gpu.int8_tops: missing; expected a number in [0.1, 1e+06], or null for a GPU without such "
        "tensor cores",
        "c.yaml: hardware.gpu.memroy_gib: unknown key; did you mean hardware.gpu.memory_gib?",
    ]


def test_a_bad_gpu_file_names_the_file_and_each_field(tmp_path):
    (tmp_path / "gpu.json").write_text(json.dumps({**MY_H100, "bf16_tflops": 0, "memory_gib": 1e9}))
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    assert _errors(_with_gpu("gpu.json"), base_dir=tmp_path) == [
        f"{tmp_path / 'gpu.json'}: memory_gib: got 1000000000.0, expected a finite number in [1, 65536]",
        f"{tmp_path / 'gpu.json'}: bf16_tflops: got 0, expected a finite number in [0.1, 1e+06]",
    ]
    assert _errors(_with_gpu("list.yaml"), base_dir=tmp_path) == [
        f"{tmp_path / 'list.yaml'}: got [1, 2], expected a mapping with keys name, memory_gib, memory_gb_per_s, "
        "bf16_tflops, fp8_tflops, int8_tops, interconnect_gb_per_s, description"]
    assert _errors(_with_gpu("absent.yml"), base_dir=tmp_path) == [
        f"c.yaml: hardware.gpu: got 'absent.yml', expected an existing YAML or JSON file defining a GPU (no file "
        f"{tmp_path / 'absent.yml'})"]


def test_a_defined_gpu_may_not_take_a_catalogue_name():
    assert _errors(_with_gpu({**MY_H100, "name": "H100"})) == [
        "c.yaml: hardware.gpu.name: got 'H100', expected a name no catalogue GPU has (h100-80gb is the catalogue's "
        "H100 SXM5 80GB; give its name alone to use it)"]


def test_a_gpu_knob_takes_catalogue_names_only():
    knob = {"search": {"knobs": {"hardware.gpu": {"choices": ["h100-80gb", "my-gpu.yaml"]}}}}
    assert _errors({**knob, "hardware": {"gpu": "a100-80gb"}}) == [
        "c.yaml: search.knobs.hardware.gpu.choices: got 'my-gpu.yaml', expected a catalogue GPU name (servetune "
        "gpus); a GPU of your own can be a search.scenarios entry instead"]
    ranged = {"search": {"knobs": {"hardware.gpu": {"low": 1, "high": 2}}}}
    assert _errors(ranged) == ["c.yaml: search.knobs.hardware.gpu: got {low: 1, high: 2}, expected {choices: [...]}: "
                               "a list of catalogue GPU names"]
    names = config_from_dict({"search": {"knobs": {"hardware.gpu": {"choices": ["h100-80gb", "b200"]}}}})
    assert dict(names.search.knobs)["hardware.gpu"].choices == ("h100-80gb", "b200")


def test_gpu_flag_takes_a_file_and_reports_its_bad_fields(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-h100.yaml").write_text(MY_H100_YAML)
    printed = {}
    for gpu in ("h100-80gb", "my-h100.yaml"):
        for command in (["memory"], ["cost", "--decode-batch", "8", "--prefill-tokens", "256", "--tp", "2"]):
            assert main([*command, "--gpu", gpu, "--json"]) == 0
            printed[gpu, command[0]] = json.loads(capsys.readouterr().out)
    for command in ("memory", "cost"):
        ours, theirs = printed["my-h100.yaml", command], printed["h100-80gb", command]
        assert ours.pop("gpu") == "my-h100" and theirs.pop("gpu") == "h100-80gb"
        assert ours == theirs, command
    (tmp_path / "bad.yaml").write_text(MY_H100_YAML.replace("989", "-989").replace("int8_tops: 1979\n", ""))
    assert main(["memory", "--gpu", "bad.yaml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "servetune: error: --gpu bad.yaml: bf16_tflops: got -989, expected a finite number in [0.1, 1e+06]",
        "servetune: error: --gpu bad.yaml: int8_tops: missing; expected a number in [0.1, 1e+06], or null for a GPU "
        "without such tensor cores"]


def test_vllm_defaults_follow_a_defined_gpus_memory_and_name():
    # vLLM 0.33 (../shared/reference/engines.md): 1,024 seats and 8,192 tokens from 70 GiB on, except on an A100.
    def seats(**changes) -> int:
        config = config_from_dict({"hardware": {"gpu": {**MY_H100, **changes}}})
        return vllm_default_knobs(config)["scheduler.max_num_seqs"]

    assert seats() == 1024
    assert seats(memory_gib=48) == 256
    assert seats(name="a100-sxm4-80gb-capped") == 256


# --- the catalogue's new GPUs against their datasheets (cost_models/gpus.py's sources) --------------------------

@pytest.mark.parametrize("name,aliases,figures", [
    # [B200] DGX/HGX B200: BF16 4.5 PFLOPS and FP8/INT8 9 PFLOPS/POPS with sparsity, halved; 180 GB at 8 TB/s;
    # NVLink 5 1.8 TB/s.
    ("b200", ["B200", "b200-180gb", "NVIDIA B200", "b200-sxm"],
     dict(peak_flops_per_s=4.5e15 / 2, peak_fp8_flops_per_s=9e15 / 2, peak_int8_ops_per_s=9e15 / 2,
          memory_bytes=180 * GIB, memory_bytes_per_s=8e12, interconnect_bytes_per_s=1.8e12)),
    # [H20] BF16 148 TFLOPS, FP8 296 TFLOPS, INT8 296 TOPS (dense); 96 GB HBM3 at 4.0 TB/s; NVLink 900 GB/s.
    ("h20", ["H20", "h20-96gb", "nvidia-h20"],
     dict(peak_flops_per_s=148e12, peak_fp8_flops_per_s=296e12, peak_int8_ops_per_s=296e12,
          memory_bytes=96 * GIB, memory_bytes_per_s=4.0e12, interconnect_bytes_per_s=900e9)),
    # [MI300X] dense BF16 1,307.4 TFLOPS, FP8 2,614.9 TFLOPS, INT8 2,614.9 TOPS; 192 GB HBM3 at 5.3 TB/s;
    # 7 Infinity Fabric links of 128 GB/s.
    ("mi300x", ["MI300X", "mi300x-192gb", "AMD Instinct MI300X", "amd-mi300x"],
     dict(peak_flops_per_s=1307.4e12, peak_fp8_flops_per_s=2614.9e12, peak_int8_ops_per_s=2614.9e12,
          memory_bytes=192 * GIB, memory_bytes_per_s=5.3e12, interconnect_bytes_per_s=7 * 128e9)),
])
def test_the_new_catalogue_gpus_carry_their_datasheet_figures(name, aliases, figures):
    gpu = GPUS[name]
    assert {field: getattr(gpu, field) for field in figures} == pytest.approx(figures, rel=1e-12)
    assert all(resolve_gpu(alias) is gpu for alias in aliases)
    assert gpu.source == f"[{name.upper()}]"   # the module docstring's citation
    # all three hold more than 70 GiB and none is an A100: vLLM's larger defaults, and from 160 GiB (the B200, the
    # MI300X) its largest (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py:2973-2996)
    config = config_from_dict({"hardware": {"gpu": name}})
    budget = 16384 if figures["memory_bytes"] >= 160 * GIB else 8192
    assert vllm_default_knobs(config)["scheduler.max_num_batched_tokens"] == budget


def test_the_l40s_carries_its_datasheet_figures():
    # [L40S] BF16 "362.05 | 733*" and FP8 "733 | 1,466*" TFLOPS, * with sparsity: the first figure is dense
    # (not the L40's 181.05); INT8 733 TOPS dense; 48 GB GDDR6 at 864 GB/s; PCIe Gen4 x16, 64 GB/s both ways
    gpu = resolve_gpu("L40S")
    figures = dict(peak_flops_per_s=362.05e12, peak_fp8_flops_per_s=733e12, peak_int8_ops_per_s=733e12,
                   memory_bytes=48 * GIB, memory_bytes_per_s=864e9, interconnect_bytes_per_s=64e9)
    assert {field: getattr(gpu, field) for field in figures} == pytest.approx(figures, rel=1e-12)
    assert (gpu.interconnect, gpu.source) == ("PCIe Gen4 x16", "[L40S]")


def test_servetune_gpus_shows_the_low_precision_rates_and_every_field(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["gpus"]) == 0
    table = capsys.readouterr().out
    header = " ".join(table.split("─")[0].split())
    assert "BF16 FP8 INT8" in header and "TFLOPS TFLOPS TOPS" in header
    cells = [line.split() for line in table.splitlines()]
    rows = {words[0]: words[1:] for words in cells if words and words[0] in GPUS}
    assert rows["mi300x"][:3] == ["1307.4", "2614.9", "2614.9"] and rows["a10g"][1:3] == ["-", "-"]
    assert main(["gpus", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert list(listed) == list(GPUS)
    for name, gpu in GPUS.items():
        row = listed[name]
        assert (row["bf16_tflops"] * 1e12, row["memory_gb_per_s"] * 1e9, row["memory_gib"] * GIB,
                row["interconnect_gb_per_s"] * 1e9) == pytest.approx(
            (gpu.peak_flops_per_s, gpu.memory_bytes_per_s, gpu.memory_bytes, gpu.interconnect_bytes_per_s))
        for key, value in (("fp8_tflops", gpu.peak_fp8_flops_per_s), ("int8_tops", gpu.peak_int8_ops_per_s)):
            assert row[key] == (None if value is None else pytest.approx(value / 1e12)), (name, key)
        assert (row["description"], row["interconnect"], row["source"]) == (gpu.description, gpu.interconnect,
                                                                             gpu.source)
    # a row's numbers, under the same keys, define the same GPU (the form docs/config.md gives)
    copied = {key: listed["h100-80gb"][key] for key in MY_H100 if key != "name"}
    assert resolve_gpu(GpuDefinition(name="copy", **copied)).peak_flops_per_s == GPUS["h100-80gb"].peak_flops_per_s
