"""The Trajectory: one dataclass from the engine that generated it to the loss that consumes it.

It carries everything the trainer needs and nothing is re-derived later: the prompt and response
token ids, the behaviour policy's log-prob of every response token (as the engine reported it),
which response tokens the policy sampled (``loss_mask``: a multi-turn episode's tool outputs and
chat-template tokens sit between its turns and are not trained),
the weight version that generated it (exactly one), its reward and GRPO group, why generation
stopped, and the timings of its life. It is plain data: no torch, no engine or trainer imports.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Trajectory:
    prompt_ids: List[int]
    response_ids: List[int]
    behav_logprobs: List[float]  # one per response token, from the engine that sampled it
    weight_version: int
    group_id: str  # trajectories of one prompt share it (GRPO groups)
    reward: Optional[float] = None
    finish_reason: str = "stop"
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Which engine weight version generated which response tokens, as SGLang reports it:
    # [{"version": "3", "start": 0, "end": 17}] (token offsets into response_ids). A trajectory
    # of Laminar's has one span; a resumed or repacked one has one per request, all of its version.
    version_spans: List[Dict[str, Any]] = field(default_factory=list)
    # MoE routing replay: the experts every position [0, num_tokens - 1) was routed to by the
    # engine, as SGLang returns them (base64 of int32 [positions, layers, top-k]), one segment
    # per request in order (a resumed request continues where the previous one stopped).
    routed_experts: List[str] = field(default_factory=list)
    # 1 where the policy sampled the response token, 0 where the environment put it there (a
    # multi-turn episode's tool outputs and chat-template tokens between turns; their behaviour
    # log-prob is 0.0 and they are never trained). Empty: every response token was sampled.
    loss_mask: List[int] = field(default_factory=list)
    # Seconds since the epoch: submitted, first_token, finished, rewarded, consumed, ...
    timings: Dict[str, float] = field(default_factory=dict)
    metadata: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"trajectory {self.uid}: empty prompt")
        if len(self.behav_logprobs) != len(self.response_ids):
            raise ValueError(f"trajectory {self.uid}: {len(self.response_ids)} response tokens "
                             f"but {len(self.behav_logprobs)} behaviour log-probs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory {self.uid}: finish_reason {self.finish_reason!r} is "
                             f"not one of {FINISH_REASONS}")
        if self.loss_mask:
            if len(self.loss_mask) != len(self.response_ids):
                raise ValueError(f"trajectory {self.uid}: {len(self.response_ids)} response tokens "
                                 f"but a loss mask of {len(self.loss_mask)}")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"trajectory {self.uid}: the loss mask holds values other "
                                 "than 0 and 1")
        if self.weight_version < 0:
            raise ValueError(f"trajectory {self.uid}: negative weight_version")
        if any(not math.isfinite(x) or x > 1e-6 for x in self.behav_logprobs):
            raise ValueError(f"trajectory {self.uid}: behaviour log-probs must be finite and <= 0")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def sampled_mask(self) -> List[int]:
        """1 per response token the policy sampled (``loss_mask``, all ones when empty)."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)

    @property
    def num_sampled(self) -> int:
        """How many response tokens the policy sampled (the tokens the loss is over)."""
        return sum(self.loss_mask) if self.loss_mask else len(self.response_ids)

    def add_sampled(self, ids: List[int], logprobs: List[float]) -> None:
        """Tokens the policy sampled, with their behaviour log-probs (a stream chunk)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{self.uid}: {len(ids)} tokens but {len(logprobs)} log-probs")
        self.response_ids.extend(ids)
        self.behav_logprobs.extend(logprobs)
        if self.loss_mask:
            self.loss_mask.extend([1] * len(ids))

    def add_environment(self, ids: List[int]) -> None:
        """Tokens the policy did not sample (a tool's output, the chat template's markup between
        turns): they are context for the next turn, masked out of the loss."""
        if not ids:
            return
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.response_ids)
        self.response_ids.extend(ids)
        self.behav_logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))

    def staleness(self, trainer_version: int) -> int:
        """How many versions the trainer is ahead of the policy that generated this."""
        return trainer_version - self.weight_version

    def versions_seen(self) -> List[str]:
        """The distinct engine weight versions of ``version_spans``, in order."""
        seen: List[str] = []
        for span in self.version_spans:
            if span["version"] not in seen:
                seen.append(span["version"])
        return seen

    def add_version_spans(self, spans, offset: int, new_tokens: int, fallback: str) -> None:
        """Record one request's spans (offsets relative to its own output) as spans of the
        whole response, starting at ``offset``; without spans from the engine, one span of
        ``fallback`` covers the request's ``new_tokens``. Adjacent spans of one version merge."""
        spans = [dict(s) for s in spans or ()] or (
            [{"version": fallback, "start": 0, "end": new_tokens}] if new_tokens else [])
        for span in spans:
            span = {"version": str(span["version"]), "start": int(span["start"]) + offset,
                    "end": int(span["end"]) + offset}
            last = self.version_spans[-1] if self.version_spans else None
            if last is not None and last["version"] == span["version"] and \
                    last["end"] >= span["start"]:
                last["end"] = max(last["end"], span["end"])
            elif span["end"] > span["start"]:
                self.version_spans.append(span)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready (the controller's ``/batch`` and checkpoints); ``from_dict`` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Trajectory":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Trajectory fields: {sorted(unknown)}")
        return cls(**data)
