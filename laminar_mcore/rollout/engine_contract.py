"""SGLang 0.5.23's JSON contract gate for ``/generate``, as the CPU engine applies it.

SGLang checks a ``/generate`` body against its schema (``sglang/api/v1/api_types.py``,
``GenerateRequest.from_json_value``, called by ``http_server.generate_request``) before it does
anything else: a body that violates it -- a field of the wrong type, an unknown sampling
parameter -- is answered HTTP 400, stream or not. A body that passes and is refused later
(``tokenizer_manager.generate_request`` raises ``ValueError``: no prompt, a prompt longer than
the context, a sampling value out of range) is answered, for ``stream: true``, with HTTP 200,
one ``data: {"error": {"message", "type": "invalid_request_error", "code": 400, "retryable":
false}}`` chunk and ``data: [DONE]`` (``serve_generate_request``); without a stream, HTTP 400.
``contract_error`` is the first check, for the fields the CPU engine reads;
tests/test_request_errors.py compares its verdicts with SGLang's own decoder.
"""

from __future__ import annotations

from typing import Any, Optional

_INT = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed",
        "beam_width")
_FLOAT = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty")
_BOOL = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR = ("json_schema", "regex", "ebnf", "structural_tag")
_STR_OR_LIST = ("stop", "stop_regex")
_OTHER = ("stop_token_ids", "logit_bias", "custom_params", "watermark", "choice")
SAMPLING_KEYS = frozenset(_INT + _FLOAT + _BOOL + _STR + _STR_OR_LIST + _OTHER)


class ContractError(ValueError):
    pass


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _need(ok: bool, where: str, expected: str, value: Any) -> None:
    if not ok:
        raise ContractError(f"{where}: expected {expected}, got {type(value).__name__} "
                            f"{str(value)[:60]}")


def _token_ids(v, where: str) -> None:
    _need(isinstance(v, list), where, "an array of token ids or of such arrays", v)
    if v and not _num(v[0]):  # SGLang: [] and [number, ...] are one prompt, else a batch
        for i, row in enumerate(v):
            _need(isinstance(row, list), f"{where}[{i}]", "an array of token ids", row)
            for t in row:
                _need(_int(t), f"{where}[{i}]", "integer token ids", t)
    else:
        for t in v:
            _need(_int(t), where, "integer token ids", t)


def _one_or_list(v, where: str, check, expected: str) -> None:
    for x in (v if isinstance(v, list) else [v]):
        _need(check(x), where, expected, x)


def _sampling(v, where: str) -> None:
    _need(isinstance(v, dict), where, "an object (struct SamplingParams)", v)
    for key, x in v.items():
        if key not in SAMPLING_KEYS:
            raise ContractError(f"{where}: unknown field `{key}` (SGLang refuses unknown "
                                "sampling parameters; a seed is `sampling_seed`)")
        if x is None:
            continue
        if key in _INT:
            _need(_int(x), f"{where}.{key}", "an integer", x)
        elif key in _FLOAT:
            _need(_num(x), f"{where}.{key}", "a number", x)
        elif key in _BOOL:
            _need(isinstance(x, bool), f"{where}.{key}", "a boolean", x)
        elif key in _STR:
            _need(isinstance(x, str), f"{where}.{key}", "a string", x)
        elif key in _STR_OR_LIST:
            _one_or_list(x, f"{where}.{key}", lambda s: isinstance(s, str), "strings")
        elif key == "stop_token_ids":
            _need(isinstance(x, list) and all(_int(t) for t in x), f"{where}.{key}",
                  "an array of integers", x)


def contract_error(body: Any) -> Optional[str]:
    """Why ``body`` violates SGLang's ``/generate`` contract (None: it does not), for the
    fields the CPU engine reads; unknown top-level keys are ignored, as SGLang ignores them."""
    try:
        _need(isinstance(body, dict), "body", "a JSON object (struct GenerateRequest)", body)
        for key in ("rid", "text"):
            if body.get(key) is not None:
                _one_or_list(body[key], key, lambda s: isinstance(s, str), "strings")
        if body.get("input_ids") is not None:
            _token_ids(body["input_ids"], "input_ids")
        for key in ("stream", "return_text_in_logprobs"):
            if body.get(key) is not None:
                _need(isinstance(body[key], bool), key, "a boolean", body[key])
        if body.get("return_logprob") is not None:
            _one_or_list(body["return_logprob"], "return_logprob",
                         lambda b: isinstance(b, bool), "booleans")
        for key in ("logprob_start_len", "top_logprobs_num"):
            if body.get(key) is not None:
                _one_or_list(body[key], key, _int, "integers")
        if "routed_experts_start_len" in body:
            _need(_int(body["routed_experts_start_len"]), "routed_experts_start_len",
                  "an integer", body["routed_experts_start_len"])
        raw = body.get("sampling_params")
        if raw is not None:
            for i, sp in enumerate(raw if isinstance(raw, list) else [raw]):
                _sampling(sp, f"sampling_params[{i}]" if isinstance(raw, list)
                          else "sampling_params")
    except ContractError as exc:
        return str(exc)
    return None
