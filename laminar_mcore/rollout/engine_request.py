"""What a request to the CPU engine is: SGLang 0.5.23's sampling parameters, validated as
SGLang validates them (unknown keys refused; what this engine does not implement refused, never
silently ignored), and the state of one request as the scheduler advances it (output tokens and
log-probs, weight-version spans, KV slots, routed experts, finish reason).

Plain data: it never runs the model, never touches the KV pool or the engine thread
(``engine_core`` does), and never speaks HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch


class RequestError(ValueError):
    """A request the engine cannot serve as given (answered with 400)."""


# SGLang 0.5.23's SamplingParams (sglang/api/v1/api_types.py): unknown keys are refused there
# too. Values that change sampling in ways this engine does not implement are refused below.
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
_UNSUPPORTED_IF_SET = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag",
                       "custom_params", "beam_width", "watermark")
TOP_K_OFF = 1 << 30  # SGLang's "no top-k"


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    stream_interval: Optional[int] = None
    n: int = 1
    sampling_seed: Optional[int] = None

    @classmethod
    def from_request(cls, raw: Optional[dict]) -> "SamplingParams":
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(SGLANG_SAMPLING_FIELDS))
        if unknown:
            raise RequestError(f"sampling_params: unknown field `{unknown[0]}` (SGLang refuses "
                               f"unknown sampling parameters; a seed is `sampling_seed`)")
        for name in _UNSUPPORTED_IF_SET:
            if raw.get(name) is not None:
                raise RequestError(f"sampling_params.{name} is not supported by the CPU engine")
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
            if raw.get(name) is not None and float(raw[name]) != neutral:
                raise RequestError(f"sampling_params.{name} is not supported by the CPU engine")
        if raw.get("logit_bias") or raw.get("choice"):
            raise RequestError("sampling_params.logit_bias / choice are not supported by the CPU engine")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        try:
            p = cls(**known)
            p.max_new_tokens = int(p.max_new_tokens)
            p.temperature, p.top_p, p.min_p = float(p.temperature), float(p.top_p), float(p.min_p)
            p.top_k = int(p.top_k)
            p.min_new_tokens, p.n = int(p.min_new_tokens), int(p.n)
            p.stop = [p.stop] if isinstance(p.stop, str) else [str(x) for x in p.stop]
            p.stop_token_ids = [int(t) for t in p.stop_token_ids]
            p.sampling_seed = None if p.sampling_seed is None else int(p.sampling_seed)
            p.stream_interval = None if p.stream_interval is None else int(p.stream_interval)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad sampling_params: {exc}") from None
        if p.max_new_tokens < 0 or p.min_new_tokens < 0:
            raise RequestError("sampling_params.max_new_tokens and min_new_tokens must be >= 0")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1 \
                or p.top_k == 0 or p.top_k < -1:
            raise RequestError("need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1 and "
                               "top_k = -1 or >= 1")
        if p.top_k == -1:
            p.top_k = TOP_K_OFF
        if p.n < 1:
            raise RequestError("sampling_params.n must be >= 1")
        return p


@dataclass
class Request:
    rid: str
    input_ids: List[int]
    params: SamplingParams
    on_event: Callable[["Request", bool], None]  # (request, finished) from the engine thread
    logprob_start_len: int = -1  # >= 0: report prompt log-probs from this position
    top_logprobs_num: int = 0
    output_ids: List[int] = field(default_factory=list)
    output_logprobs: List[float] = field(default_factory=list)
    output_top_logprobs: List[List[Tuple[float, int]]] = field(default_factory=list)
    input_logprobs: Optional[List[Optional[float]]] = None
    input_top_logprobs: Optional[List[Optional[List[Tuple[float, int]]]]] = None
    finish_reason: Optional[dict] = None
    slots: Optional[torch.Tensor] = None  # KV slots of positions [0, len(slots))
    cached_len: int = 0
    generator: Optional[torch.Generator] = None
    created: float = field(default_factory=time.time)
    # SGLang's weight-version spans: [version, start, end) over output positions.
    spans: List[List] = field(default_factory=list)
    stop_trim: int = 0  # characters of a matched stop string to cut from the text
    # MoE routing capture (SGLang's return_routed_experts): the experts of every position the
    # model has run, int32 [positions, layers, top-k] per forward call
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed: List[torch.Tensor] = field(default_factory=list)
    # Aborted while in the waiting queue (never started, or retracted): SGLang answers such a
    # request from its tokenizer manager with a final chunk of its own shape
    # (tokenizer_manager._handle_abort_req).
    aborted_waiting: bool = False

    def routed_experts(self) -> Optional[torch.Tensor]:
        """SGLang's ``routed_experts``: positions [start_len, seqlen - 1), int32."""
        if not self.routed:
            return None
        return torch.cat(self.routed)[self.routed_experts_start_len:]

    @property
    def prefix(self) -> List[int]:
        return self.input_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def weight_versions(self) -> List[dict]:
        return [{"version": v, "start": a, "end": b} for v, a, b in self.spans]
