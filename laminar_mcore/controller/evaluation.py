"""The policy's accuracy on the held-out set: sampled (the run's sampling parameters, a fixed
seed per prompt) and greedy (temperature 0), on one engine, with the weight version it served.

Evaluation runs before training, every ``trainer.eval_interval`` steps while training (on a
rollout engine once it holds that step's version: verl's ``test_freq``) and after training.
A request aborted under it (``mode=areal`` pauses engines with abort for each update) is sent
again, so every prompt is scored once.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

from ..rollout.client import SGLangClient
from .episode import TaskCodec


@dataclass
class EvalResult:
    accuracy: float  # mean reward of the samples (the policy's success rate)
    accuracy_greedy: Optional[float]  # mean reward at temperature 0; None if not asked
    version: Optional[int]  # the newest weight version that served a request
    versions: List[int]  # every version that served one (engines may pull during an eval)
    # agent runs: turns_per_episode, tool_calls_per_episode, tool_errors of the sampled episodes
    details: Optional[dict] = None

    def record(self) -> dict:
        out = {k: v for k, v in asdict(self).items()
               if v is not None and k not in ("versions", "details")}
        out.update(self.details or {})
        return out


async def _generate(client: SGLangClient, ids: List[int], sampling: dict, attempts: int = 50):
    for _ in range(attempts):
        out = await client.generate(ids, sampling)
        if out["meta_info"]["finish_reason"]["type"] != "abort":
            return out
        await asyncio.sleep(0.1)  # paused for a weight update: ask again
    raise RuntimeError(f"LMC-E608: an evaluation request was aborted {attempts} times in a row")


async def evaluate(url: str, rows: List[dict], codec: TaskCodec, sampling: dict, reward_fn: str,
                   seed: int = 0, *, greedy: bool = True, api_key: Optional[str] = None,
                   max_new_tokens_fn: Optional[Callable[[dict], int]] = None) -> EvalResult:
    """Sampled (and, with ``greedy``, greedy) accuracy of the engine at ``url`` on ``rows``.
    ``max_new_tokens_fn(row)``: the longest response the verifier can accept for ``row`` (the
    built-in exact-match task: the answer and EOS); generation stops there."""
    from ..reward import load_reward_fn

    fn = load_reward_fn(reward_fn)

    def score(outs) -> float:
        scores = [fn(codec.decode(o["output_ids"]), row.get("answer"),
                     **{k: v for k, v in row.items() if k not in ("answer", "response_text")})
                  for o, row in zip(outs, rows)]
        return sum(scores) / max(len(scores), 1)

    def params(row: dict, **extra) -> dict:
        out = dict(sampling, **extra)
        if max_new_tokens_fn is not None:
            out["max_new_tokens"] = min(int(out.get("max_new_tokens", 1 << 30)),
                                        int(max_new_tokens_fn(row)))
        return out

    async with SGLangClient(url, api_key=api_key) as client:
        sampled = await asyncio.gather(*[
            _generate(client, codec.encode_prompt(row),
                      params(row, sampling_seed=seed * 100_003 + i))
            for i, row in enumerate(rows)])
        argmax = await asyncio.gather(*[
            _generate(client, codec.encode_prompt(row), params(row, temperature=0.0))
            for row in rows]) if greedy else []
    versions = sorted({int(v) for o in sampled + argmax
                       if str(v := o["meta_info"].get("weight_version", "")).isdigit()})
    # the verifier may be slow (math-verify): off the event loop, which serves the run
    accuracy = await asyncio.to_thread(score, sampled)
    accuracy_greedy = await asyncio.to_thread(score, argmax) if greedy else None
    return EvalResult(accuracy, accuracy_greedy, versions[-1] if versions else None, versions)
