"""The run's books and utilisation figures, as ``summary.json`` and ``/metrics`` report them.

The books balance: generated = consumed + buffered + discarded (with reasons), and
``trajectories_lost`` counts what neither ended nor is in flight (0 unless a trajectory
vanished). ``staleness_trained`` is the staleness of what the trainer consumed (max, mean,
histogram); in ``areal`` mode, whose trajectories' tokens may span versions, that is by each
one's oldest token, and ``staleness_trained_newest_token`` by its newest. Utilisation is measured over the steady state: from the end of the first step to
the end of the last (start-up and shutdown excluded in every mode).

Mixed into ``Controller`` (controller/server.py), which provides the manager, the pools, the
episode, the step marks and the run's counters. It reads; it never changes the run.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable


class RunBooks:
    """``books()`` and ``utilisation()`` (see the module docstring)."""

    def utilisation(self) -> dict:
        """Trainer-consumed tokens/s and idle fractions in the steady state: from the end of the
        first step (start-up, model build and the first batch excluded in every mode) to the
        end of the last; over the whole run when there is a single step."""
        if len(self.step_marks) >= 2:
            span = max(self.step_marks[-1][0] - self.step_marks[0][0], 1e-9)
            tokens = sum(t for _, t, _ in self.step_marks[1:])
            wait = sum(w for _, _, w in self.step_marks[1:])
        else:
            span = max(time.time() - (self.first_request or time.time()), 1e-9)
            tokens = sum(c["tokens"] for c in self.consumed)
            wait = self.trainer_wait_s
        return {"trainer_tokens_per_s": tokens / span,
                "trainer_idle_fraction": min(wait / span, 1.0),
                "engine_idle_fraction": (self._engine_idle_fraction()
                                         if self.manager else 0.0),
                "generation_fraction": self._generation_fraction() if self.manager else 0.0,
                "consumed_tokens": sum(c["tokens"] for c in self.consumed), "span_s": span,
                "first_batch_request": self.first_request}

    def _window(self):
        """(time, engine idle seconds, seconds with no engine generating) at the first step and
        at the last: the steady state's window (with one step or none, from the first step or
        the start until now)."""
        m = self.manager
        start = self._idle_mark or (m.started, 0.0, 0.0)
        if self._idle_last is None or self._idle_last is self._idle_mark:
            now = m.clock()
            return start, (now, m.engine_idle_seconds(now), m.quiet_seconds(now))
        return start, self._idle_last

    def _engine_idle_fraction(self) -> float:
        """The engines' idle share (averaged over engines) over ``_window``."""
        (t0, idle0, _), (t1, idle1, _) = self._window()
        return min(max((idle1 - idle0) / max(t1 - t0, 1e-9), 0.0), 1.0)

    def _generation_fraction(self) -> float:
        """The share of the same window with at least one engine generating: a synchronous
        run's generation phase (Laminar's 83% of RL time), whatever the number of engines."""
        (t0, _, quiet0), (t1, _, quiet1) = self._window()
        return min(max(1.0 - (quiet1 - quiet0) / max(t1 - t0, 1e-9), 0.0), 1.0)

    def books(self) -> dict:
        s = self.manager.stats if self.manager else None
        return {"trajectories_generated": s.generated if s else 0,
                "trajectories_consumed": self.buffer.consumed,
                "trajectories_buffered": self.buffer.buffered,
                "trajectories_discarded": sum(self.buffer.discarded.values()),
                # started but neither ended (kept or discarded with a reason) nor in flight,
                # plus ended ones the books cannot place: 0 unless a trajectory vanished
                "trajectories_lost": ((s.started - s.generated - len(self.partial)) if s else 0)
                + ((s.generated - self.buffer.consumed - self.buffer.buffered
                    - sum(self.buffer.discarded.values())) if s else 0),
                "discarded_reasons": dict(self.buffer.discarded),
                "max_staleness_observed": self.max_staleness_observed,
                # what was trained on: trainer version - generating version, at consumption
                "staleness_trained": staleness_stats(c["staleness"] for c in self.consumed),
                "engine_pulls": s.pulls if s else 0, "resumed": s.resumed if s else 0,
                "repacked": s.repacked if s else 0, "repack_rounds": s.repack_rounds if s else 0,
                "trajectories_interrupted": s.interrupted if s else 0,
                "protocol_errors": s.protocol_errors if s else 0,
                "request_errors": s.request_errors if s else 0,
                "prompts_too_long": s.prompts_too_long if s else 0,
                "reward_worker_restarts": self.reward.restarts,
                "engine_versions": ({e.name: e.version for e in self.manager.engines}
                                    if self.manager else {}),
                "unhealthy_engines": list(s.unhealthy) if s else [],
                "engine_restarts": s.engine_restarts if s else 0,
                "evicted_engines": dict(s.evicted) if s else {},
                "engines_left": sorted(s.left) if s else [],
                "lost_engines": dict(s.lost) if s else {},
                "relay_failovers": self.relay_failovers,
                "trainer_restarts": self.trainer_restarts,
                **self.episode.books(self.consumed),
                "faults": len(self.faults),
                "trajectories_mixed_versions": self.mixed_version_consumed,
                **({"staleness_trained_newest_token": staleness_stats(
                    c.get("staleness_newest", c["staleness"]) for c in self.consumed)}
                   if self.mode == "areal" else {})}


def staleness_stats(values: Iterable[int]) -> dict:
    """``{"max", "mean", "histogram": {staleness: trajectories}}`` (max and mean None when
    nothing was consumed)."""
    values = list(values)
    histogram = {str(v): n for v, n in sorted(Counter(values).items())}
    return {"max": max(values) if values else None,
            "mean": round(sum(values) / len(values), 4) if values else None,
            "histogram": histogram}
