"""The trials every study starts with, so that it shows how much it beat them.

- ``vllm-default``: what ``vllm serve`` runs with no scheduler flags (../shared/reference/engines.md, vLLM
  0.33): continuous batching, served first come first served (``scheduling-policy`` fcfs), 256 running requests
  and a 2,048-token budget on A100-class and smaller GPUs, 1,024 and 8,192 on GPUs of 70 GiB or more that are
  not A100s; chunked prefill on, no prefill-chunk cap, no admission limit (``max-num-queued-reqs`` unset: vLLM
  queues every request). Every study has this row, whatever the config and its search space say: the space
  holds these values for the baselines' sake (``space_with_baselines``; search/study/optimize.py keeps the sampler's
  own trials within search.knobs), and the settings outside the space (the queue order, say) are applied by
  name (``baseline_settings``), so a study's "vs vLLM default" always compares against vLLM.
- ``chunk-512``: vLLM's default with a 512-token step budget, the small-chunk setting often recommended to
  keep inter-token latency low while long prompts prefill.
- ``as-configured``: the config file's own knobs; left out when it is one of the two above (the study then
  says so), since two trials of one configuration would measure it twice.

A cluster of replica groups has only ``as-configured``: its groups' schedulers are their own, not searched.

What vLLM's defaults leave to the deployment -- the model, GPU, KV cache, block size, max_model_len, prefix
caching -- stays the config's. A baseline's knob value that is not among a range's bounds is recorded as
Optuna records any enqueued value (with a warning), except None ("no limit"), which no range holds: vllm-default's
and chunk-512's trials record the range's top there and run with their own None. ``as-configured`` and
``chunk-512`` are left out, with the reason, when a value of theirs is not among a knob's choices, and
``as-configured`` when it is None on a range.
"""
from __future__ import annotations

from typing import Any, Optional

from servetune.config import Config
from servetune.search.study.space import SearchSpace, apply_knobs
from servetune.vllm_defaults import vllm_default_knobs
BASELINE_ATTR = "baseline"   # a baseline trial's user attribute: its name
VLLM_DEFAULT, CHUNK_512, AS_CONFIGURED = "vllm-default", "chunk-512", "as-configured"


def baseline_settings(config: Config, name: Optional[str]) -> dict[str, Any]:
    """Every setting baseline ``name`` fixes (nothing for as-configured, for a trial that is no baseline, or for
    a baseline name this version does not know)."""
    if name == VLLM_DEFAULT:
        return vllm_default_knobs(config)
    if name == CHUNK_512:
        return {**vllm_default_knobs(config), "scheduler.max_num_batched_tokens": 512}
    return {}


def space_with_baselines(config: Config) -> SearchSpace:
    """The config's search space, its knobs' choices widened to hold vLLM's defaults: a value outside a
    categorical knob's choices cannot be stored in an Optuna trial."""
    return SearchSpace.from_config(config).holding(vllm_default_knobs(config))


def baselines(config: Config, space: SearchSpace) -> tuple[list[tuple[str, dict]], list[str]]:
    """([(name, knob values)] to enqueue, in order, [why a baseline was left out or merged])."""
    own = space.values_in(config)
    candidates = [(AS_CONFIGURED, own)] + [(name, {key: baseline_settings(config, name).get(key, own[key])
                                                   for key in space.keys}) for name in (VLLM_DEFAULT, CHUNK_512)]
    configured = {name: configuration(config, values, name) for name, values in candidates}
    chosen, notes = [], []
    if config.cluster is not None and config.cluster.has_groups:
        # vLLM's defaults are scheduler settings, and each replica group keeps its own scheduler (search/study/
        # space.py refuses to search them), so these trials would rerun the configured cluster under other names.
        notes.append(f"baselines {VLLM_DEFAULT} and {CHUNK_512} left out: cluster.replicas is a list of replica "
                     "groups, each running its own scheduler settings")
        candidates = candidates[:1]
    for name, values in candidates:
        outside = space.outside_choices(values)
        unstorable = [knob for knob in space.knobs if knob.spec.choices is None and values[knob.key] is None]
        if name == AS_CONFIGURED and unstorable:
            notes.append(f"baseline {name} left out: {', '.join(f'{k.key}=None' for k in unstorable)} (no limit), "
                         "which a range cannot record")
            continue
        if unstorable:
            # No Optuna range holds None ("no limit"); the baseline's own settings set it when the trial runs.
            values = {**values, **{knob.key: knob.spec.high for knob in unstorable}}
            notes.append(f"baseline {name}: {', '.join(k.key for k in unstorable)} is None (no limit), which a "
                         f"range cannot record; its trial shows the range's top, "
                         f"{', '.join(f'{k.spec.high:g}' for k in unstorable)}, and runs with no limit")
        twin = None
        if name == AS_CONFIGURED:
            twin = next((other for other, _ in candidates[1:] if configured[other] == configured[name]), None)
        if twin is not None:
            notes.append(f"baseline {name} is the same configuration as {twin}: one trial, named {twin}")
        elif outside:
            notes.append(f"baseline {name} left out: {', '.join(outside)} not among the knob's choices")
        else:
            chosen.append((name, values))
    return chosen, notes


def configuration(config: Config, knob_values: dict, baseline: Optional[str]) -> tuple:
    """What a trial runs, as a comparable value: the scheduler, hardware and cluster after its knobs and its
    baseline's settings (two knob sets that configure the same thing -- a prefill cap with chunked prefill off, or
    router weights under a router that reads none, which apply_knobs clears -- are one configuration)."""
    applied = apply_knobs(config, {**knob_values, **baseline_settings(config, baseline)})
    return applied.scheduler, applied.hardware, applied.cluster
