"""RL schedulers: PPO and evolution strategies over ServeControl, the policy network, its file and evaluation."""
