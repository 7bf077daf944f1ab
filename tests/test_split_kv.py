"""The split-KV decode-attention regime (vLLM 0.2's paged attention V1/V2 switch): its rule, its cost against a
hand computation, that it is off unless a profile turns it on, and ``calibrate --steps`` recovering it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import shipped_profile_with
from servetune.cost_models import calibrate as cal
from servetune.cost_models import calibrate_steps as cs
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.profile import load_profile, shipped_profile_for
from servetune.cost_models.roofline import Calibration, build_roofline_params, split_kv_decode, step_costs
from servetune.errors import UserError
from servetune.types import StepBatch

A100 = resolve_gpu("a100-80gb")
OPT_13B = resolve_model("opt-13b")   # 40 heads of 128, 40 layers: vLLM 0.2's paged attention served it


def decodes(seqs, context_each) -> StepBatch:
    seqs = jnp.asarray(seqs, jnp.float32)
    zero = 0 * seqs
    return StepBatch(num_prefill_seqs=zero, prefill_tokens=zero, prefill_context_tokens=zero,
                     prefill_attention_pairs=zero, prefill_causal_pairs=zero, num_decode_seqs=seqs,
                     decode_context_tokens=seqs * jnp.asarray(context_each, jnp.float32))


def test_the_rule_is_vllm_0_2s_work_and_partition_test():
    """V2 when seqs × heads ≤ the threshold and the context spans more than one 512-token partition, or the
    context exceeds 8,192 at any batch; never while the threshold is 0."""
    on = Calibration(split_kv_max_work=512.0)
    heads = 40.0
    seqs = np.array([1, 12, 13, 12, 12, 64, 64, 12])
    context = np.array([1024, 1024, 1024, 512, 513, 9000, 8192, 0])
    expected = [1, 1, 0, 0, 1, 1, 0, 0]   # 12 × 40 = 480 ≤ 512 < 13 × 40; the last has no decode context
    seqs_for_rule = np.where(context > 0, seqs, 0)
    got = split_kv_decode(on, heads, jnp.asarray(seqs_for_rule, jnp.float32),
                          jnp.asarray(seqs_for_rule * context, jnp.float32))
    assert np.asarray(got).tolist() == expected
    off = split_kv_decode(Calibration(), heads, jnp.asarray(seqs, jnp.float32), jnp.asarray(seqs * context, jnp.float32))
    assert not np.asarray(off).any()


def test_a_split_step_costs_its_own_efficiency_and_one_more_kernel_a_layer():
    """Hand computation for OPT-13B on one A100: 8 decodes of 2,048 tokens each (8 × 40 = 320 ≤ 512, so split)."""
    calibration = Calibration(split_kv_max_work=512.0, split_kv_memory_efficiency=0.4)
    params = build_roofline_params(OPT_13B, A100, 1, calibration)
    costs = step_costs(params, decodes([8.0], [2048.0]))
    layers, d, heads = 40, 128, 40
    tokens = 8 * 2048
    kv_bytes = layers * tokens * 2 * heads * d * 2       # K and V, fp16
    flops = layers * tokens * 4 * heads * d
    memory_s = kv_bytes / (A100.memory_bytes_per_s * 0.4)
    compute_s = flops / (A100.peak_flops_per_s * calibration.attention_compute_efficiency)
    p = float(calibration.roofline_sharpness)
    expected = (memory_s ** p + compute_s ** p) ** (1 / p)
    assert float(costs.attention_decode_s[0]) == pytest.approx(expected, rel=1e-5)
    unsplit = step_costs(dataclasses.replace(params, calibration=Calibration().as_float32()), decodes([8.0], [2048.0]))
    assert float(costs.overhead_s[0] - unsplit.overhead_s[0]) == pytest.approx(
        layers * float(calibration.kernel_overhead_s), rel=1e-4)
    # at 16 decodes (640 > 512) the single-pass kernel runs: the usual efficiency, no reduction kernel
    v1 = step_costs(params, decodes([16.0], [2048.0]))
    v1_default = step_costs(dataclasses.replace(params, calibration=Calibration().as_float32()), decodes([16.0], [2048.0]))
    assert float(v1.total_s[0]) == pytest.approx(float(v1_default.total_s[0]), rel=1e-6)


def test_off_by_default_so_shipped_profiles_cost_steps_as_before():
    """Threshold 0 (the default and the shipped profiles'): the split-KV efficiency changes no step."""
    for path in (shipped_profile_for("a100-80gb"), shipped_profile_for("h100-80gb")):
        calibration, document = load_profile(path)
        assert document["calibration"]["split_kv_max_work"] == 0 and float(calibration.split_kv_max_work) == 0
        params = build_roofline_params(OPT_13B, A100, 2, calibration)
        other = dataclasses.replace(params, calibration=dataclasses.replace(
            calibration, split_kv_memory_efficiency=jnp.float32(0.05)).as_float32())
        batch = decodes([1.0, 8.0, 64.0, 256.0], [600.0, 4000.0, 9000.0, 2048.0])
        np.testing.assert_array_equal(np.asarray(step_costs(params, batch).total_s),
                                      np.asarray(step_costs(other, batch).total_s))


def grid_steps() -> cs.StepRows:
    """Decode steps on DistServe's grid (batch 1-256 × context 128-2,048) and prefills of 64-2,048 tokens."""
    batches, contexts = np.array([1, 2, 4, 8, 16, 32, 64, 128, 192, 256.0]), np.array([128, 256, 512, 1024, 2048.0])
    b, c = (x.ravel() for x in np.meshgrid(batches, contexts))
    prefill = np.array([64, 128, 256, 512, 1024, 2048, 3072, 4096.0])
    zeros_d, zeros_p = np.zeros(len(b)), np.zeros(len(prefill))
    return cs.StepRows(Path("steps.csv"), np.concatenate([zeros_d, prefill]), np.concatenate([b, zeros_p]),
                       np.concatenate([b * c, zeros_p]), np.concatenate([zeros_d, zeros_p]),
                       np.concatenate([zeros_d, np.ones(len(prefill))]), np.zeros(len(b) + len(prefill)))


def test_a_hidden_split_kv_regime_is_recovered_to_1_percent():
    """Ground truth: the regime on below 96 decodes (96 × 40 heads = 3,840), at 0.42 of the bandwidth against
    0.77 for the single-pass kernel. The fit finds a threshold that splits the rows as the truth does, and the
    efficiencies within 1%."""
    rows = grid_steps()
    hidden = Calibration(split_kv_max_work=3840.0, split_kv_memory_efficiency=0.42, attention_memory_efficiency=0.77,
                         per_step_overhead_s=2e-3)
    dataset = cs.steps_dataset(rows, OPT_13B, A100, 1)
    rows.step_time_s = cal.predicted_times(dataset, hidden, A100).astype(np.float64)
    # a starting profile with vLLM 0.2's rule on (threshold 512) asks for the search, as --initial does
    result = cs.calibrate_steps(rows, OPT_13B, A100, 1, Calibration(split_kv_max_work=512.0), folds=2,
                                token_tiles=(1,))
    assert result.converged and "split_kv_memory_efficiency" in result.fitted
    threshold = float(result.calibration.split_kv_max_work)
    assert 64 * 40 <= threshold < 128 * 40, threshold   # between the grid's batch sizes either side of 96
    assert float(result.calibration.split_kv_memory_efficiency) == pytest.approx(0.42, rel=0.01)
    assert float(result.calibration.attention_memory_efficiency) == pytest.approx(0.77, rel=0.01)
    assert result.report["batch_kinds"]["all"]["held_out"]["mape_pct"] < 0.5
    # the single-kernel fit (threshold fixed at 0) cannot follow the two regimes
    assert result.report["split_kv_fit_mape_pct"]["0"] > 10 * result.report["batch_kinds"]["all"]["fit"]["mape_pct"]
    # from a profile with the rule off, the search does not run: its threshold (0) stays, as for an engine with
    # one decode kernel
    off = cs.calibrate_steps(rows, OPT_13B, A100, 1, Calibration(), folds=2, token_tiles=(1,))
    assert off.report["split_kv_max_work"] == 0 and off.report["split_kv_fit_mape_pct"] == {}
    assert "split_kv_memory_efficiency" in off.left_out


def test_candidates_are_one_per_way_of_splitting_the_rows():
    rows = grid_steps()
    dataset = cs.steps_dataset(rows, OPT_13B, A100, 1)
    candidates = cs.split_kv_candidates(dataset, Calibration())
    # 0 (off) and the geometric midpoints between neighbouring batch sizes, in units of 40 heads
    batches = np.array([1, 2, 4, 8, 16, 32, 64, 128, 192, 256.0])
    assert candidates == [0.0, *np.floor(40 * np.sqrt(batches[1:] * batches[:-1])).tolist()]
    # prefill-only rows leave one way: the regime cannot matter
    prefills = dataset.subset(np.asarray(rows.decode_requests) == 0)
    assert cs.split_kv_candidates(prefills, Calibration()) == [0.0]


def test_a_profile_with_a_fractional_threshold_is_refused(tmp_path):
    path = shipped_profile_with(tmp_path / "p.json", split_kv_max_work=95.5)
    with pytest.raises(UserError, match=r"p.json: calibration.split_kv_max_work: got 95.5, expected a whole number "
                                        r"of decode requests × query heads, 0 \(no split-KV regime\) or more"):
        load_profile(path)


def test_the_command_fits_the_regime_when_asked_and_says_where_it_switches(tmp_path, capsys):
    """`calibrate --steps ... --split-kv` on steps with the hidden regime: the profile it writes switches between
    the grid's batch sizes either side of the truth's 96 decodes, and the report prints that threshold."""
    from test_calibrate_steps import run_cli

    rows = grid_steps()
    hidden = Calibration(split_kv_max_work=3840.0, split_kv_memory_efficiency=0.42, attention_memory_efficiency=0.77,
                         per_step_overhead_s=2e-3)
    times_ms = cal.predicted_times(cs.steps_dataset(rows, OPT_13B, A100, 1), hidden, A100) * 1e3
    steps = tmp_path / "steps.csv"
    lines = ["prefill_tokens,decode_requests,context_tokens,step_time_ms"]
    lines += [f"{p:g},{d:g},{c:g},{t!r}" for p, d, c, t in zip(rows.prefill_tokens, rows.decode_requests,
                                                                rows.context_tokens, times_ms.tolist())]
    steps.write_text("\n".join(lines) + "\n")
    out = tmp_path / "profile.json"
    assert run_cli("--steps", str(steps), "--model", "opt-13b", "--gpu", "a100-80gb", "--split-kv",
                   "--token-tile", "1", "--folds", "2", "--out", str(out)) == 0
    printed = capsys.readouterr()
    printed = " ".join((printed.out + printed.err).split())   # rich wraps lines at the terminal's width
    threshold = float(load_profile(out)[0].split_kv_max_work)
    assert 64 * 40 <= threshold < 128 * 40, threshold
    assert f"split-KV decode below {threshold:g} decode requests x query heads per GPU" in printed
