"""PPO (search/rl/ppo.py): it learns a problem whose answer is known, its pieces match direct formulas, and the
same seed trains the same parameters."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from servetune.config import RlConfig
from servetune.config_loader import load_config
from servetune.search.rl import policy_net as net
from servetune.search.rl.ppo import EnvSpec, advantages, empty_stats, make_train, update_stats
from servetune.search.rl.train import control_world, env_spec, load_checkpoint, save_checkpoint

# A toy of the scheduling problem with a known answer: the arrival rate alternates between 1 and 8 req/s every
# PERIOD steps, and the best token budget is 8,192 / rate. The action is the budget on gym.actions' log scale
# over [256, 16384]; the reward is minus the squared distance (in action units) from the best budget's action.
LOG_LOW, LOG_HIGH, RATES, PERIOD, LENGTH = np.log(256.0), np.log(16384.0), jnp.array([1.0, 8.0]), 8, 32


def best_budget(rate):
    return 8192.0 / rate


def budget_action(budget):
    return 2.0 * (jnp.log(budget) - LOG_LOW) / (LOG_HIGH - LOG_LOW) - 1.0


def _observe(t, first_phase):
    rate = RATES[(t // PERIOD + first_phase) % 2]
    return jnp.stack([rate, t / LENGTH]).astype(jnp.float32), rate


def toy_reset(key, params):
    first_phase = jax.random.randint(key, (), 0, 2)
    return _observe(jnp.int32(0), first_phase)[0], (jnp.int32(0), first_phase)


def toy_step(key, state, action, params):
    t, first_phase = state
    rate = _observe(t, first_phase)[1]
    reward = -(jnp.clip(action[0], -1.0, 1.0) - budget_action(best_budget(rate))) ** 2
    obs, _ = _observe(t + 1, first_phase)
    return obs, (t + 1, first_phase), reward, jnp.asarray(False), t + 1 >= LENGTH, {}


TOY = EnvSpec(toy_reset, toy_step, None, obs_size=2, action_size=1)
TOY_RL = dataclasses.replace(RlConfig(), num_envs=64, num_steps=32, timesteps=64 * 32 * 150, num_minibatches=4,
                             learning_rate=1e-3)


def _train(trainer, seed=0):
    state = trainer.init(jax.random.PRNGKey(seed))
    history = []
    for _ in range(trainer.num_updates):
        state, metrics = trainer.update(state)
        history.append(jax.device_get(metrics))
    return state, history


def _mean_action(state, raw_obs):
    obs = net.normalise(jnp.asarray(raw_obs, jnp.float32), state.obs_stats.mean, state.obs_stats.var)
    return float(net.actor_mean(state.network, obs)[0])


@pytest.fixture(scope="module")
def toy_run():
    return _train(make_train(TOY, TOY_RL))


def test_ppo_learns_the_best_budget_as_the_rate_alternates(toy_run):
    state, history = toy_run
    for rate in (1.0, 8.0):
        for elapsed in (0.1, 0.5, 0.9):
            learned = _mean_action(state, [rate, elapsed])
            # Within a factor of 1.25 of the best budget: |Δa| * ln(64) / 2 < ln(1.25).
            assert abs(learned - float(budget_action(best_budget(rate)))) < 2 * np.log(1.25) / np.log(64.0), (
                rate, elapsed, learned)
    # The policy tracks the alternation: a higher rate gets a smaller budget.
    assert _mean_action(state, [8.0, 0.5]) < _mean_action(state, [1.0, 0.5]) - 0.5
    first, last = history[0]["episode_return"], history[-1]["episode_return"]
    assert last > 0.5 * first   # returns are negative: the loss at least halved


def test_same_seed_same_parameters_and_another_seed_differs():
    trainer = make_train(TOY, dataclasses.replace(TOY_RL, timesteps=64 * 32 * 3))
    a, _ = _train(trainer, seed=3)
    b, _ = _train(trainer, seed=3)
    c, _ = _train(trainer, seed=4)
    leaves = lambda s: jax.tree_util.tree_leaves((s.network, s.obs_stats, s.return_stats))  # noqa: E731
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))


@pytest.mark.parametrize("log_std_init", [-0.5, -2.0])
def test_the_first_rollouts_actions_spread_by_log_std_init_around_the_initial_action(log_std_init):
    # The reward is the action's squared distance from the initial action, recorded before any learning: over
    # the first rollout its mean is the variance exp(2 log_std_init) of the policy's noise (chi-squared: relative
    # standard error sqrt(2 / n)); a mean action off the initial one by d would add d².
    def step(key, state, action, params):
        return jnp.zeros(1, jnp.float32), state, (action[0] - 0.3) ** 2, jnp.asarray(False), jnp.asarray(False), {}

    spec = EnvSpec(lambda key, params: (jnp.zeros(1, jnp.float32), jnp.int32(0)), step, None, obs_size=1,
                   action_size=1, initial_action=jnp.array([0.3], jnp.float32))
    rl = dataclasses.replace(RlConfig(), num_envs=64, num_steps=32, timesteps=64 * 32, num_minibatches=4,
                             log_std_init=log_std_init)
    trainer = make_train(spec, rl)
    state = trainer.init(jax.random.PRNGKey(0))
    assert float(state.network["log_std"][0]) == log_std_init
    _, metrics = trainer.update(state)
    variance, n = float(np.exp(2 * log_std_init)), 64 * 32
    assert float(metrics["reward_per_step"]) == pytest.approx(variance, rel=4 * np.sqrt(2 / n))


def test_running_statistics_equal_numpy_over_all_batches():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 3)).astype(np.float32) for n in (5, 64, 1, 200)]
    stats = empty_stats(3)
    for batch in batches:
        stats = update_stats(stats, jnp.asarray(batch))
    everything = np.concatenate(batches).astype(np.float64)
    np.testing.assert_allclose(stats.mean, everything.mean(axis=0), rtol=1e-4)
    np.testing.assert_allclose(stats.var, everything.var(axis=0), rtol=1e-3)


def test_advantages_equal_the_direct_sum_of_discounted_td_errors():
    rng = np.random.default_rng(1)
    steps, envs, gamma, lam = 12, 3, 0.9, 0.8
    reward = rng.normal(size=(steps, envs)).astype(np.float32)
    value = rng.normal(size=(steps, envs)).astype(np.float32)
    done = rng.random((steps, envs)) < 0.2
    last = rng.normal(size=envs).astype(np.float32)
    got = np.asarray(advantages(jnp.asarray(reward), jnp.asarray(value), jnp.asarray(done), jnp.asarray(last),
                                gamma, lam))
    # A_t = Σ_k (γλ)^k δ_{t+k}, stopping after the step that ends the episode.
    next_value = np.concatenate([value[1:], last[None]])
    delta = reward + gamma * next_value * (1 - done) - value
    expected = np.zeros_like(delta)
    for e in range(envs):
        for t in range(steps):
            total, weight = 0.0, 1.0
            for k in range(t, steps):
                total += weight * delta[k, e]
                if done[k, e]:
                    break
                weight *= gamma * lam
            expected[t, e] = total
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_serve_control_training_is_reproducible_and_its_checkpoint_round_trips(tmp_path):
    config = load_config("examples/chat.yaml", ["rl.episode_s=8", "rl.bounds={max_num_seqs: [1, 16]}",
                                                "rl.num_envs=4", "rl.num_steps=8", "rl.num_minibatches=2",
                                                "rl.num_workloads=2", "rl.timesteps=64"])
    trainer = make_train(env_spec(control_world(config)), config.rl)
    a, history = _train(trainer)
    b, _ = _train(trainer)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a.network),
                                                    jax.tree_util.tree_leaves(b.network)))
    # 8-second episodes of 1-second intervals: every env finished exactly one in each 8-step rollout.
    assert [int(m["episodes"]) for m in history] == [4, 4]
    assert all(m["episode_length"] == 8 for m in history)

    save_checkpoint(tmp_path / "checkpoint.safetensors", a)
    template = trainer.init(jax.random.PRNGKey(99))
    restored = load_checkpoint(tmp_path / "checkpoint.safetensors", template)
    for name in ("network", "opt_state", "obs_stats", "return_stats", "key", "update"):
        saved, loaded = (jax.tree_util.tree_leaves(getattr(s, name)) for s in (a, restored))
        assert len(saved) == len(loaded) and all(np.array_equal(x, y) for x, y in zip(saved, loaded)), name
    assert int(restored.update) == 2
