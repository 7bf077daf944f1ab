"""``servetune eval-policy``: a trained policy against the baselines, on workloads it was not trained on.

Every contender plays the same held-out episodes: the config's workload variants after the ``rl.num_workloads``
it was trained on (later seeds, or the trace windows after), each a ServeControl episode under the config's
``rl`` options, every variant in one vmapped rollout. Each episode is reported as ``servetune simulate`` reports
a run (envs/gym/report.py), so goodput, attainment and the p99s are run.json's own numbers.

Contenders:

- ``policy``: the policy file's actor, acting deterministically (its mean action) every interval;
- ``reactive``: envs/gym/baselines.py's rule (the token budget follows ITL and the queue);
- ``best-static``: the best trial of an Optuna study on the same config (given, or run here), held fixed;
- ``as-configured``: the config's own knobs, held fixed (what the policy's first version did);
- ``vllm-default``: vLLM's default scheduler settings, held fixed.

The fixed contenders play in a world whose knob bounds cover their values (the default bounds), so that an
action reproduces their config exactly; the policy and the reactive rule play within the policy's bounds.
The gain over the best static config is paired by episode (the same workload), with a 95% t-interval.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from servetune.config import Config
from servetune.envs.gym import core
from servetune.envs.sim.engine import NO_LIMIT
from servetune.envs.gym.actions import decode
from servetune.envs.gym.baselines import fixed_config, reactive, vllm_defaults
from servetune.envs.gym.report import episode_metrics, episode_outcome
from servetune.envs.gym.world import World, variant_config
from servetune.search.rl import policy_net as net
from servetune.search.rl.policy_file import LoadedPolicy
from servetune.search.rl.train import control_world, intervals_per_episode

REPORTED = ("request_goodput", "slo_attainment", "p99_ttft_ms", "p99_itl_ms")


def policy_act(obs, params, actor: dict):
    """The policy file's actor (``actor_arrays``) acting deterministically: search/rl/policy_net.py's pass."""
    del params
    return net.deterministic_action(actor["layers"], actor["obs_mean"], actor["obs_var"], obs)


def actor_arrays(policy: LoadedPolicy) -> dict:
    return {"layers": [(jnp.asarray(w), jnp.asarray(b)) for w, b in policy.layers],
            "obs_mean": jnp.asarray(policy.obs_mean), "obs_var": jnp.asarray(policy.obs_var)}


def _baseline(policy: Callable) -> Callable:
    """An envs/gym/baselines.py policy in the rollout's shape (it takes no arrays of its own)."""
    return lambda obs, params, _: policy(obs, params)


# Every rule a contender can play. One compiled rollout serves them all (the rule is an argument, chosen inside by
# lax.switch), so eval-policy compiles the engine once for its five contenders instead of once per contender.
RULES = {"policy": policy_act, "reactive": _baseline(reactive), "fixed_config": _baseline(fixed_config),
         "vllm_defaults": _baseline(vllm_defaults)}
BASELINE_RULES = ("reactive", "fixed_config", "vllm_defaults")


@dataclass(frozen=True)
class Episodes:
    """The held-out episodes one contender played."""

    metrics: list[dict]                       # run.json's metrics, one per episode
    knob_counts: Counter                      # (max_num_seqs, budget, threshold, queue limit) -> intervals


@partial(jax.jit, static_argnames=("rules", "steps"))
def _run(params, rules: tuple[str, ...], rule, actor, steps: int):
    """Every variant of the bank as one episode of ``steps`` intervals under ``RULES[rules[rule]]``."""
    count = params.bank.num_requests.shape[0]
    obs, states = jax.vmap(core.control_reset_to, (0, None))(jnp.arange(count, dtype=jnp.int32), params)
    acts = [RULES[name] for name in rules]

    def act(obs):
        return jax.lax.switch(rule, acts, obs, params, actor)

    def interval(carry, _):
        obs, states, done = carry
        actions = jax.vmap(act)(obs)
        new_obs, new_states, _, terminated, truncated, _ = jax.vmap(core.control_step, (None, 0, 0, None))(
            None, states, actions, params)
        # An ended episode stays as it ended.
        states = jax.tree_util.tree_map(
            lambda old, new: jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), old, new), states, new_states)
        knobs = jax.vmap(decode, (0, None))(jnp.clip(actions, -1.0, 1.0), params.bounds)
        chosen = jnp.stack([knobs.max_num_seqs, knobs.max_num_batched_tokens, knobs.long_prefill_token_threshold,
                            knobs.max_num_queued_reqs], axis=-1)
        return (jnp.where(done[:, None], obs, new_obs), states, done | terminated | truncated), (chosen, ~done)

    (_, states, _), (chosen, live) = jax.lax.scan(interval, (obs, states, jnp.zeros(count, bool)), None, steps)
    return states, chosen, live


def play(world: World, rule: str, actor: Optional[dict] = None) -> Episodes:
    """Every variant of ``world``'s bank as one episode, all vmapped, under the rule named ``rule`` (a key of
    RULES; "policy" needs ``actor = actor_arrays(policy)``). Whatever the rule, calls with the same world shapes
    and actor shapes reuse one compiled rollout: give the baselines a policy's ``actor`` too to share its program."""
    if rule not in RULES:
        raise ValueError(f"no rule {rule!r}: expected one of {', '.join(RULES)}")
    if actor is None and rule == "policy":
        raise ValueError("the policy rule needs the policy's actor arrays (actor_arrays(policy))")
    rules = tuple(RULES) if actor is not None else BASELINE_RULES
    states, chosen, live = jax.device_get(_run(world.params, rules, jnp.int32(rules.index(rule)), actor,
                                               intervals_per_episode(world)))
    return Episodes(final_metrics(world, states), Counter(tuple(int(v) for v in row) for row in chosen[live]))


def final_metrics(world: World, states) -> list[dict]:
    """run.json's metrics of each variant's episode, from the batch of ControlStates it ended in (variant i
    at index i)."""
    states = jax.device_get(states)
    return [episode_metrics(world, variant, episode_outcome(
                world, variant, jax.tree_util.tree_map(lambda x: x[variant], states.engine)))
            for variant in range(len(world.workloads))]


def _summary(values: Sequence[Optional[float]]) -> dict:
    """Mean, standard deviation and 95% t-interval half width over episodes (None where a value is)."""
    kept = np.array([v for v in values if v is not None], float)
    n = kept.size
    if not n:
        return {"mean": None, "std": None, "ci95": None, "values": list(values)}
    std = float(kept.std(ddof=1)) if n > 1 else 0.0
    half = float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)) if n > 1 else None
    return {"mean": float(kept.mean()), "std": std, "ci95": half, "values": [float(v) for v in kept]}


def heldout_world(config: Config, episodes: int, bounds="rl") -> World:
    """ServeControl's world over ``episodes`` workload variants that come after those trained on."""
    return control_world(variant_config(config, config.rl.num_workloads), episodes, bounds)


def _most_chosen(played: Episodes) -> tuple[dict, float]:
    """The knob setting held for the most intervals, as config values (None: no limit), and that share."""
    (seqs, budget, threshold, queue), intervals = played.knob_counts.most_common(1)[0]
    knobs = {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "long_prefill_token_threshold": threshold,
             "max_num_queued_reqs": None if queue >= NO_LIMIT else queue}
    return knobs, intervals / sum(played.knob_counts.values())


def evaluate(config: Config, policy: LoadedPolicy, static_config: Optional[Config], episodes: int,
             on_contender: Optional[Callable[[str], None]] = None) -> dict:
    """The evaluation document (``eval-policy``'s JSON): per contender the summaries of REPORTED and the knobs
    it chose most often, plus the policy's paired gain over the best static config."""
    policy_world = heldout_world(config, episodes)
    contenders = [("policy", policy_world, "policy"), ("reactive", policy_world, "reactive")]
    if static_config is not None:
        contenders.append(("best-static", heldout_world(static_config, episodes, bounds=None), "fixed_config"))
    fixed_world = heldout_world(config, episodes, bounds=None)
    contenders += [("as-configured", fixed_world, "fixed_config"), ("vllm-default", fixed_world, "vllm_defaults")]
    actor = actor_arrays(policy)

    results = {}
    for name, world, rule in contenders:
        if on_contender is not None:
            on_contender(name)
        played = play(world, rule, actor)
        knobs, share = _most_chosen(played)
        results[name] = {**{key: _summary([m[key] for m in played.metrics]) for key in REPORTED},
                         "most_chosen_knobs": knobs, "most_chosen_share": share,
                         "distinct_knob_settings": len(played.knob_counts)}
    document = {"episodes": episodes, "heldout_variants_from": config.rl.num_workloads,
                "episode_s": policy_world.episode_s, "interval_s": config.rl.interval_s, "contenders": results}
    if "best-static" in results:
        ours = results["policy"]["request_goodput"]["values"]
        theirs = results["best-static"]["request_goodput"]["values"]
        document["gain_over_best_static"] = _summary([a / b - 1.0 if b > 0 else None for a, b in zip(ours, theirs)])
    return document


def most_chosen_knobs(config: Config, policy: LoadedPolicy, episodes: int) -> tuple[dict, float]:
    """The knob setting the policy holds for the most intervals over held-out episodes, and that share."""
    return _most_chosen(play(heldout_world(config, episodes), "policy", actor_arrays(policy)))
