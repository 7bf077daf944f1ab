"""Policy files (search/rl/policy_file.py): NumPy inference equals the JAX actor and the environment's decoding,
the file carries what a serving stack needs, and bad files are one-line errors."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from servetune.config_loader import load_config
from servetune.envs.sim.engine import NO_LIMIT
from servetune.envs.gym.actions import decode
from servetune.errors import UserError
from servetune.search.rl import policy_net as net
from servetune.search.rl.policy_file import load_policy, write_policy
from servetune.search.rl.train import control_world

OBS, HIDDEN = 16, (32, 32)


def _random_policy(path, scored=False):
    """A policy with random weights (large enough that actions reach the box's edges) over chat.yaml's world."""
    overrides = ["rl.bounds={max_num_seqs: [1, 64]}", "rl.episode_s=10", "rl.num_workloads=1"]
    if scored:
        overrides += ["scheduler.queue_order=edf"]
    world = control_world(load_config("examples/chat.yaml", overrides))
    bounds = world.params.bounds
    actions = 4 + bounds.weight_units.shape[0]
    network = net.init_network(jax.random.PRNGKey(0), OBS, actions, HIDDEN)
    keys = jax.random.split(jax.random.PRNGKey(1), 8)
    network["actor"] = [(jax.random.normal(keys[2 * i], w.shape), jax.random.normal(keys[2 * i + 1], b.shape))
                        for i, (w, b) in enumerate(network["actor"])]
    rng = np.random.default_rng(2)
    mean, var = rng.normal(size=OBS).astype(np.float32) * 10, rng.uniform(0.5, 50, size=OBS).astype(np.float32)
    write_policy(path, network, mean, var, bounds.log_low, bounds.log_high, bounds.weight_units,
                 {"config_hash": "abc", "config": "{}", "observation_names": [f"o{i}" for i in range(OBS)],
                  "action_names": [f"a{i}" for i in range(actions)], "interval_s": 1.0})
    return network, mean, var, bounds


@pytest.mark.parametrize("scored", [False, True], ids=["fcfs", "scored queue"])
def test_numpy_inference_equals_jax_inference(tmp_path, scored):
    network, mean, var, bounds = _random_policy(tmp_path / "p.safetensors", scored)
    policy = load_policy(tmp_path / "p.safetensors")
    obs = np.random.default_rng(3).normal(0, 20, size=(500, OBS)).astype(np.float32)
    jax_actions = np.asarray(jnp.clip(net.actor_mean(network, net.normalise(jnp.asarray(obs), mean, var)), -1, 1))
    np_actions = policy.action(obs)
    # float32 both ways; XLA's tanh and summation order differ from NumPy's in the last bits, which the
    # random weights' saturated layers accumulate to ~1e-5.
    np.testing.assert_allclose(np_actions, jax_actions, atol=1e-4)
    assert np.mean(np.abs(np_actions) >= 1.0) > 0.05   # the unlimited ends of the ranges are exercised
    for row in obs[:200]:
        knobs = policy(row)
        expected = jax.device_get(decode(jnp.asarray(policy.action(row)), bounds))
        assert knobs["max_num_seqs"] == int(expected.max_num_seqs)
        assert knobs["max_num_batched_tokens"] == int(expected.max_num_batched_tokens)
        assert knobs["long_prefill_token_threshold"] == (int(expected.long_prefill_token_threshold) or None)
        queue = int(expected.max_num_queued_reqs)
        assert knobs["max_num_queued_reqs"] == (None if queue == NO_LIMIT else queue)
        if scored:
            np.testing.assert_allclose(knobs["order_weights"], expected.order_weights, rtol=1e-6)
        else:
            assert "order_weights" not in knobs


def test_the_file_carries_its_names_and_interval(tmp_path):
    _random_policy(tmp_path / "p.safetensors")
    policy = load_policy(tmp_path / "p.safetensors")
    assert policy.observation_names == tuple(f"o{i}" for i in range(OBS))
    assert policy.action_names == ("a0", "a1", "a2", "a3")
    assert policy.interval_s == 1.0 and policy.config_hash == "abc"
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 16\)"):
        policy.action(np.zeros(3))


def test_loading_and_running_a_policy_needs_no_jax(tmp_path):
    _random_policy(tmp_path / "p.safetensors")
    script = ("import sys; from servetune.search.rl.policy_file import load_policy; "
              f"p = load_policy({str(tmp_path / 'p.safetensors')!r}); k = p([0.0] * {OBS}); "
              "assert 'jax' not in sys.modules, 'jax was imported'; print(k['max_num_seqs'])")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert 1 <= int(run.stdout) <= 64


def test_bad_policy_files_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such policy file"):
        load_policy(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors policy file"):
        load_policy(tmp_path / "junk.safetensors")
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"), metadata={"format": "other"})
    with pytest.raises(UserError, match="not a servetune policy file"):
        load_policy(tmp_path / "other.safetensors")
    _random_policy(tmp_path / "p.safetensors")
    metadata = dict(load_policy(tmp_path / "p.safetensors").metadata, format_version="99")
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "future.safetensors"), metadata=metadata)
    with pytest.raises(UserError, match="policy format version 99"):
        load_policy(tmp_path / "future.safetensors")
