"""Optuna studies over scheduler knobs: the search space, objectives' baselines, scenarios, storage, workers."""
