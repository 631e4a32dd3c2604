"""The agent gateway: an OpenAI-compatible ``/v1/chat/completions`` that agents call through a
real ``openai.AsyncOpenAI`` client, and that turns each call into one turn of a trajectory.

Every trajectory of an agent episode gets its own key (the client's ``api_key``): the gateway
knows from it which trajectory a call extends, and refuses a call with another key, a call after
the trajectory ended, and a second call while one runs (401, 401, 409). What it guarantees:

* **Token-in, token-out.** The first call's messages, rendered by the chat template, are the
  prompt. A later call must repeat the conversation so far (its messages begin with the ones
  the gateway holds, the assistant's as it answered them) and add new ones (tool results, user
  turns); the next turn's prompt is the exact tokens so far plus the new messages' tokens
  (``data/chat.py``), never a re-tokenisation of what the model wrote.
* **Loss masks.** Sampled tokens carry their behaviour log-probs and are trained; the new
  messages' tokens (tool outputs, template markup) are environment tokens, masked.
* **One version.** Each turn generates through the rollout manager (``ctx.generate``), which
  keeps a multi-turn trajectory's place on its engine between turns: the engine pulls no new
  weights until the episode ends (mode=laminar); a failed engine's turn resumes on another of
  the same version, repack moves it whole. In mode=areal spans are recorded per token.
* **Limits.** ``rollout.max_turns``, ``max_tool_calls`` and ``max_episode_tokens``: a call that
  would exceed one is refused (400, ``code`` the limit's name), tool calls over the allowance are
  dropped from the answer, and the episode ends with the limit as its reason. Each turn generates at most ``sampling.max_new_tokens`` (or the call's smaller
  ``max_tokens``) and never past the episode's token budget. Sampling is the run's: a call's
  ``temperature``/``top_p`` are ignored (the trainer's behaviour log-probs are the run's policy).

Answers are OpenAI's ``chat.completion`` objects, with ``tool_calls`` parsed from the model's
text by the template's convention, ``finish_reason`` "tool_calls", "stop" or "length".
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from aiohttp import web

from ..data.chat import ChatFormat, TemplateError, parse_tool_calls, same_message
from ..data.pools import InFlight
from ..errors import coded, split

logger = logging.getLogger(__name__)


@dataclass
class EpisodeLimits:
    max_turns: int = 8
    max_tool_calls: int = 8
    max_episode_tokens: int = 4096
    max_new_tokens: int = 64  # per turn


class EpisodeEnded(Exception):
    """A call over one of the episode's limits (``reason``: the limit)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Session:
    """One trajectory's conversation as the gateway holds it."""

    key: str
    item: InFlight
    ctx: Any  # the rollout manager (``generate``)
    messages: List[dict] = field(default_factory=list)  # as recorded, the assistant's as answered
    tools: Optional[list] = None
    turns: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    tool_messages: int = 0
    tool_errors: int = 0
    end_reason: Optional[str] = None  # a limit the episode reached
    failure: Optional[BaseException] = None  # Discard / Stopped raised by a turn's generation
    closed: bool = False
    busy: bool = False
    task: Optional[asyncio.Task] = None  # the call being answered (cancelled if its agent ends)

    def counts(self) -> Dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls,
                "malformed_tool_calls": self.malformed_tool_calls,
                "tool_messages": self.tool_messages, "tool_errors": self.tool_errors,
                "end_reason": self.end_reason or "done"}


# OpenAI parameters whose meaning the gateway cannot honour token-exactly: a 400 rather than
# an answer that silently ignores them (temperature, top_p and seed are ignored: the run's)
UNSUPPORTED = ("stop", "response_format", "top_logprobs", "logit_bias", "prediction")


def _error(status: int, lmc: str, message: str, code: Optional[str] = None,
           kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-shaped error answer (``code``: OpenAI's, e.g. ``invalid_api_key``), its
    message under our error code ``lmc`` (or the code the message already starts with)."""
    own, message = split(message)
    return web.json_response({"error": {"message": coded(own or lmc, message), "type": kind,
                                        "param": None, "code": code}}, status=status)


class AgentGateway:
    def __init__(self, chat: ChatFormat, limits: EpisodeLimits, model_name: str = "policy",
                 host: str = "127.0.0.1"):
        self.chat, self.limits, self.model_name, self.host = chat, limits, model_name, host
        self.sessions: Dict[str, Session] = {}
        self.ended: Dict[str, float] = {}  # keys of ended sessions -> when (a late call: 401)
        self.tool_errors = 0
        self.app = web.Application(client_max_size=64 * 2 ** 20)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self._runner: Optional[web.AppRunner] = None
        self.url: Optional[str] = None

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ sessions
    def open(self, item: InFlight, ctx) -> Session:
        item.multi_turn = True
        session = Session(key=f"lm-{secrets.token_urlsafe(24)}", item=item, ctx=ctx)
        self.sessions[session.key] = session
        return session

    def close_session(self, session: Session) -> None:
        session.closed = True
        self.sessions.pop(session.key, None)
        self.ended[session.key] = time.time()
        if len(self.ended) > 100_000:  # remember the recent ones only
            for key in list(self.ended)[:50_000]:
                del self.ended[key]

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        session = self.sessions.get(key)
        if session is None:
            why = ("this trajectory has ended" if key in self.ended else
                   "no trajectory has this key" if key else "no key (Authorization: Bearer)")
            raise web.HTTPUnauthorized(
                text=json.dumps({"error": {"message": f"LMC-E401: {why}: each agent call must "
                                           "use the key of its own, running trajectory",
                                           "type": "authentication_error", "param": None,
                                           "code": "invalid_api_key"}}),
                content_type="application/json")
        return session

    # ------------------------------------------------------------------ routes
    async def models(self, request: web.Request):
        self._session(request)
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "laminar"}]})

    async def chat_completions(self, request: web.Request):
        session = self._session(request)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "LMC-E400", "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) \
                or not body["messages"]:
            return _error(400, "LMC-E400", "messages must be a non-empty list of messages",
                          "messages")
        if body.get("stream"):
            return _error(400, "LMC-E400", "stream=true is not served: agent turns are answered "
                          "whole", "stream")
        if body.get("n") not in (None, 1):
            return _error(400, "LMC-E400", "n must be 1: a trajectory is one conversation (the "
                          "run samples a group of trajectories per prompt)", "n")
        for key in UNSUPPORTED:
            if body.get(key) not in (None, [], "", {"type": "text"}):
                return _error(400, "LMC-E400", f"{key} is not served by the gateway (its turns "
                              "must be the run's policy, token for token)",
                              "unsupported_parameter")
        if session.busy:
            return _error(409, "LMC-E404", "a call of this trajectory is running: one at a time",
                          "concurrent_call")
        if session.failure is not None:
            return _error(503, "LMC-E409", f"this trajectory's generation failed: "
                          f"{session.failure}", "generation_failed", "server_error")
        session.busy = True
        session.task = asyncio.current_task()
        try:
            return web.json_response(await self._turn(session, body))
        except EpisodeEnded as exc:
            session.end_reason = session.end_reason or exc.reason
            return _error(400, "LMC-E408", f"the episode reached its limit: {exc}", exc.reason,
                          "episode_limit")
        except (ValueError, TemplateError) as exc:
            return _error(400, "LMC-E400", str(exc), "messages")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Discard / Stopped / an engine failure: the episode ends
            session.failure = exc
            return _error(503, "LMC-E409", f"the turn could not be generated: {exc}",
                          "generation_failed", "server_error")
        finally:
            session.busy = False

    # ------------------------------------------------------------------ one turn
    async def _turn(self, session: Session, body: dict) -> dict:
        lim = self.limits
        if session.end_reason is not None:
            raise EpisodeEnded(session.end_reason, f"it ended at {session.end_reason}")
        if session.turns >= lim.max_turns:
            raise EpisodeEnded("max_turns", f"rollout.max_turns={lim.max_turns} turns")
        messages = [dict(m) if isinstance(m, dict) else m for m in body["messages"]]
        traj = session.item.traj
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool)
                                  or asked < 1):
            raise ValueError(f"LMC-E400: max_tokens={asked!r} must be a positive integer")
        if session.turns == 0:
            session.tools = body.get("tools") or None
            prompt = self.chat.prompt(messages, session.tools)
            if len(prompt) >= lim.max_episode_tokens:
                raise EpisodeEnded("max_episode_tokens", f"the prompt has {len(prompt)} tokens, "
                                   f"rollout.max_episode_tokens={lim.max_episode_tokens}")
            traj.prompt_ids = prompt
        else:
            held = session.messages
            if len(messages) <= len(held):
                raise ValueError(f"LMC-E407: the call repeats {len(messages)} of the "
                                 f"conversation's {len(held)} messages and adds none: a turn "
                                 "needs new ones")
            for i, (sent, rec) in enumerate(zip(messages, held)):
                if not same_message(sent, rec):
                    raise ValueError(
                        f"LMC-E407: message {i} ({rec.get('role')}) differs from this "
                        "trajectory's: a call must extend the conversation it continues (send "
                        "the assistant's messages as they were answered)")
            new = messages[len(held):]
            ended_eos = bool(traj.response_ids) and traj.response_ids[-1] == self.chat.eos_id
            env = self.chat.continuation(held, new, session.tools, ended_with_eos=ended_eos)
            if traj.num_tokens + len(env) >= lim.max_episode_tokens:
                raise EpisodeEnded("max_episode_tokens", f"{traj.num_tokens + len(env)} tokens "
                                   f"with the new messages, rollout.max_episode_tokens="
                                   f"{lim.max_episode_tokens}")
            traj.add_environment(env)  # (every check passed: the trajectory changes now)
            tools = [m for m in new if _role(m) == "tool"]
            session.tool_messages += len(tools)
            # a tool that failed says so in a line "Error: ..." (the sandbox's convention,
            # agents/sandbox.py): the books count them
            failed = [m for m in tools if any(line.startswith("Error:")
                                              for line in str(_content(m)).splitlines())]
            session.tool_errors += len(failed)
            for m in failed:
                self.tool_errors += 1
                if self.tool_errors <= 3 or self.tool_errors % 200 == 0:  # a sample
                    logger.warning("tool error answered to the model (%d so far): %.300s",
                                   self.tool_errors, _content(m))
        session.messages = [_as_dict(m) for m in messages]
        budget = min(lim.max_new_tokens, lim.max_episode_tokens - traj.num_tokens)
        if asked is not None:
            budget = min(budget, asked)
        start = len(traj.response_ids)
        session.item.max_new_tokens = start + budget
        if self.chat.eos_id != self.chat.tok.eos_token_id:  # a turn ends at the template's token
            session.item.sampling = dict(session.item.sampling, stop_token_ids=[self.chat.eos_id])
        reason = await session.ctx.generate(session.item)
        sampled = traj.response_ids[start:]
        traj.finish_reason = reason
        session.turns += 1
        text = self.chat.decode_turn(sampled)
        content, calls, bad = parse_tool_calls(text)
        allowed = max(lim.max_tool_calls - session.tool_calls, 0)
        if len(calls) > allowed:  # the calls over the limit are not the agent's to run
            calls = calls[:allowed]
            session.end_reason = session.end_reason or "max_tool_calls"
        session.tool_calls += len(calls)
        session.malformed_tool_calls += bad
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        session.messages.append(message)
        finish = "tool_calls" if calls else ("length" if reason == "length" else "stop")
        prompt_tokens = traj.num_tokens - len(sampled)
        logprobs = None
        if body.get("logprobs"):  # the behaviour log-probs the trainer will use
            logprobs = {"content": [
                {"token": self.chat.tok.decode([t]), "logprob": lp, "bytes": None,
                 "top_logprobs": []}
                for t, lp in zip(sampled, traj.behav_logprobs[start:])]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": logprobs}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(sampled),
                          "total_tokens": traj.num_tokens}}


def _role(message) -> Optional[str]:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _content(message):
    return message.get("content") if isinstance(message, dict) else getattr(message, "content", "")


def _as_dict(message) -> dict:
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True)
    return dict(message)
