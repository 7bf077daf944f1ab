"""servetune: simulate an LLM server's batch scheduler and tune it.

Importing the package registers its Gymnasium environments (envs/gym/adapters.py): ``servetune/ServeTune-v0`` (one
decision per episode) and ``servetune/ServeControl-v0`` (a decision every control interval), and
``servetune/ServeClusterControl-v0`` (a cluster's router steered every control interval,
envs/gym/cluster_adapters.py), each with a vectorised ``vector_entry_point``. Entry points are strings, so
registering imports neither JAX nor the envs.
"""
import gymnasium

_ENVS = {
    "servetune/ServeTune-v0": ("adapters", "ServeTuneEnv", "ServeTuneVectorEnv"),
    "servetune/ServeControl-v0": ("adapters", "ServeControlEnv", "ServeControlVectorEnv"),
    "servetune/ServeClusterControl-v0": ("cluster_adapters", "ServeClusterControlEnv", "ServeClusterControlVectorEnv"),
}

for _id, (_module, _single, _vector) in _ENVS.items():
    # Re-importing (importlib.reload) must not register twice: Gymnasium warns on an overridden id.
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=f"servetune.envs.gym.{_module}:{_single}",
                           vector_entry_point=f"servetune.envs.gym.{_module}:{_vector}")
