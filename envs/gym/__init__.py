"""The Gymnasium environments: a functional JAX core, the world it simulates, actions, baselines and adapters."""
