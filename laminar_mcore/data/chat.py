"""Chat turns as tokens: what a multi-turn episode's next prompt is, token for token.

Token-in, token-out: a turn's prompt is the exact tokens of every earlier turn (the prompt, what
the engine sampled, what the environment added) followed by the *new* messages rendered by the
tokenizer's chat template. The model's own text is never re-tokenised: "12" sampled as the two
tokens "1" "2" stays two tokens, where re-encoding the conversation would give the one token
"12" -- and the trainer would train on tokens no policy produced.

``ChatFormat.continuation`` finds the new messages' tokens by rendering the conversation with
and without them and taking the difference of the two texts, plus the markup the template
writes after an assistant message's end-of-turn token (Qwen's "\\n" after ``<|im_end|>``). A
template whose rendering of earlier messages changes once later ones follow (Qwen3 drops the
reasoning of earlier turns) cannot be continued token-exactly; it gets a clear error.

Tool calls are parsed from the model's text by the chat template's convention (Qwen's and
Hermes's: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) into OpenAI's
``tool_calls``.

``demo_tokenizer()`` is the agent demo's character tokenizer with a Qwen-style chat template
(nothing downloaded): characters, the chat markers as special tokens, and the tool-call
boilerplate as single added tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, List, Optional, Sequence, Tuple

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class TemplateError(ValueError):
    """The chat template cannot continue the conversation token-exactly."""


def parse_tool_calls(text: str) -> Tuple[str, List[dict], int]:
    """(content without the tool-call blocks, OpenAI ``tool_calls``, malformed blocks). A block
    that is not JSON with a string ``name`` and an object ``arguments`` stays in the content
    and is counted as malformed."""
    calls, bad, kept = [], 0, []
    last = 0
    for m in TOOL_CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
            name, args = body["name"], body.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    kept.append(text[last:])
    return "".join(kept).strip(), calls, bad


def _plain(message: Any) -> dict:
    """An OpenAI message (a dict, or the ``openai`` client's model) as a plain dict; content
    given as text parts ([{"type": "text", "text": ...}]) is joined into one string."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"LMC-E400: a message must be an object with a role; got "
                         f"{message!r:.80}")
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError("LMC-E400: only text content parts are served")
        message["content"] = "".join(p.get("text", "") for p in content)
    return message


def same_message(sent: Any, recorded: dict) -> bool:
    """Whether ``sent`` (from the agent) is ``recorded`` (what the conversation holds): role and
    content, and for an assistant message its tool calls' names and arguments (as JSON)."""
    a, recorded = _plain(sent), _plain(recorded)
    if a.get("role") != recorded.get("role") or (a.get("content") or "") != \
            (recorded.get("content") or ""):
        return False
    if recorded.get("role") != "assistant":
        return True

    def calls(m):
        out = []
        for c in m.get("tool_calls") or []:
            f = c.get("function", {})
            try:
                args = json.loads(f.get("arguments") or "{}")
            except ValueError:
                args = f.get("arguments")
            out.append((f.get("name"), args))
        return out

    return calls(a) == calls(recorded)


class ChatFormat:
    """A Hugging Face tokenizer with a chat template, used token-exactly (module docstring)."""

    def __init__(self, tokenizer, eos_id: Optional[int] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("LMC-E704: the tokenizer has no chat_template: agent episodes "
                                "render messages with it (set one in tokenizer_config.json)")
        self.tok = tokenizer
        self.eos_id = self._end_of_turn() if eos_id is None else eos_id
        if self.eos_id is None:
            raise TemplateError("LMC-E704: the tokenizer has no eos_token: a turn ends at it")
        self.eos_text = tokenizer.decode([self.eos_id])

    def _end_of_turn(self) -> Optional[int]:
        """The token the template ends an assistant message with (Qwen's ``<|im_end|>``, also
        for base checkpoints whose eos is ``<|endoftext|>``); the eos if none is found."""
        sentinel = "\u2063laminar-sentinel\u2063"
        try:
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": sentinel}],
                tokenize=False)
        except Exception:  # noqa: BLE001 - a template that needs more than this: the eos
            return self.tok.eos_token_id
        after = text[text.find(sentinel) + len(sentinel):] if sentinel in text else ""
        added = sorted(self.tok.get_added_vocab().items(), key=lambda kv: -len(kv[0]))
        for token, index in added:
            if after.lstrip(" ").startswith(token):
                return index
        return self.tok.eos_token_id

    def render(self, messages: Sequence[dict], tools: Optional[list] = None,
               add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template([_plain(m) for m in messages], tools=tools or None,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=False)

    def encode(self, text: str) -> List[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict], tools: Optional[list] = None) -> List[int]:
        """The first turn's prompt: the messages rendered, with the generation prompt."""
        if not messages:
            raise ValueError("LMC-E400: messages is empty: the first call needs at least one "
                             "message")
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def continuation(self, history: Sequence[dict], new: Sequence[dict],
                     tools: Optional[list] = None, ended_with_eos: bool = True) -> List[int]:
        """The tokens that follow the last sampled turn (which ends ``history``) before the
        next turn is sampled: the template's markup after the end-of-turn token, the ``new``
        messages, the generation prompt. ``ended_with_eos``: the turn ended with the
        end-of-turn token (not at a length limit: the token is then added here)."""
        before = self.render(history, tools)
        after = self.render(list(history) + list(new), tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "LMC-E704: the chat template renders the earlier messages differently once new "
                "ones follow, so the next prompt cannot extend the tokens sampled so far; use a "
                "template that renders each message independently of later ones")
        end = before.rfind(self.eos_text)
        if end < len(self.render(history[:-1], tools, add_generation_prompt=True)):
            raise TemplateError(
                f"LMC-E704: the chat template does not end the last assistant message with "
                f"{self.eos_text!r}, the token its turns end with; token-exact turns need it")
        tail = before[end + len(self.eos_text):]
        ids = self.encode(tail + after[len(before):])
        return ids if ended_with_eos else [self.eos_id] + ids

    def decode_turn(self, ids: Sequence[int]) -> str:
        """A sampled turn's text, without its end-of-turn token."""
        ids = list(ids)
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------- the demo's tokenizer
DEMO_TOOL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
DEMO_TOOL_CLOSE = '"}}</tool_call>'
DEMO_SPECIAL = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
DEMO_ADDED = [DEMO_TOOL_OPEN, DEMO_TOOL_CLOSE, "<tool_response>", "</tool_response>",
              "system", "user", "assistant", "tool", "calculator"]
DEMO_CHARS = "0123456789+-*/().=, \n:_abcdefghijklmnopqrstuvwxyz{}\"'[]?!ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Qwen's layout, compact: the tools' names in a system line, tool calls in <tool_call> JSON,
# tool results in <tool_response>; every message is rendered independently of later ones
DEMO_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}tools: "
    "{% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %},{% endif %}{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{{ '\\n' }}"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content or '' }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments if c.function.arguments is string "
    "else c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")


def demo_tokenizer(extra_merges: Sequence[str] = ()):
    """The agent demo's tokenizer (a ``PreTrainedTokenizerFast``): one token per character of
    ``DEMO_CHARS``, the chat markers, the tool-call boilerplate as single tokens, and
    ``extra_merges`` (multi-character tokens, e.g. digit pairs, for tests of re-tokenisation)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(DEMO_CHARS)}
    vocab["<unk>"] = len(vocab)
    merges = []
    for piece in extra_merges:
        if len(piece) != 2 or any(c not in vocab for c in piece):
            raise ValueError(f"extra merge {piece!r}: two characters of the vocabulary")
        merges.append((piece[0], piece[1]))
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    core.decoder = decoders.Fuse()  # characters join without spaces
    core.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in DEMO_SPECIAL])
    core.add_tokens([AddedToken(t, normalized=False) for t in DEMO_ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>",
                                  eos_token="<|im_end|>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = DEMO_TEMPLATE
    return tok


def tokenizer_vocab_size(tok, multiple: int = 64) -> int:
    """The model's vocabulary for ``tok``: its size rounded up to ``multiple``."""
    return -(-len(tok) // multiple) * multiple
