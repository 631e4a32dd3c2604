"""The controller's data module: prompt pool, partial response pool, experience buffer.

* ``PromptPool`` hands out prompts as GRPO groups (n samples per prompt), epoch by epoch in a
  seeded shuffled order; its position is part of a training checkpoint.
* ``PartialResponsePool`` holds every in-flight trajectory's tokens so far (streamed from its
  engine), so that a trajectory whose engine dies resumes elsewhere from what it already has.
* ``ExperienceBuffer`` collects finished, rewarded trajectories by group and hands complete
  groups to the trainer FIFO (sampler and eviction pluggable); everything it drops is counted
  with a reason, so generated = consumed + buffered + discarded holds at every moment.
"""

from __future__ import annotations

import json
import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence

from .trajectory import Trajectory


def load_prompts(paths: List[str], prompt_key: str = "prompt",
                 answer_key: str = "answer") -> List[dict]:
    """Rows of JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``, needs pyarrow) files.
    Rewards and evaluations read a row's ``answer``: with another ``answer_key`` (a dataset's
    own field name, ``data.answer_key``) each row's answer is copied there."""
    rows: List[dict] = []
    for path in paths:
        if path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(f"LMC-E700: {path}: reading Parquet needs pyarrow (pip install "
                                 "pyarrow)") from None
            rows.extend(pq.read_table(path).to_pylist())
            continue
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"LMC-E700: {path}:{line_no}: not JSON ({exc})") from None
    for i, row in enumerate(rows):
        if prompt_key not in row:
            raise ValueError(f"LMC-E701: row {i} has no {prompt_key!r} field; set data.prompt_key")
        if answer_key != "answer":
            if answer_key not in row:
                raise ValueError(f"LMC-E701: row {i} has no {answer_key!r} field; set "
                                 f"data.answer_key to the answer's field (its fields: "
                                 f"{sorted(row)})")
            row["answer"] = row[answer_key]
    if not rows:
        raise ValueError(f"LMC-E702: no prompts in {paths}")
    return rows


@dataclass
class PromptGroup:
    group_id: str
    index: int  # row index in the dataset
    row: dict
    n: int


class PromptPool:
    def __init__(self, rows: List[dict], n_samples: int, seed: int = 0):
        if n_samples < 1:
            raise ValueError("n_samples must be >= 1")
        self.rows, self.n_samples, self.seed = rows, n_samples, seed
        self.epoch, self.position, self.issued = 0, 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> List[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def next_group(self) -> PromptGroup:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffled(self.epoch)
        index = self._order[self.position]
        self.position += 1
        group = PromptGroup(f"e{self.epoch}-p{index}-{self.issued}", index, self.rows[index],
                            self.n_samples)
        self.issued += 1
        return group

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "issued": self.issued}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.issued = state["epoch"], state["position"], state["issued"]
        self._order = self._shuffled(self.epoch)


@dataclass
class InFlight:
    """A trajectory being generated: the ``Trajectory`` itself, whose response tokens and
    behaviour log-probs grow as they stream in, plus what its generation needs."""

    traj: Trajectory
    engine: Optional[str]  # the engine generating it now
    max_new_tokens: int = 0
    sampling: Dict[str, object] = field(default_factory=dict)  # the engine's sampling params
    ignore_eos: bool = False  # a forced length (benchmarks replaying a length distribution)
    sampling_seed: Optional[int] = None  # per-trajectory sampling seed (None: the engine's)
    migrate_to: Optional[str] = None  # repack: the engine it continues on once aborted here
    # mode=areal: aborted here for a weight update; resumes on the new weights (the engine's
    # version when it was interrupted)
    interrupted_at: Optional[int] = None
    # a multi-turn episode: between its turns the trajectory keeps its place on its engine, so
    # the engine does not pull another version until the episode ends (one version per episode)
    multi_turn: bool = False
    generating: bool = False  # a request of it runs on its engine now (else: between turns)
    # laminar's bound: its version fell more than eta behind the trainer's while it ran; it
    # is aborted and discarded as "stale" (it could never be trained on)
    stale: bool = False

    @property
    def rid(self) -> str:
        return self.traj.uid

    @property
    def group_id(self) -> str:
        return self.traj.group_id


class PartialResponsePool:
    """Laminar's partial response pool: every in-flight trajectory with its tokens so far."""

    def __init__(self):
        self._items: Dict[str, InFlight] = {}
        self._lock = threading.Lock()

    def start(self, item: InFlight) -> None:
        with self._lock:
            if item.rid in self._items:
                raise ValueError(f"trajectory {item.rid} is already in flight")
            self._items[item.rid] = item

    def append(self, rid: str, new_ids: List[int], new_logprobs: List[float]) -> None:
        """Add what a stream chunk generated (O(new tokens), whatever the length so far)."""
        if len(new_ids) != len(new_logprobs):
            raise ValueError(f"{rid}: {len(new_ids)} tokens but {len(new_logprobs)} log-probs")
        with self._lock:
            self._items[rid].traj.add_sampled(new_ids, new_logprobs)

    def finish(self, rid: str) -> InFlight:
        with self._lock:
            return self._items.pop(rid)

    def trajectories(self) -> List[Trajectory]:
        """Every in-flight trajectory now."""
        with self._lock:
            return [i.traj for i in self._items.values()]

    def on_engine(self, engine: str) -> List[InFlight]:
        with self._lock:
            return [i for i in self._items.values() if i.engine == engine]

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> List[dict]:
        """JSON-ready copies of every in-flight trajectory (declared fields only)."""
        from dataclasses import asdict

        with self._lock:
            return [asdict(i) for i in self._items.values()]


class ExperienceBuffer:
    """Finished, rewarded trajectories, handed to the trainer as complete groups."""

    def __init__(self, group_size: int, max_groups: Optional[int] = None,
                 sampler: Optional[Callable[[Deque[List[Trajectory]], int], List[List[Trajectory]]]] = None):
        self.group_size = group_size
        self.max_groups = max_groups
        self.sampler = sampler or _fifo
        self._open: "OrderedDict[str, List[Trajectory]]" = OrderedDict()
        self._ready: Deque[List[Trajectory]] = deque()
        self.discarded: Dict[str, int] = {}
        self.consumed = 0
        self.cond = threading.Condition()
        self._dropped: Dict[str, str] = {}  # group id -> why it can never complete
        self._held = 0  # trajectories in _ready and _open (``buffered`` in O(1))
        # called (under the lock: keep them short) whenever a group becomes ready
        self.on_ready: List[Callable[[], None]] = []
        # called (under the lock) with the trajectories discarded and why, where they are
        # known (the run's trace, data/trace.py)
        self.on_discard: List[Callable[[List[Trajectory], str], None]] = []
        # the oldest weight version that may still be trained on (``drop_older_than``): a
        # trajectory of an older one is discarded as "stale", its whole group with it
        self.min_version = 0
        # called (under the lock) with the id of each group dropped as stale, once
        self.on_stale: List[Callable[[str], None]] = []

    def add(self, traj: Trajectory) -> bool:
        """Keep ``traj`` until its group is complete; a member of a dropped group is counted
        as discarded instead (returns False), never left waiting for a group that cannot come."""
        with self.cond:
            if traj.weight_version < self.min_version:
                self.drop_stale_group(traj.group_id)
            if traj.group_id in self._dropped:
                self.discard(1, self._dropped[traj.group_id], [traj])
                return False
            members = self._open.setdefault(traj.group_id, [])
            members.append(traj)
            self._held += 1
            if len(members) == self.group_size:
                self._ready.append(self._open.pop(traj.group_id))
                while self.max_groups and len(self._ready) > self.max_groups:
                    dropped = self._ready.popleft()  # the stalest group goes first
                    self._held -= len(dropped)
                    self.discard(len(dropped), "evicted", dropped)
                self.cond.notify_all()
                for listener in self.on_ready:
                    listener()
            return True

    def discard(self, count: int, reason: str, trajs: Sequence[Trajectory] = ()) -> None:
        """Count ``count`` trajectories discarded for ``reason`` (``trajs``: those of them that
        are known, for the ``on_discard`` listeners)."""
        with self.cond:
            self.discarded[reason] = self.discarded.get(reason, 0) + count
            if trajs:
                for listener in self.on_discard:
                    listener(list(trajs), reason)

    def drop_group(self, group_id: str, reason: str) -> int:
        """Drop a group that can never complete (e.g. a member failed for good): its members
        held now and those that finish later are counted as discarded with ``reason``.
        Returns how many were held."""
        with self.cond:
            self._dropped.setdefault(group_id, reason)
            members = self._open.pop(group_id, [])
            if members:
                self._held -= len(members)
                self.discard(len(members), reason, members)
            return len(members)

    def drop_older_than(self, version: int) -> int:
        """Laminar's staleness bound at consumption: from now on nothing generated by a version
        before ``version`` is trained on. Groups held with such a member are discarded as
        "stale" (and so are their members that finish later); returns how many groups."""
        with self.cond:
            if version <= self.min_version:
                return 0
            self.min_version = version
            stale = [g for g in self._ready if _oldest(g) < version]
            if stale:
                self._ready = deque(g for g in self._ready if _oldest(g) >= version)
            stale += [g for g in self._open.values() if _oldest(g) < version]
            for members in stale:
                self._open.pop(members[0].group_id, None)
                self._drop_stale(members[0].group_id, members)
            return len(stale)

    def drop_stale_group(self, group_id: str) -> None:
        """``group_id`` (members still generating) is too old to train on: the members held
        now and those that finish later are discarded as "stale" (once)."""
        with self.cond:
            if group_id not in self._dropped:
                self._drop_stale(group_id, self._open.pop(group_id, []))

    def _drop_stale(self, group_id: str, held: List[Trajectory]) -> None:
        """(under the lock) ``group_id`` is too old to train on: ``held`` (its members held
        now, out of ``_ready``/``_open`` already) are discarded, later ones on arrival."""
        self._dropped[group_id] = "stale"
        self._held -= len(held)
        if held:
            self.discard(len(held), "stale", held)
        for listener in self.on_stale:
            listener(group_id)

    def is_dropped(self, group_id: str) -> bool:
        with self.cond:
            return group_id in self._dropped

    def take(self, groups: int, timeout: Optional[float] = None) -> Optional[List[Trajectory]]:
        """``groups`` complete groups (flattened), or None on timeout."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self._ready) >= groups, timeout=timeout):
                return None
            chosen = self.sampler(self._ready, groups)
            batch = [t for g in chosen for t in g]
            self.consumed += len(batch)
            self._held -= len(batch)
            return batch

    @property
    def buffered(self) -> int:
        return self._held

    def held(self) -> List[Trajectory]:
        """Every buffered trajectory now (complete groups first)."""
        with self.cond:
            return [t for g in self._ready for t in g] + [t for g in self._open.values()
                                                          for t in g]

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    def state_dict(self) -> dict:
        with self.cond:
            return {"ready": [[t.to_dict() for t in g] for g in self._ready],
                    "open": {k: [t.to_dict() for t in v] for k, v in self._open.items()},
                    "discarded": dict(self.discarded), "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        with self.cond:
            self._ready = deque([[Trajectory.from_dict(t) for t in g] for g in state["ready"]])
            self._open = OrderedDict((k, [Trajectory.from_dict(t) for t in v])
                                     for k, v in state["open"].items())
            self.discarded = dict(state["discarded"])
            self.consumed = state["consumed"]
            self._held = sum(len(g) for g in self._ready) + \
                sum(len(g) for g in self._open.values())


def _oldest(group: List[Trajectory]) -> int:
    return min(t.weight_version for t in group)


def _fifo(ready: Deque[List[Trajectory]], groups: int) -> List[List[Trajectory]]:
    return [ready.popleft() for _ in range(groups)]
