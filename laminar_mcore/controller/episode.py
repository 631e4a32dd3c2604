"""What one episode of rollout does: the plug-in point for rollout logic (AReaL's ``arun_episode``).

The rollout manager owns engines, weight versions, admission, repack and failure handling; an
``Episode`` owns what a group of trajectories *is*: how its members start from a prompt row
(``start``) and what one member does until it is rewarded (``arun``). ``arun`` generates
through the context (``ctx.generate``: streaming into the trajectory, resumed on another engine
of the same version if its engine dies, moved by repack) and rewards it; it sets the
trajectory's reward, or raises ``Discard(reason)``. Every mode
(laminar, one_step, sync) runs ``SingleTurn``: one prompt, one completion, one reward.

Other kinds of episode are plug-ins (``EPISODE_PLUGINS``): a module, named by a string and
imported only when a run asks for it, with ``build_episode(cfg, task, score) -> Episode`` and
``async evaluate(cfg, task, url, api_key) -> EvalResult``. Multi-turn, tool-using agents
(``data.agent``) are the ``laminar_mcore.agents`` plug-in; the controller never imports it.
"""

from __future__ import annotations

import time
import uuid
import zlib
from dataclasses import dataclass
import importlib
from types import ModuleType
from typing import Callable, List, Optional, Protocol

from ..data.pools import InFlight, PromptGroup
from ..data.trajectory import Trajectory


class Discard(Exception):
    """The trajectory ends unusable; ``reason`` is how the books count it."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Stopped(Exception):
    """The run stopped while a trajectory was generating: it stays in the partial pool."""


@dataclass
class TaskCodec:
    """Prompt row -> token ids, token ids -> text (the run's tokenizer or the built-in task's)."""

    encode_prompt: Callable[[dict], List[int]]
    decode: Callable[[List[int]], str]


class EpisodeContext(Protocol):
    """What the rollout manager offers an episode."""

    async def generate(self, item: InFlight) -> str:
        """Generate ``item`` to its end on weights of its own version; returns SGLang's finish
        reason type ("stop" or "length"). Raises ``Discard`` when it cannot finish, ``Stopped``
        when the run stops first."""


class Episode:
    """The interface; see the module docstring."""

    def start(self, group: PromptGroup, version: int, engine: str) -> List[InFlight]:
        raise NotImplementedError

    async def arun(self, ctx: EpisodeContext, item: InFlight, row: dict) -> None:
        raise NotImplementedError

    async def astart(self) -> None:
        """Start what the episode serves (an agent gateway), on the controller's event loop."""

    async def aclose(self) -> None:
        """Stop it; called once the rollout manager stopped."""

    def books(self, consumed: List[dict]) -> dict:
        """The episode's own figures for the run's books (``consumed``: the consumed records)."""
        return {}


# episode kind -> the module that builds it (see the module docstring)
EPISODE_PLUGINS = {"agent": "laminar_mcore.agents.episode"}


def episode_plugin(cfg) -> Optional[ModuleType]:
    """The plug-in of the run's episode kind; None for ``SingleTurn``."""
    return importlib.import_module(EPISODE_PLUGINS["agent"]) if cfg.data.agent else None


class SingleTurn(Episode):
    """One prompt -> one completion -> one reward, for each of a GRPO group's n members.

    ``seed``: member k of a group samples with its own ``sampling_seed`` derived from
    (seed, group id, k), so what it generates does not depend on which engine ran it or what
    ran beside it (a resumed run regenerates the same samples). ``length_fn(group_id, k)`` may
    force a member's length (benchmarks replaying a length distribution; EOS is then ignored).
    ``score(text, answer, row)`` is awaited for ``(reward, error)`` (the reward service's)."""

    def __init__(self, codec: TaskCodec, sampling: dict, score: Callable, *,
                 seed: Optional[int] = None,
                 length_fn: Optional[Callable[[str, int], Optional[int]]] = None):
        self.codec, self.sampling, self.score = codec, dict(sampling), score
        self.seed, self.length_fn = seed, length_fn

    def _sampling_seed(self, group_id: str, k: int) -> Optional[int]:
        if self.seed is None:
            return None
        return zlib.crc32(f"{self.seed}/{group_id}/{k}".encode()) & 0x7FFFFFFF

    def start(self, group: PromptGroup, version: int, engine: str) -> List[InFlight]:
        prompt_ids = self.codec.encode_prompt(group.row)
        items = []
        for k in range(group.n):
            forced = self.length_fn(group.group_id, k) if self.length_fn else None
            traj = Trajectory(prompt_ids=list(prompt_ids), response_ids=[], behav_logprobs=[],
                              weight_version=version, group_id=group.group_id,
                              uid=f"{group.group_id}-{k}-{uuid.uuid4().hex[:6]}",
                              timings={"submitted": time.time()},
                              metadata={"row_index": group.index})
            items.append(InFlight(
                traj, engine, sampling=self.sampling, ignore_eos=bool(forced),
                max_new_tokens=int(forced or self.sampling.get("max_new_tokens", 64)),
                sampling_seed=self._sampling_seed(group.group_id, k)))
        return items

    async def arun(self, ctx: EpisodeContext, item: InFlight, row: dict) -> None:
        traj = item.traj
        traj.finish_reason = await ctx.generate(item)
        traj.timings["finished"] = time.time()
        reward, error = await self.score(self.codec.decode(traj.response_ids),
                                         row.get("answer"), row)
        if reward is None:
            raise Discard("reward_error", str(error))
        traj.reward = reward
        traj.timings["rewarded"] = time.time()
        traj.metadata["engine"] = item.engine
