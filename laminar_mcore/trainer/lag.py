"""Delayed publication (``weight_sync.publish_lag``, the knob of ``bench.staleness``).

With a lag L > 0, the version made at step v is not published then: ``LaggedPublisher`` keeps a
host copy of this rank's parameters for each of the last L versions and, at step v, publishes
the copy of version v - L (nothing while v - L < 1: the engines keep the weights they hold).
The weights of v - L are copied into the parameters, exported into the publisher's host buckets
(``WeightPublisher.publish`` returns once they are filled: the sender thread reads the buckets,
never the parameters) and the parameters are put back, bit for bit, before the next step. The
optimizer's state (main fp32 parameters, moments) is never touched. ``finish`` publishes the
newest weights unlagged, so the final evaluation sees them.

Engines therefore hold weights at least L versions behind the trainer, and every trajectory is
consumed at least min(step - 1, L) versions stale. With L = 0 every call passes straight through.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, List, Optional, Tuple

import torch

from .publisher import PublishStats


def _params(model) -> List[torch.Tensor]:
    """This rank's parameters, in the order the export reads them (the unwrapped module)."""
    while hasattr(model, "module"):
        model = model.module
    return [p for _, p in model.named_parameters()]


class LaggedPublisher:
    """Publishes version v - ``lag`` at step v through ``publisher`` (a ``WeightPublisher``).

    ``published``: the newest version published so far (the resumed version after a resume;
    0, the initial weights the engines start with, otherwise). Every rank of the trainer world
    calls ``publish`` / ``finish`` with the same versions (the gathers of the export are
    collective); only ranks that take part in the export keep copies.
    """

    def __init__(self, publisher, model, lag: int, published: int = 0):
        if lag < 0:
            raise ValueError(f"weight_sync.publish_lag={lag} must be >= 0")
        self.publisher = publisher
        self.lag = int(lag)
        self.published = int(published)
        self.keeps = bool(getattr(publisher, "exports", True))
        self.params = _params(model)
        self.pending: Deque[Tuple[int, Optional[List[torch.Tensor]]]] = deque()

    def _snapshot(self) -> Optional[List[torch.Tensor]]:
        if not self.keeps:
            return None
        with torch.no_grad():
            return [p.detach().to("cpu", copy=True) for p in self.params]

    def _load(self, snapshot: Optional[List[torch.Tensor]]) -> None:
        if snapshot is None:
            return
        with torch.no_grad():
            for p, saved in zip(self.params, snapshot):
                p.copy_(saved)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def publish(self, version: int) -> PublishStats:
        """After the step that made ``version``: publish the weights ``lag`` versions older (if
        a copy of them is held). Returns the publisher's stats; when nothing is due, zeros with
        the version the engines can reach (``published``)."""
        if self.lag == 0:
            stats = self.publisher.publish(version)
            self.published = max(self.published, version)
            return stats
        t0 = time.perf_counter()
        if version > self.published and (not self.pending or version > self.pending[-1][0]):
            self.pending.append((version, self._snapshot()))
        due = None
        while self.pending and self.pending[0][0] <= version - self.lag:
            due = self.pending.popleft()  # the newest due one is published; older ones drop
        if due is None:
            return PublishStats(self.published, time.perf_counter() - t0, 0, 0)
        # the current weights, to put back: the copy just taken if this step made a version
        current = self.pending[-1][1] if self.pending and self.pending[-1][0] == version \
            else self._snapshot()
        stats = self._publish_saved(*due, current)
        return PublishStats(stats.version, time.perf_counter() - t0, stats.nbytes, stats.buckets,
                            waited_previous_s=stats.waited_previous_s)

    def _publish_saved(self, version: int, saved: Optional[List[torch.Tensor]],
                       current: Optional[List[torch.Tensor]]) -> PublishStats:
        """Publish ``saved`` (a held copy) as ``version``, then put ``current`` back."""
        self._load(saved)
        try:
            # returns once the host buckets are filled (the gathers of the export done), so the
            # parameters are free to change again
            stats = self.publisher.publish(version)
        finally:
            self._load(current)
        self.published = version
        return stats

    def finish(self, version: int) -> Optional[PublishStats]:
        """After the last step: publish the current weights as ``version`` (unlagged) unless
        they already are; drops the held copies."""
        self.pending.clear()
        if version <= self.published:
            return None
        stats = self.publisher.publish(version)
        self.published = version
        return stats
