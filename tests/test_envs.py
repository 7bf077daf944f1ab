"""The Gymnasium environments (envs/gym/adapters.py over envs/gym/core.py), checked against Gymnasium's own
checker, against themselves (seeding, vector against single), and against ``servetune simulate``, which is the
independent truth for what an episode at fixed knobs must produce.

Small workloads and short episodes keep the file fast; envs with the same config share compiled steps.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gymnasium as gym
import jax
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import servetune  # noqa: F401  (registers the ids)
from servetune.envs.gym import core
from servetune.envs.gym.actions import decode
from servetune.envs.gym.baselines import BASELINES, reactive
from servetune.envs.gym.world import variant_config
from servetune.envs.gym.adapters import knob_values
from servetune.envs.metrics import histogram_percentile
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.sim.queue_order import FEATURES
from servetune.pipeline import simulate_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHAT = str(EXAMPLES / "chat.yaml")
CONTROL, TUNE = "servetune/ServeControl-v0", "servetune/ServeTune-v0"
# A short, busy chat window: 8 s at 6 req/s with 16 seats at most.
SMALL = dict(config=CHAT, overrides=["workload.num_requests=80", "workload.arrivals.rate=6",
                                     "simulation.horizon_s=8"],
             num_workloads=3, bounds={"max_num_seqs": (1, 16)})
NUM_ENVS = 10   # one vector size throughout, so the vmapped step compiles once
# Overloaded: a small KV cache (preemptions) and a queue limit (rejections), so misses happen.
LOADED = ["workload.num_requests=300", "workload.arrivals.rate=30", "scheduler.num_kv_blocks=300",
          "scheduler.max_num_queued_reqs=20", "simulation.horizon_s=12"]


def rollout(env, seed: int, steps: int, action_seed: int = 0):
    """(observations, rewards, terminations, truncations) of random actions, resetting at episode ends."""
    rng = np.random.default_rng(action_seed)
    obs, _ = env.reset(seed=seed)
    record = [obs]
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(rng.uniform(-1, 1, env.action_space.shape))
        record += [obs, reward, terminated, truncated]
        if terminated or truncated:
            record.append(env.reset()[0])
    return record


def test_check_env_passes_for_both():
    for env_id in (CONTROL, TUNE):
        env = gym.make(env_id, **SMALL)
        check_env(env.unwrapped, skip_render_check=True)


def test_seeding_gives_identical_trajectories():
    a, b = gym.make(CONTROL, **SMALL), gym.make(CONTROL, **SMALL)
    first, second = rollout(a, seed=7, steps=20), rollout(b, seed=7, steps=20)
    assert len(first) == len(second)
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)
    # The steps cover more than one episode, so the unseeded reset continued the same chain.
    assert sum(bool(x) for x in first if isinstance(x, (bool, np.bool_))) >= 2
    # Different seeds draw different workload variants (the draw is uniform over the bank of three).
    variants = {gym.make(CONTROL, **SMALL).reset(seed=s)[1]["workload"] for s in range(12)}
    assert variants == {0, 1, 2}


def test_vector_env_agrees_with_single_envs_step_for_step():
    num_envs, seed = NUM_ENVS, 11
    vector = gym.make_vec(CONTROL, num_envs=num_envs, vectorization_mode="vector_entry_point", **SMALL)
    assert vector.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    singles = [gym.make(CONTROL, **SMALL) for _ in range(num_envs)]
    obs, _ = vector.reset(seed=seed)
    for i, env in enumerate(singles):
        np.testing.assert_array_equal(obs[i], env.reset(seed=seed + i)[0])
    rng = np.random.default_rng(1)
    finished = 0
    for _ in range(20):
        actions = rng.uniform(-1, 1, vector.action_space.shape).astype(np.float32)
        obs, reward, terminated, truncated, info = vector.step(actions)
        for i, env in enumerate(singles):
            one_obs, one_reward, one_terminated, one_truncated, _ = env.step(actions[i])
            assert (one_reward, one_terminated, one_truncated) == (reward[i], terminated[i], truncated[i])
            if one_terminated or one_truncated:
                finished += 1
                np.testing.assert_array_equal(info["final_obs"][i], one_obs)
                one_obs = env.reset()[0]   # the vector env restarted it in the same step
            np.testing.assert_array_equal(obs[i], one_obs)
    assert finished >= num_envs


TENANTS = ["scheduler.queue_order=edf", "scheduler.enable_prefix_caching=true",
           "workload.tenants=[{name: chat, share: 3, prefix_tokens: 256, prefix_groups: 2}, "
           "{name: batch, share: 1, slo: {ttft_ms: 4000}}]"]


def test_tune_vector_env_agrees_with_single_envs():
    vector = gym.make_vec(TUNE, num_envs=NUM_ENVS, vectorization_mode="vector_entry_point", **SMALL)
    singles = [gym.make(TUNE, **SMALL) for _ in range(NUM_ENVS)]
    obs, _ = vector.reset(seed=3)
    for i, env in enumerate(singles):
        np.testing.assert_array_equal(obs[i], env.reset(seed=3 + i)[0])
    actions = np.random.default_rng(2).uniform(-1, 1, vector.action_space.shape).astype(np.float32)
    obs, reward, terminated, truncated, info = vector.step(actions)
    assert terminated.all() and not truncated.any() and info["_final_obs"].all()
    for i, env in enumerate(singles):
        one_obs, one_reward, *_ , one_info = env.step(actions[i])
        assert one_reward == reward[i] and one_info["good"] == info["good"][i]
        np.testing.assert_array_equal(info["final_obs"][i], one_obs)
        np.testing.assert_array_equal(obs[i], env.reset()[0])   # the next bandit round, already drawn
    assert len(set(reward.tolist())) > 1   # different knobs, different goodput


def _episode_at_fixed_knobs(env, workload: int):
    """Run one ServeControl episode at the config's own knobs; (return, the env's outcome, last info)."""
    obs, _ = env.reset(seed=0, options={"workload": workload})
    action = np.asarray(env.unwrapped.world.params.config_action)
    total, done = 0.0, False
    while not done:
        assert env.observation_space.contains(obs)
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        done = terminated or truncated
    return total, env.unwrapped.outcome(), info


@pytest.mark.parametrize("case", ["chat window", "trace windows, no time limit"])
def test_fixed_knobs_reproduce_simulate_and_rewards_sum_to_its_good_requests(case):
    if case == "chat window":
        # Also a scored queue, two tenants and prefix caching: every path of the engine the env feeds.
        options = dict(config=CHAT, overrides=LOADED + TENANTS, num_workloads=2, miss_penalty=0.5,
                       bounds={"max_num_seqs": (1, 64)})
        workload = 1
    else:
        # 20-s windows of the shipped Azure trace, each episode run until every request is served.
        options = dict(config=str(EXAMPLES / "azure_conv.yaml"),
                       overrides=["workload.arrivals.window_s=20", "workload.arrivals.window_start_s=600",
                                  "scheduler.max_num_seqs=32"],
                       num_workloads=2, miss_penalty=0.5, bounds={"max_num_seqs": (1, 32)})
        workload = 1
    run = _check_fixed_knobs_reproduce_simulate(options, workload, chat_window=case == "chat window")
    if case == "chat window":
        assert run["prefix_cache_hit_rate"] > 0


@pytest.fixture
def first_slots_four(monkeypatch):
    """Intervals try a 4-slot table first, so busy ones overflow it and rerun on the full table. (Compiled
    steps read the size when traced: none compiled before or after may be reused.)"""
    from servetune.envs.sim import engine

    def clear():
        jax.clear_caches()
        engine.interval_runner.cache_clear()
    clear()
    monkeypatch.setattr(engine, "INTERVAL_FIRST_SLOTS", 4)
    yield
    monkeypatch.undo()
    clear()


def test_a_small_first_table_that_overflows_changes_nothing(first_slots_four):
    options = dict(config=CHAT, overrides=LOADED, num_workloads=2, miss_penalty=0.5, bounds={"max_num_seqs": (1, 64)})
    run = _check_fixed_knobs_reproduce_simulate(options, 0, chat_window=True)
    assert run["mean_batch_size"] > 4   # intervals really outgrew the first table


def _check_fixed_knobs_reproduce_simulate(options: dict, workload: int, chat_window: bool) -> dict:
    env = gym.make(CONTROL, **options)
    world = env.unwrapped.world
    total, outcome, info = _episode_at_fixed_knobs(env, workload)
    truth = simulate_config(variant_config(world.config, workload))

    ours, theirs = outcome.requests, truth.outcome.requests
    np.testing.assert_array_equal(ours.status, theirs.status)
    np.testing.assert_array_equal(ours.generated_tokens, theirs.generated_tokens)
    np.testing.assert_array_equal(ours.preemptions, theirs.preemptions)
    np.testing.assert_allclose(ours.first_token_s, theirs.first_token_s, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours.finish_s, theirs.finish_s, rtol=0, atol=1e-5)
    assert (theirs.status == COMPLETED).sum() > 20

    run = truth.metrics   # what run.json holds
    assert info["metrics"]["good"] == run["good"]
    for key in ("completed", "rejected", "unfinished", "not_arrived", "preemptions", "arrived"):
        assert info["metrics"][key] == run[key], key
    for key in ("request_goodput", "duration_s", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "slo_attainment"):
        assert info["metrics"][key] == pytest.approx(run[key], rel=1e-5), key
    missed = run["completed"] - run["good"] + run["rejected"]
    if chat_window:
        assert run["rejected"] > 0 and run["preemptions"] > 0 and missed > run["rejected"] and run["unfinished"] > 0
    assert total == pytest.approx(run["good"] - 0.5 * missed)
    assert (info["episode_good"], info["episode_missed"]) == (run["good"], missed)
    return run


@pytest.mark.parametrize("overrides", [LOADED, [*LOADED[:-1], "simulation.horizon_s=null"]],
                         ids=["time limit", "until served"])
def test_tune_reward_is_simulates_goodput(overrides):
    env = gym.make(TUNE, config=CHAT, overrides=overrides, num_workloads=2, bounds={"max_num_seqs": (1, 64)})
    world = env.unwrapped.world
    obs, info = env.reset(options={"workload": 0})
    assert env.observation_space.contains(obs)
    _, reward, terminated, truncated, info = env.step(np.asarray(world.params.config_action))
    run = simulate_config(variant_config(world.config, 0)).metrics
    assert (terminated, truncated) == (True, False)
    assert reward == pytest.approx(run["request_goodput"], rel=1e-5)
    assert info["good"] == run["good"] > 0
    assert info["metrics"]["request_goodput"] == pytest.approx(run["request_goodput"], rel=1e-6)
    assert info["metrics"]["p99_itl_ms"] == pytest.approx(run["p99_itl_ms"], rel=1e-5)


def test_observations_report_the_interval():
    """Arrivals and TTFT percentiles per interval, against the workload and simulate's first-token times."""
    env = gym.make(CONTROL, **SMALL)
    world = env.unwrapped.world
    names = core.control_observation_names(world)
    env.reset(options={"workload": 0})
    truth = simulate_config(variant_config(world.config, 0))
    workload, first_token = truth.workload, truth.outcome.requests.first_token_s
    ttft_ratio = (first_token - workload.arrival_s) / (truth.config.slo.ttft_ms / 1e3)
    clock, checked = 0.0, 0
    for k in range(1, 100):
        obs, _, terminated, truncated, info = env.step(np.asarray(world.params.config_action))
        o = dict(zip(names, obs))
        # An interval takes the arrivals before its end; its last step may run past the end (the clock).
        arrived = np.sum((workload.arrival_s >= k - 1) & (workload.arrival_s < k))
        assert o["arrival_rate_rps"] == pytest.approx(arrived)
        first = (first_token > clock + 1e-6) & (first_token <= info["engine_clock_s"] + 1e-6)
        if first.sum() >= 3:
            counts, _ = np.histogram(ttft_ratio[first], core.RATIO_EDGES.astype(np.float64))
            for q in (50, 99):
                expected = histogram_percentile(counts, core.RATIO_EDGES.astype(np.float64), q)
                assert o[f"ttft_p{q}_slo"] == pytest.approx(expected, rel=1e-3)
                assert ttft_ratio[first].min() * 0.98 <= o[f"ttft_p{q}_slo"] <= ttft_ratio[first].max() * 1.02
            checked += 1
        clock = info["engine_clock_s"]
        if terminated or truncated:
            break
    assert checked >= 3


def _check_accounting(info, i, final_obs, names):
    accounted = (info["episode_good"][i] + info["episode_missed"][i] + info["in_flight"][i] + info["pending"][i])
    assert accounted == info["window_requests"][i]
    obs = dict(zip(names, final_obs))
    # The request table's count of requests in the system against the engine's own queue and batch counters.
    assert info["in_flight"][i] == obs["queue_len"] + obs["running"]


@pytest.mark.parametrize("agent", ["random", *BASELINES])
def test_agents_run_100_episodes_cleanly(agent):
    """No NaN, no observation outside its space, every request of every episode accounted for."""
    num_envs = NUM_ENVS
    env = gym.make_vec(CONTROL, num_envs=num_envs, vectorization_mode="vector_entry_point", **SMALL)
    world = env.unwrapped.world
    names = core.control_observation_names(world)
    policy = None if agent == "random" else jax.jit(jax.vmap(BASELINES[agent], (0, None)))
    env.action_space.seed(0)
    obs, _ = env.reset(seed=100)
    returns = np.zeros(num_envs)
    episodes = 0
    while episodes < 100:
        actions = env.action_space.sample() if policy is None else np.asarray(policy(obs, world.params))
        obs, reward, terminated, truncated, info = env.step(actions)
        assert not np.isnan(obs).any() and not np.isnan(reward).any()
        assert all(env.single_observation_space.contains(row) for row in obs)
        assert not info["slots_filled"].any() and not info["guard_hit"].any()
        returns += reward
        for i in np.flatnonzero(terminated | truncated):
            _check_accounting(info, i, info["final_obs"][i], names)
            penalty = float(world.params.miss_penalty)
            assert returns[i] == pytest.approx(info["episode_good"][i] - penalty * info["episode_missed"][i])
            returns[i] = 0.0
            episodes += 1


def test_baselines_are_the_knobs_they_name():
    """The fixed-config action decodes to the config's knobs; vLLM's default to 256 seats and 2,048 tokens."""
    world = gym.make(CONTROL, config=CHAT, overrides=LOADED).unwrapped.world
    # A running request holds at least one block, and each admission needs its whole 512-token prompt's
    # 32 blocks free: with 299 usable blocks (one is vLLM's null block) at most 299 - 32 + 1 = 268 run at
    # once, more than the 256 seats at the top of the action's range, so the table has 256 slots.
    assert (int(world.params.max_running), world.params.num_slots) == (256, 256)
    assert knob_values(world, world.params.config_action) == {
        "max_num_seqs": 64, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": "none",
        "max_num_queued_reqs": 20}
    assert knob_values(world, world.params.vllm_action) == {
        "max_num_seqs": 256, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": "none",
        "max_num_queued_reqs": "none"}


def test_knobs_round_trip_through_actions():
    """Config knobs -> action -> knobs gives the config's values back, and a scored queue's weight ratios."""
    world = gym.make(CONTROL, config=CHAT, overrides=[
        "scheduler.max_num_seqs=48", "scheduler.max_num_batched_tokens=3000",
        "scheduler.long_prefill_token_threshold=700", "scheduler.max_num_queued_reqs=123",
        "scheduler.queue_order=weighted", "scheduler.priority_weights={prompt_tokens: 2.0, waiting_s: -0.5}"],
        num_workloads=1).unwrapped.world
    assert knob_values(world, world.params.config_action) == {
        "max_num_seqs": 48, "max_num_batched_tokens": 3000, "long_prefill_token_threshold": 700,
        "max_num_queued_reqs": 123}
    weights = np.asarray(decode(world.params.config_action, world.params.bounds).order_weights)
    expected = np.zeros(len(FEATURES))
    expected[FEATURES.index("prompt_tokens")], expected[FEATURES.index("waiting_s")] = 2.0, -0.5
    np.testing.assert_allclose(weights / weights[FEATURES.index("prompt_tokens")], expected / 2.0, rtol=1e-6)


def test_reactive_rule_moves_the_token_budget():
    world = gym.make(CONTROL, **SMALL).unwrapped.world
    names = core.control_observation_names(world)
    budget = names.index("knob_max_num_batched_tokens")
    obs = np.zeros(len(names), np.float32)
    obs[budget] = 0.2

    def moved(**fields):
        row = obs.copy()
        for name, value in fields.items():
            row[names.index(name)] = value
        action = np.asarray(reactive(jax.numpy.asarray(row), world.params))
        others = np.delete(action, budget - names.index("knob_max_num_seqs"))
        np.testing.assert_array_equal(others, np.delete(np.asarray(world.params.config_action), 1))
        return round(float(action[1]) - 0.2, 6)

    assert moved() == 0.0
    assert moved(itl_p99_slo=0.9) == -0.1
    assert moved(queue_len=4) == 0.1
    assert moved(itl_p99_slo=0.9, queue_len=10) == -0.1   # ITL comes first


def test_render_modes():
    env = gym.make(CONTROL, render_mode="ansi", **SMALL)
    env.reset(seed=0, options={"workload": 0})
    env.step(np.asarray(env.unwrapped.world.params.config_action))
    env.step(np.asarray(env.unwrapped.world.params.config_action))
    line = env.render()
    assert line.count("\n") == 1 and "running" in line and "max_num_seqs=16" in line

    env = gym.make(CONTROL, render_mode="rgb_array", **SMALL)
    env.reset(seed=0, options={"workload": 0})
    for _ in range(3):
        env.step(np.asarray(env.unwrapped.world.params.config_action))
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3
    colours = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in ("#f28e2b", "#4e79a7")}
    present = {tuple(p) for p in frame.reshape(-1, 3)}
    assert colours <= present   # a busy interval shows both prefill and decode seats

    vector = gym.make_vec(CONTROL, num_envs=NUM_ENVS, vectorization_mode="vector_entry_point", render_mode="ansi",
                          **SMALL)
    vector.reset(seed=0)
    vector.step(np.broadcast_to(np.asarray(vector.unwrapped.world.params.config_action), vector.action_space.shape))
    lines = vector.render()
    assert len(lines) == NUM_ENVS and all(line.startswith("t=1s ") for line in lines)

    for mode in ("ansi", "rgb_array"):
        env = gym.make(TUNE, render_mode=mode, **SMALL)
        env.reset(seed=0, options={"workload": 0})
        env.step(np.asarray(env.unwrapped.world.params.config_action))
        frame = env.render()
        if mode == "ansi":
            assert "goodput" in frame and frame.count("\n") == 1
        else:
            assert colours <= {tuple(p) for p in frame.reshape(-1, 3)}


def test_clear_errors():
    with pytest.raises(ValueError, match="scheduler.policy"):
        gym.make(CONTROL, config=CHAT, overrides=["scheduler.policy=static"])
    with pytest.raises(ValueError, match="interval_s"):
        gym.make(CONTROL, config=CHAT, interval_s=0)
    with pytest.raises(ValueError, match="workload.sessions"):
        gym.make(CONTROL, config=CHAT, overrides=["workload.sessions={calls: 2, think_s: 1.0}"])
    with pytest.raises(ValueError, match="knob_bounds"):
        gym.make(CONTROL, config=CHAT, bounds={"max_num_seqs": (8, 4)})
    env = gym.make(CONTROL, **SMALL)
    with pytest.raises(ValueError, match="workload"):
        env.reset(options={"workload": 3})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(2, np.float32))


def test_config_as_a_mapping_is_the_same_world():
    import yaml
    data = yaml.safe_load(Path(CHAT).read_text())
    a = gym.make(CONTROL, **{**SMALL, "config": data}).unwrapped.world
    b = gym.make(CONTROL, **SMALL).unwrapped.world
    assert dataclasses.replace(a.config, source=None) == dataclasses.replace(b.config, source=None)
    for x, y in zip(a.workloads, b.workloads):
        np.testing.assert_array_equal(x.arrival_s, y.arrival_s)
    assert (a.workloads[0].arrival_s < 8).sum() == a.window_counts[0]
