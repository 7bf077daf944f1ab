"""ServeClusterControl (envs/gym/cluster_control.py, envs/gym/cluster_adapters.py) against ``servetune simulate``
of the same cluster config, which is the independent truth for an episode at fixed weights and knobs; against
Gymnasium's checker and itself (vector against single); and against queueing theory for what the router's
weights do.

Every env here has three replicas, a window of at most 128 requests and slot tables of 8 (``max_num_seqs`` bounded
by 8), so all share one compiled step (and the vector env one vmapped step).
"""
from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import servetune  # noqa: F401  (registers the ids)
from servetune.envs.gym import cluster_control as cc
from servetune.envs.gym.world import variant_config
from servetune.envs.sim.outcome import COMPLETED
from servetune.pipeline import simulate_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLUSTER = str(EXAMPLES / "cluster.yaml")
CHAT = str(EXAMPLES / "chat.yaml")
ENV_ID = "servetune/ServeClusterControl-v0"
WEIGHTED = ["workload.num_requests=200", "cluster.replicas=3", "cluster.router=weighted",
            "cluster.router_weights={queue: 1.0, running: 0.5}"]
# Overloaded for 15 s: each replica's KV cache holds its 8 seats' prompts (4 blocks each) but not their outputs (12
# more each), so requests are preempted; its queue holds 6, so some are rejected.
LOADED = dict(config=CLUSTER, overrides=[*WEIGHTED, "workload.arrivals.rate=8", "simulation.horizon_s=15",
                                         "workload.lengths={kind: fixed, prompt_tokens: 64, output_tokens: 192}",
                                         "scheduler.max_model_len=512", "scheduler.max_num_seqs=8",
                                         "scheduler.num_kv_blocks=64", "scheduler.max_num_queued_reqs=6"],
              num_workloads=3, bounds={"max_num_seqs": (1, 8)})


def _episode(env, workload: int, action) -> tuple[float, dict, list]:
    """Hold `action` for a whole episode: (its return, the last step's info, every observation as a dict)."""
    obs, _ = env.reset(options={"workload": workload})
    names = env.unwrapped.observation_names
    total, seen = 0.0, []
    while True:
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        seen.append((dict(zip(names, obs)), info))
        if terminated or truncated:
            return total, info, seen


# Each replica keeps its own prefix cache: three shared 32-token prefixes, a prefix_hit weight the action leaves
# as the config's, and the router's outstanding count steered beside the metrics.
PREFIXES = ["scheduler.enable_prefix_caching=true",
            "workload.tenants=[{name: default, share: 1, prefix_tokens: 32, prefix_groups: 3}]",
            "cluster.router_weights={queue: 1.0, running: 0.5, outstanding: 0.25, prefix_hit: 2.0}"]


@pytest.mark.parametrize("extra, steered", [([], [1.0, 0.5, 0.0, 0.0]),
                                            (["cluster.signal_delay_s=0.25"], [1.0, 0.5, 0.0, 0.0]),
                                            (PREFIXES, [1.0, 0.5, 0.0, 0.25])],
                         ids=["exact load", "delayed load reports", "prefix caches"])
def test_fixed_weights_reproduce_simulate(extra, steered):
    overrides = LOADED["overrides"] + extra
    env = gym.make(ENV_ID, **{**LOADED, "overrides": overrides}, miss_penalty=0.5)
    world = env.unwrapped.world
    action = np.asarray(world.params.config_action)
    # The config's action is the config's weights exactly (ties between replicas' scores depend on it).
    np.testing.assert_array_equal(np.asarray(cc.decode_weights(action, world.params)), steered)
    total, info, seen = _episode(env, 1, action)
    truth = simulate_config(variant_config(world.world.config, 1))
    assert truth.config.cluster.router == "weighted"

    ours, theirs = env.unwrapped.outcome(), truth.outcome.requests
    np.testing.assert_array_equal(ours.replica, truth.replica)
    mine = ours.outcome.requests
    np.testing.assert_array_equal(mine.status, theirs.status)
    np.testing.assert_array_equal(mine.generated_tokens, theirs.generated_tokens)
    np.testing.assert_array_equal(mine.preemptions, theirs.preemptions)
    np.testing.assert_allclose(mine.first_token_s, theirs.first_token_s, rtol=0, atol=1e-5)
    np.testing.assert_allclose(mine.finish_s, theirs.finish_s, rtol=0, atol=1e-5)
    assert (theirs.status == COMPLETED).sum() > 40

    run = truth.metrics   # what run.json holds
    missed = run["completed"] - run["good"] + run["rejected"]
    assert run["rejected"] > 0 and run["preemptions"] > 0 and run["unfinished"] > 0 and missed > run["rejected"]
    assert total == pytest.approx(run["good"] - 0.5 * missed)
    assert (info["episode_good"], info["episode_missed"]) == (run["good"], missed)
    for key in ("good", "completed", "rejected", "unfinished", "preemptions", "arrived"):
        assert info["metrics"][key] == run[key], key
    for key in ("request_goodput", "duration_s", "p99_ttft_ms", "mean_itl_ms"):
        assert info["metrics"][key] == pytest.approx(run[key], rel=1e-5), key
    assert info["metrics"]["routing_split"] == pytest.approx(truth.cluster["routing_split"])
    if extra == PREFIXES:
        assert run["prefix_cache_hit_rate"] > 0
        assert info["metrics"]["prefix_cache_hit_rate"] == pytest.approx(run["prefix_cache_hit_rate"])

    for obs, step_info in seen:
        # The per-replica counts (read from each replica's slots and queue) add up to the cluster's, and to the
        # requests in flight counted over the window's request table.
        for total_field, field in (("queue_len", "queue"), ("running", "running")):
            assert obs[total_field] == sum(obs[f"replica{r}_{field}"] for r in range(3))
        assert obs["queue_len"] + obs["running"] == step_info["in_flight"]
        assert obs["backlog_default"] == obs["queue_len"]
        assert not step_info["slots_filled"] and not step_info["guard_hit"]
    assert max(obs["queue_len"] for obs, _ in seen) > 0


def test_check_env_passes_and_ansi_shows_the_weights_in_force():
    check_env(gym.make(ENV_ID, **LOADED).unwrapped, skip_render_check=True)
    env = gym.make(ENV_ID, render_mode="ansi", **LOADED)
    env.reset(options={"workload": 0})
    knobs = np.asarray(env.unwrapped.world.params.env.config_action)
    env.step(np.concatenate([cc.encode_weights({"queue": 2.0, "kv_utilization": 0.25},
                                               env.unwrapped.world.weight_bounds), knobs]))
    assert env.render().rstrip().endswith("w_queue=2 w_running=0 w_kv_utilization=0.25 w_outstanding=0")


def test_vector_env_agrees_with_single_envs_step_for_step():
    num_envs, seed = 3, 5
    vector = gym.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="vector_entry_point", **LOADED)
    singles = [gym.make(ENV_ID, **LOADED) for _ in range(num_envs)]
    obs, _ = vector.reset(seed=seed)
    for i, env in enumerate(singles):
        np.testing.assert_array_equal(obs[i], env.reset(seed=seed + i)[0])
    rng = np.random.default_rng(2)
    finished = 0
    for _ in range(18):   # episodes are 15 intervals: every env ends one and starts the next
        actions = rng.uniform(-1, 1, vector.action_space.shape).astype(np.float32)
        obs, reward, terminated, truncated, info = vector.step(actions)
        for i, env in enumerate(singles):
            one_obs, one_reward, one_terminated, one_truncated, _ = env.step(actions[i])
            assert (one_reward, one_terminated, one_truncated) == (reward[i], terminated[i], truncated[i])
            if one_terminated or one_truncated:
                finished += 1
                np.testing.assert_array_equal(info["final_obs"][i], one_obs)
                one_obs = env.reset()[0]
            np.testing.assert_array_equal(obs[i], one_obs)
    assert finished >= num_envs


def test_routing_by_idleness_beats_routing_by_queue_alone_for_one_seat_replicas():
    """Each replica has one seat, so it is a single server (service about 1.3 s: a 512-token prefill and 127
    decode steps), at utilisation about 0.5 (1.2 req/s over three). Weight on `running` alone sends an arrival
    to an idle replica whenever there is one (join the idle queue): a request waits only when all three are
    busy, which in M/M/3 at 1.6 erlangs is a quarter of arrivals (Erlang's C), and fewer with fixed service.
    Weight on `queue` alone cannot tell a busy replica from an idle one while their queues are empty, and ties
    go to the lowest index: an arrival goes to replica 0 whenever nobody waits there, busy or not, and waits out
    its request in service while replicas 1 and 2 may idle: most requests wait. Waiting most of a service time
    misses the 800 ms TTFT SLO, so routing by `running` must win on reward on every workload."""
    rate = 1.2
    env = gym.make(ENV_ID, config=CLUSTER, overrides=[
        *WEIGHTED, f"workload.arrivals.rate={rate}", f"simulation.horizon_s={120 / rate}", "scheduler.max_num_seqs=1",
        "scheduler.num_kv_blocks=8192"], num_workloads=3, bounds={"max_num_seqs": (1, 8)}, interval_s=4.0)
    world = env.unwrapped.world
    knobs = np.asarray(world.params.env.config_action)

    def play(signal: str, workload: int):
        """The episode's return, and the fraction of its requests served that waited (TTFT beyond 0.1 s; one
        prefill takes 25 ms)."""
        action = np.concatenate([cc.encode_weights({signal: 1.0}, world.weight_bounds), knobs])
        total, _, _ = _episode(env, workload, action)
        requests = env.unwrapped.outcome().outcome.requests
        ttft = (requests.first_token_s - requests.arrival_s)[~np.isnan(requests.first_token_s)]
        return total, np.mean(ttft > 0.1)

    for workload in range(3):
        by_running, waited_by_running = play("running", workload)
        by_queue, waited_by_queue = play("queue", workload)
        assert by_running > by_queue + 20, (workload, by_running, by_queue)
        assert waited_by_running < 0.3 and waited_by_queue > 0.5, (waited_by_running, waited_by_queue)


def test_bad_configs_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"cluster: got none, expected a cluster section whose router is one of "
                                         r"least_outstanding, least_kv, power_of_two, weighted"):
        gym.make(ENV_ID, config=CHAT)
    with pytest.raises(ValueError, match=r"cluster.yaml: cluster.router: got 'round_robin', expected one of "
                                         r"least_outstanding, least_kv, power_of_two, weighted: round_robin decides"):
        gym.make(ENV_ID, config=CLUSTER, overrides=["cluster.router=round_robin"])
    with pytest.raises(ValueError, match=r"interval_s: got 1.0, expected a multiple of the config's "
                                         r"cluster.signal_delay_s \(0.3 s\)"):
        gym.make(ENV_ID, config=CLUSTER, overrides=["cluster.signal_delay_s=0.3"], interval_s=1.0)
    with pytest.raises(ValueError, match=r"weight_bounds: queue: got \(2, 1\), expected \(low, high\)"):
        gym.make(ENV_ID, config=CLUSTER, weight_bounds={"queue": (2, 1)})
    with pytest.raises(ValueError, match=r"weight_bounds: unknown signal 'prefix_hit', expected one of queue, "
                                         r"running, kv_utilization, outstanding"):
        gym.make(ENV_ID, config=CLUSTER, weight_bounds={"prefix_hit": (0, 1)})
