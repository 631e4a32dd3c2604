"""Agent episodes: multi-turn, tool-using trajectories written as ordinary OpenAI-client code.

``data.agent=module:function`` names ``async def agent(client, row)``: it talks to the policy
through ``client``, a real ``openai.AsyncOpenAI`` pointed at the controller's gateway
(agents/gateway.py) with this trajectory's own key, runs its tools (agents/sandbox.py
for untrusted code), and returns a reward (a number) or a final answer (a string, scored by
``data.reward_fn`` against the row's answer). Every model call is one turn of one trajectory,
tokens exact, tool outputs masked, all turns of one weight version (the gateway's guarantees).

An agent that raises ends its trajectory as discarded (``agent_error``) unless the exception
came from a limit the episode reached (``rollout.max_turns`` ...), which keeps the trajectory
with reward 0; a turn that could not be generated (its engine lost with no engine of its
version left, the run stopping) ends it as a single-turn trajectory would.

``evaluate_agent`` runs the same agent on held-out rows against one engine (no rollout
manager), for the before/after accuracy.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import time
import uuid
import zlib
from dataclasses import asdict
from typing import Callable, List, Optional

from ..data.pools import InFlight, PromptGroup
from ..data.trajectory import Trajectory
from ..controller.episode import Discard, Episode, Stopped
from .gateway import AgentGateway, EpisodeLimits, Session
from .sandbox import use_sandbox

logger = logging.getLogger(__name__)


def load_agent(path: str) -> Callable:
    """The agent function ``module:function``; a clear error if it is not an async function."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"LMC-E705: data.agent={path!r}: name it as 'module:function'")
    if module == "laminar_mcore.controller.agents":  # before the agents package (issue 55)
        raise ValueError(f"LMC-E705: data.agent={path!r}: the built-in agents moved to "
                         f"laminar_mcore.agents.builtin; use laminar_mcore.agents.builtin:{name}")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise ValueError(f"LMC-E705: data.agent={path!r}: {module} has no {name}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"LMC-E705: data.agent={path!r} must be an async function "
                         "agent(client, row)")
    return fn


def http_client():
    """One HTTP client for every agent's OpenAI client: no connection cap (a run has as many
    episodes in flight as its engines' capacity, hundreds per engine), keep-alive."""
    import logging

    import openai

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per agent call
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # (the openai client's own HTTP library: httpx2 in openai 3, with httpx's API)
    httpx = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__
                                    .split(".")[0])
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=256),
                             timeout=httpx.Timeout(3600.0, connect=30.0))


def openai_client(gateway: AgentGateway, session: Session, http):
    import openai

    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key,
                              max_retries=0, http_client=http)


_agent_errors = [0]  # agent failures logged so far (the first few, with their traceback)


async def run_agent(agent: Callable, gateway: AgentGateway, session: Session, row: dict,
                    score: Callable, http, max_episode_s: Optional[float] = None) -> float:
    """Run ``agent`` on ``row`` through ``session``; its reward. Raises ``Discard``/``Stopped``,
    or, for an internal failure of a turn, that exception (the manager counts those)."""
    client = openai_client(gateway, session, http)
    try:
        result = await asyncio.wait_for(agent(client, row), max_episode_s)
    except asyncio.TimeoutError:
        session.end_reason = session.end_reason or "max_episode_s"
        result = Discard("episode_timeout", f"rollout.max_episode_s={max_episode_s}")
    except Exception as exc:  # noqa: BLE001 - the agent's own failure, or a refused call
        result = exc
    finally:
        gateway.close_session(session)
        if session.busy and session.task is not None:  # a call it left running: cut off
            session.task.cancel()
            session.failure = session.failure or Discard(
                "agent_error", "the agent returned while a call of its trajectory ran")
    if isinstance(result, Discard):
        raise result
    if isinstance(session.failure, (Discard, Stopped)):
        raise session.failure
    if session.failure is not None:
        raise session.failure
    if isinstance(result, Exception) and session.end_reason is None:
        _agent_errors[0] += 1
        if _agent_errors[0] <= 3:
            logger.warning("agent %s failed (%d so far): %r", session.item.rid,
                           _agent_errors[0], result, exc_info=result)
    if session.turns == 0:
        detail = f": {type(result).__name__}: {result}" if isinstance(result, Exception) else ""
        raise Discard("agent_error", f"the agent never called the model{detail}")
    if isinstance(result, Exception):
        if session.end_reason is not None:
            return 0.0  # the limit's refusal reached the agent
        raise Discard("agent_error", f"{type(result).__name__}: {result}")
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        if not math.isfinite(result):
            raise Discard("reward_error", f"the agent returned the reward {result}")
        return float(result)
    if isinstance(result, str):
        reward, error = await score(result, row.get("answer"), row)
        if reward is None:
            raise Discard("reward_error", str(error))
        return reward
    if result is None and session.end_reason is not None:
        return 0.0
    raise Discard("agent_error", f"the agent returned {type(result).__name__}: an agent returns "
                                 "a reward (a number) or a final answer (a string)")


class AgentEpisode(Episode):
    """A GRPO group's n members each run the agent on the prompt row, as their own trajectory.

    ``prompt_ids(row)``: placeholder prompt tokens until the agent's first call renders its
    own messages (a Trajectory has a prompt from its start)."""

    def __init__(self, agent: Callable, gateway: AgentGateway, score: Callable,
                 prompt_ids: Callable[[dict], List[int]], sampling: dict, *,
                 seed: Optional[int] = None, max_episode_s: Optional[float] = None):
        self.agent, self.gateway, self.score = agent, gateway, score
        self.max_episode_s = max_episode_s
        self.prompt_ids, self.sampling, self.seed = prompt_ids, dict(sampling), seed
        self._http = None
        self.ended: dict = {}  # end reason -> episodes (the books)
        self.sandbox = "bubblewrap"  # rollout.sandbox (build_episode)

    def _sampling_seed(self, group_id: str, k: int) -> Optional[int]:
        if self.seed is None:
            return None
        return zlib.crc32(f"{self.seed}/{group_id}/{k}".encode()) & 0x7FFFFFFF

    def start(self, group: PromptGroup, version: int, engine: str) -> List[InFlight]:
        prompt = self.prompt_ids(group.row)
        items = []
        for k in range(group.n):
            traj = Trajectory(prompt_ids=list(prompt), response_ids=[], behav_logprobs=[],
                              weight_version=version, group_id=group.group_id,
                              uid=f"{group.group_id}-{k}-{uuid.uuid4().hex[:6]}",
                              timings={"submitted": time.time()},
                              metadata={"row_index": group.index})
            items.append(InFlight(traj, engine, sampling=self.sampling, multi_turn=True,
                                  max_new_tokens=0,
                                  sampling_seed=self._sampling_seed(group.group_id, k)))
        return items

    async def arun(self, ctx, item: InFlight, row: dict) -> None:
        if self._http is None:
            self._http = http_client()
        session = self.gateway.open(item, ctx)
        traj = item.traj
        try:
            traj.reward = await run_agent(self.agent, self.gateway, session, row, self.score,
                                          self._http, self.max_episode_s)
        finally:
            traj.metadata.update(session.counts())
            reason = session.end_reason or "done"
            self.ended[reason] = self.ended.get(reason, 0) + 1
        traj.timings["finished"] = traj.timings["rewarded"] = time.time()
        traj.metadata["engine"] = item.engine

    async def astart(self) -> None:
        await self.gateway.start()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.gateway.close()

    def books(self, consumed: List[dict]) -> dict:
        """How episodes ended (done, or the limit that ended them) and, per consumed episode,
        turns, tool calls and tool errors."""
        eps = [c for c in consumed if "turns" in c]
        n = max(len(eps), 1)
        sandbox = {"sandbox": self.sandbox}
        if self.sandbox == "unsafe-local":
            sandbox["sandbox_warning"] = ("rollout.sandbox=unsafe-local: tool code ran with no "
                                          "isolation")
        return {**sandbox, "episodes_ended": dict(self.ended),
                "turns_per_episode": sum(c["turns"] for c in eps) / n,
                "tool_calls_per_episode": sum(c["tool_calls"] for c in eps) / n,
                "tool_errors": sum(c.get("tool_errors", 0) for c in eps),
                "malformed_tool_calls": sum(c.get("malformed_tool_calls", 0) for c in eps)}


class EngineTurns:
    """``generate`` for a gateway session on one engine, without a rollout manager (an
    evaluation): each turn is one non-streaming /generate from the tokens the trajectory holds
    (whatever the engine's stream style)."""

    def __init__(self, client):
        self.client = client

    async def generate(self, item: InFlight) -> str:
        traj = item.traj
        params = dict(item.sampling)
        params["max_new_tokens"] = item.max_new_tokens - len(traj.response_ids)
        if params.get("sampling_seed") is not None:  # each turn its own stream, as _stream does
            params["sampling_seed"] = (params["sampling_seed"] + len(traj.response_ids)) \
                & 0x7FFFFFFF
        for _ in range(50):
            out = await self.client.generate(traj.prompt_ids + traj.response_ids, params)
            meta = out["meta_info"]
            reason = meta["finish_reason"]["type"]
            if reason != "abort":
                ids = list(out["output_ids"])
                lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
                traj.add_sampled(ids, lps if len(lps) == len(ids) else [0.0] * len(ids))
                return reason
            await asyncio.sleep(0.1)  # paused for a weight update (mode=areal): ask again
        raise Discard("aborted", "an evaluation turn was aborted 50 times in a row")


async def evaluate_agent(url: str, rows: List[dict], agent: Callable, gateway: AgentGateway,
                         score: Callable, prompt_ids: Callable[[dict], List[int]],
                         sampling: dict, *, seed: int = 0, api_key: Optional[str] = None,
                         greedy: bool = True) -> dict:
    """Sampled (and greedy) accuracy of the agent on ``rows`` with the engine at ``url``, and
    its turns and tool calls per episode."""
    from ..rollout.client import SGLangClient

    async with SGLangClient(url, api_key=api_key) as client:
        ctx = EngineTurns(client)
        http = http_client()
        try:
            async def one(i, row, params):
                traj = Trajectory(prompt_ids=prompt_ids(row), response_ids=[],
                                  behav_logprobs=[], weight_version=0, group_id=f"eval-{i}")
                item = InFlight(traj, None, sampling=params)
                session = gateway.open(item, ctx)
                try:
                    reward = await run_agent(agent, gateway, session, row, score, http)
                except Discard:
                    reward = 0.0
                return reward, session.counts()

            sampled = await asyncio.gather(*[
                one(i, row, dict(sampling, sampling_seed=seed * 100_003 + i))
                for i, row in enumerate(rows)])
            argmax = await asyncio.gather(*[
                one(i, row, dict(sampling, temperature=0.0))
                for i, row in enumerate(rows)]) if greedy else []
        finally:
            await http.aclose()
    n = max(len(rows), 1)
    out = {"accuracy": sum(r for r, _ in sampled) / n,
           "turns_per_episode": sum(c["turns"] for _, c in sampled) / n,
           "tool_calls_per_episode": sum(c["tool_calls"] for _, c in sampled) / n,
           "tool_errors": sum(c["tool_errors"] for _, c in sampled)}
    if greedy:
        out["accuracy_greedy"] = sum(r for r, _ in argmax) / n
    return out


# ---------------------------------------------------------------------- a run's agent
def limits_of(cfg) -> EpisodeLimits:
    r = cfg.rollout
    return EpisodeLimits(max_turns=r.max_turns, max_tool_calls=r.max_tool_calls,
                         max_episode_tokens=r.max_episode_tokens,
                         max_new_tokens=r.sampling.max_new_tokens)


# ------------------------------------------------- the controller's episode plug-in (episode.py)
def build_episode(cfg, task, score) -> AgentEpisode:
    """The run's agent episode, with its gateway (started by the controller on its loop)."""
    if task.chat is None:
        raise ValueError("LMC-E706: data.agent needs a tokenizer with a chat template: "
                         "model.path's, or a built-in agent task (data.task=tool_addition)")
    sandbox = use_sandbox(cfg.rollout.sandbox)  # refuses to start without a working bwrap
    gateway = AgentGateway(task.chat, limits_of(cfg), model_name=cfg.run_name)
    episode = AgentEpisode(load_agent(cfg.data.agent), gateway, score, task.codec.encode_prompt,
                           asdict(cfg.rollout.sampling), seed=cfg.seed,
                           max_episode_s=cfg.rollout.max_episode_s)
    episode.sandbox = sandbox
    from ..rollout.launcher import served_context_length  # (the engines' context, as SGLang's)

    context = served_context_length(cfg.rollout, task.model_path)
    if context is not None and cfg.rollout.max_episode_tokens > context:
        raise ValueError(f"LMC-E707: rollout.max_episode_tokens={cfg.rollout.max_episode_tokens} "
                         f"is over the model's context ({context} positions, "
                         f"{task.model_path}): an episode would outgrow what the engines serve; "
                         "lower it")
    return episode


async def evaluate(cfg, task, url: str, api_key: Optional[str] = None):
    """The run's agent on its held-out rows with the engine at ``url`` (an ``EvalResult``; the
    version is the engine's)."""
    from ..reward import load_reward_fn
    from ..rollout.client import SGLangClient
    from ..controller.evaluation import EvalResult

    use_sandbox(cfg.rollout.sandbox)

    fn = load_reward_fn(cfg.data.reward_fn)

    async def score(text, answer, row):
        extra = {k: v for k, v in row.items() if k not in ("answer", "response_text")}
        return await asyncio.to_thread(fn, text, answer, **extra), None

    gateway = AgentGateway(task.chat, limits_of(cfg), model_name=cfg.run_name)
    await gateway.start()
    try:
        out = await evaluate_agent(url, task.evals, load_agent(cfg.data.agent), gateway, score,
                                   task.codec.encode_prompt, asdict(cfg.rollout.sampling),
                                   seed=0, api_key=api_key)
    finally:
        await gateway.close()
    async with SGLangClient(url, api_key=api_key) as client:
        raw = await client.get_weight_version()
    version = int(raw) if raw.isdigit() else None
    details = {k: out[k] for k in ("turns_per_episode", "tool_calls_per_episode", "tool_errors")}
    return EvalResult(out["accuracy"], out.get("accuracy_greedy"), version,
                      [version] if version is not None else [], details)
