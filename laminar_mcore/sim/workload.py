"""Workloads like Laminar's: DAPO-Math-17k prompts, 2K prompt / 16K response caps, GRPO
groups of 16, and a long-tailed response-length distribution.

Response lengths are log-normal around a per-prompt median (hard prompts are long for every
sample of their group), capped at ``max_response``: by default the median is 1,200 tokens,
sigma 0.9 within a group and 0.5 between prompts, so p99 / p50 is about 12 and ~1% of samples
reach the 16K cap -- the shape Laminar reports (p99 > 10x p50 on AIME-like math). Prompt
lengths are log-normal around 180 tokens (DAPO-Math prompts are short problem statements).
Every length is a pure function of (seed, group, sample), so every mode sees the same ones.
"""

from __future__ import annotations

import functools
import math
import random
import zlib
from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Workload:
    batch_prompts: int = 512
    samples: int = 16
    response_median: float = 1200.0
    sigma_sample: float = 0.9
    sigma_prompt: float = 0.5
    max_response: int = 16384
    prompt_median: float = 180.0
    max_prompt: int = 2048
    seed: int = 0

    @property
    def batch_trajectories(self) -> int:
        return self.batch_prompts * self.samples

    def _rng(self, *key) -> random.Random:
        return random.Random(zlib.crc32("/".join(map(str, (self.seed,) + key)).encode()))

    def prompt_length(self, prompt: int) -> int:
        r = self._rng("prompt", prompt)
        return max(16, min(self.max_prompt, int(self.prompt_median * math.exp(0.4 * r.gauss(0, 1)))))

    def response_length(self, prompt: int, sample: int) -> int:
        difficulty = _difficulty(self, prompt)
        noise = self._rng("sample", prompt, sample).gauss(0, 1)
        length = self.response_median * math.exp(self.sigma_prompt * difficulty +
                                                 self.sigma_sample * noise)
        return max(1, min(self.max_response, int(length)))

    def stats(self, prompts: int = 4000) -> dict:
        return dict(_stats(self, prompts))

    def _stats(self, prompts: int) -> dict:
        lengths = sorted(self.response_length(p, s) for p in range(prompts)
                         for s in range(self.samples))
        n = len(lengths)
        pct = lambda q: lengths[min(n - 1, math.ceil(q * n) - 1)]  # noqa: E731
        return {"p50": pct(0.5), "p99": pct(0.99), "mean": sum(lengths) / n,
                "capped": sum(1 for x in lengths if x >= self.max_response) / n}

    def mean_context(self) -> float:
        """The mean context a running request holds (prompt + half its response, weighted by
        time: long requests hold KV longer)."""
        s = self.stats(500)
        return self.prompt_median + 0.75 * s["mean"]


# Lengths are pure functions of a frozen (hashable) workload, so their costly parts are cached:
# a prompt's difficulty (shared by its group's samples) and the length statistics a run's
# placement and engine sizes read; a subclass's own length functions are honoured.
@functools.lru_cache(maxsize=4096)
def _difficulty(workload: Workload, prompt: int) -> float:
    return workload._rng("difficulty", prompt).gauss(0, 1)


@functools.lru_cache(maxsize=64)
def _stats(workload: Workload, prompts: int) -> dict:
    return workload._stats(prompts)


@functools.lru_cache(maxsize=1 << 16)
def group_lengths(w: Workload, prompt: int) -> Tuple[int, Tuple[int, ...]]:
    """A group's prompt length and its samples' response lengths, cached: a report's worker
    runs many simulations of one workload, whose prompt pools issue the same groups."""
    return w.prompt_length(prompt), tuple(w.response_length(prompt, k) for k in range(w.samples))
