"""A workload: the requests a simulation serves, as host-side NumPy arrays sorted by arrival."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray       # float64, non-decreasing, seconds on the workload's own clock
    prompt_tokens: np.ndarray   # int64, >= 1
    output_tokens: np.ndarray   # int64, >= 1
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise ValueError("workload arrays must have equal lengths")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("workload arrivals must be sorted")

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def from_lists(cls, arrival_s, prompt_tokens, output_tokens, description: str = "") -> "Workload":
        return cls(
            np.asarray(arrival_s, dtype=np.float64),
            np.asarray(prompt_tokens, dtype=np.int64),
            np.asarray(output_tokens, dtype=np.int64),
            description,
        )
