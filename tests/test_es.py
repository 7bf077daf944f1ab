"""Evolution strategies (search/rl/es.py): the first policy is the config's knobs exactly, its baseline is what
eval-policy's fixed-config contender scores, the update climbs a function whose optimum is known, the unread
observations stay unread, and the same seed gives the same weights; train-rl --algo es end to end."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from servetune.cli import main
from servetune.config_loader import ConfigError, load_config
from servetune.envs.gym.core import control_observation_names
from servetune.search.rl.es import EsEnv, centred_ranks, make_es
from servetune.search.rl.policy_file import load_policy
from servetune.search.rl.evaluate import play
from servetune.search.rl.train import HISTORY_FILE, POLICY_FILE, control_world, es_env
from servetune.errors import UserError

CHAT = "examples/chat.yaml"
SMALL = ["rl.algo=es", "rl.episode_s=10", "rl.interval_s=2", "rl.bounds={max_num_seqs: [1, 32]}",
         "rl.num_workloads=3", "rl.es_population=4", "rl.es_days=2", "rl.hidden=[4]",
         "rl.features=[queue_len, running]", "workload.arrivals.rate=12"]


@pytest.fixture(scope="module")
def small():
    config = load_config(CHAT, SMALL)
    world = control_world(config)
    return config, world, make_es(es_env(world, config.rl), config.rl)


def test_the_first_policy_plays_the_configs_knobs_and_its_baseline_is_eval_policys(small):
    config, world, trainer = small
    state = trainer.init(jax.random.PRNGKey(0))
    # eval-policy's fixed-config contender, played on the same days by another rollout.
    fixed = play(world, "fixed_config")
    assert [float(v) for v in state.baseline] == [float(m["good"]) for m in fixed.metrics]
    assert float(jnp.sum(state.baseline)) > 0
    _, metrics = trainer.generation(state)
    assert float(metrics["gain_over_static"]) == 0.0
    assert float(metrics["episode_return"]) == float(metrics["static_return"])


def test_only_the_chosen_observations_are_read(small):
    config, world, trainer = small
    state = trainer.init(jax.random.PRNGKey(0))
    for _ in range(2):
        state, _ = trainer.generation(state)
    first = np.asarray(trainer.network(state)["actor"][0][0])
    names = control_observation_names(world)
    read = [names.index("queue_len"), names.index("running")]
    unread = [i for i in range(len(names)) if i not in read]
    assert np.all(first[unread] == 0.0)
    assert np.any(first[read] != 0.0)
    assert np.any(np.asarray(trainer.network(state)["actor"][-1][0]) != 0.0)   # the output layer moved


def test_the_same_seed_gives_the_same_weights(small):
    _, _, trainer = small
    runs = []
    for _ in range(2):
        state = trainer.init(jax.random.PRNGKey(3))
        state, _ = trainer.generation(state)
        runs.append(np.asarray(state.theta))
    assert np.array_equal(runs[0], runs[1])


def test_centred_ranks():
    assert np.allclose(np.asarray(centred_ranks(jnp.array([3.0, -1.0, 10.0, 0.0]))), [1 / 6, -0.5, 0.5, -1 / 6])


def _quadratic_env(target):
    """A one-step world whose return is -|action - target|²: the best policy outputs the target."""
    target = jnp.asarray(target, jnp.float32)

    def reset_to(variant, params):
        return jnp.ones(2, jnp.float32) * (variant + 1.0), jnp.asarray(0, jnp.int32)

    def step(key, state, action, params):
        reward = -jnp.sum((jnp.clip(action, -1, 1) - target) ** 2)
        info = {"good": jnp.asarray(0, jnp.int32), "arrived": jnp.asarray(1, jnp.int32),
                "time_s": jnp.asarray(1.0, jnp.float32)}
        return jnp.ones(2, jnp.float32), state + 1, reward, jnp.asarray(True), jnp.asarray(False), info

    return EsEnv(reset_to=reset_to, step=step, params=None, obs_size=2, action_size=2, intervals=1, num_days=4,
                 initial_action=jnp.zeros(2), features=(0, 1))


def test_es_climbs_to_a_known_optimum():
    config = load_config(CHAT, ["rl.algo=es", "rl.num_workloads=4", "rl.es_population=16", "rl.es_days=2",
                                "rl.hidden=[4]", "rl.es_learning_rate=0.05", "rl.timesteps=1000000"])
    trainer = make_es(_quadratic_env([0.6, -0.4]), config.rl)
    state = trainer.init(jax.random.PRNGKey(0))
    start = None
    for _ in range(150):
        state, metrics = trainer.generation(state)
        start = float(metrics["episode_return"]) if start is None else start
    assert start == pytest.approx(-(0.6**2 + 0.4**2))
    assert float(metrics["episode_return"]) > -0.01


@pytest.mark.parametrize("override, message", [
    ("rl.es_population=5", "rl.es_population: got 5, expected an even number"),
    ("rl.es_days=9", "rl.es_days: got 9, expected at most rl.num_workloads = 8"),
    ("rl.algo=sgd", "rl.algo"),
])
def test_bad_es_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(CHAT, ["rl.algo=es", override] if not override.startswith("rl.algo") else [override])


def test_features_are_refused_under_ppo_and_unknown_names_name_the_observations():
    with pytest.raises(ConfigError, match="rl.features: .* null under rl.algo ppo"):
        load_config(CHAT, ["rl.features=[queue_len]"])
    config = load_config(CHAT, ["rl.algo=es", "rl.features=[queue_length]", "rl.episode_s=10"])
    with pytest.raises(UserError, match="rl.features: 'queue_length' is not one of this world's observations "
                                        r"\(queue_len, "):
        es_env(control_world(config), config.rl)


def test_train_rl_algo_es_end_to_end(tmp_path, capsys):
    out = tmp_path / "es"
    flags = [arg for item in SMALL[1:] for arg in ("--set", item)]
    # 5 candidates x 2 days x 5 intervals = 50 steps a generation: 2 generations.
    assert main(["train-rl", CHAT, "--algo", "es", *flags, "--timesteps", "100", "--out", str(out),
                 "--no-progress"]) == 0
    assert "trained 100 steps" in capsys.readouterr().out
    history = json.loads((out / HISTORY_FILE).read_text())
    assert history["algo"] == "es" and history["num_updates"] == 2 and history["steps_per_update"] == 50
    assert history["history"][0]["gain_over_static"] == 0.0
    policy = load_policy(out / POLICY_FILE)
    assert json.loads(policy.metadata["features"]) == ["queue_len", "running"]
    assert main(["train-rl", CHAT, "--algo", "es", *flags, "--timesteps", "150", "--out", str(out),
                 "--no-progress", "--resume"]) == 0
    assert [row["update"] for row in json.loads((out / HISTORY_FILE).read_text())["history"]] == [1, 2, 3]


def test_time_of_day_is_the_workloads_day_not_the_compressed_clock():
    # examples/diurnal.yaml plays a day 120x faster: its first 5-s interval ends at 00:10 of the day.
    config = load_config("examples/diurnal.yaml", ["rl.num_workloads=1", "rl.es_days=1", "rl.episode_s=10"])
    world = control_world(config)
    names = control_observation_names(world)
    _, state = jax.jit(reset_to_first)(world.params)
    obs = jax.jit(step_once)(state, world.params)
    assert float(obs[names.index("time_of_day")]) == pytest.approx(5 * 120 / 86400, rel=1e-6)


def reset_to_first(params):
    from servetune.envs.gym.core import control_reset_to
    return control_reset_to(0, params)


def step_once(state, params):
    from servetune.envs.gym.core import control_step
    return control_step(None, state, params.config_action, params)[0]


def test_tenants_playing_their_days_at_different_speeds_have_no_time_of_day(tmp_path):
    data = yaml.safe_load(Path("examples/diurnal.yaml").read_text())
    data["workload"]["tenants"][1]["arrivals"]["time_scale"] = 60
    path = tmp_path / "diurnal.yaml"
    path.write_text(yaml.safe_dump(data))
    # The example's files are named from its folder.
    for folder in ("lengths", "workload_stats"):
        (tmp_path / folder).symlink_to(Path("examples", folder).resolve())
    config = load_config(path)
    with pytest.raises(UserError, match="different speeds .*time_scale 60, 120"):
        control_world(config)


def test_a_policy_that_read_the_compressed_clock_is_refused_on_a_compressed_day(small, tmp_path):
    import dataclasses

    from servetune.search.rl.policy_file import write_policy
    from servetune.search.rl.cli import check_policy_config
    from servetune.search.rl.train import policy_hash

    config, world, trainer = small
    state = trainer.init(jax.random.PRNGKey(0))
    bounds = world.params.bounds
    write_policy(tmp_path / "p.safetensors", trainer.network(state), state.obs_mean, state.obs_var, bounds.log_low,
                 bounds.log_high, bounds.weight_units, {"config_hash": "x"})
    policy = load_policy(tmp_path / "p.safetensors")
    diurnal = load_config("examples/diurnal.yaml")
    for version, refused in (("2", True), ("3", False)):
        stamped = dataclasses.replace(policy, metadata={**policy.metadata, "format_version": version,
                                                        "config_hash": policy_hash(diurnal)})
        if refused:
            with pytest.raises(UserError, match="format 2 read time_of_day on the simulated clock, and this config "
                                                "plays its day 120x faster"):
                check_policy_config(stamped, diurnal, allow_other=False)
        else:
            check_policy_config(stamped, diurnal, allow_other=False)
    # On a day played at its own speed, time_of_day always meant the workload's: format 2 is read as before.
    chat = dataclasses.replace(policy, metadata={**policy.metadata, "format_version": "2",
                                                 "config_hash": policy_hash(config)})
    check_policy_config(chat, config, allow_other=False)
