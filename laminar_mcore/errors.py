"""The stable codes of the errors a user can meet, and their format, in one place.

A code is ``LMC-E`` and three digits at the start of the message (``LMC-E103: rollout.
num_engines=0 must be >= 1``); it names one kind of problem with one fix, and
docs/troubleshooting.md has one entry per code (tests/test_errors.py keeps the two in step).
Ranges: E1xx configuration, E2xx launch and processes, E3xx trainer and conversion, E4xx our
servers' HTTP answers, E5xx relays and weights, E6xx rollout nodes, engines and the
controller, E7xx data, rewards and agents.

Codes are literals at the raise sites (the test finds them in the source); this module only
formats them. It imports nothing of ours: every module may use it.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

CODE = re.compile(r"LMC-E\d{3}")
_PREFIX = re.compile(r"(LMC-E\d{3}): ")


def coded(code: str, message: str) -> str:
    """``message`` with ``code`` in front, as every coded message reads."""
    if not CODE.fullmatch(code):
        raise ValueError(f"not an error code: {code!r}")
    return f"{code}: {message}"


def code_of(message: object) -> Optional[str]:
    """The first code in ``message`` (an exception or a text); None if it has none."""
    found = CODE.search(str(message))
    return found.group(0) if found else None


def split(message: object) -> Tuple[Optional[str], str]:
    """(code, the rest) of a message that starts with a code; (None, message) otherwise."""
    text = str(message)
    found = _PREFIX.match(text)
    return (found.group(1), text[found.end():]) if found else (None, text)


def within(context: str, error: object, code: Optional[str] = None) -> str:
    """``error``'s message behind ``context``, its code kept in front: a wrapper that adds
    where it happened keeps the code of what happened (``LMC-E503: stage 0: ...``); ``code``
    is the wrapper's own, for an error that has none."""
    own, rest = split(error)
    own = own or code
    return coded(own, f"{context}: {rest}") if own else f"{context}: {rest}"


def error_body(code: str, message: str, **extra) -> dict:
    """The JSON body of an error answer of our servers: the coded message, and the code on
    its own for a client to branch on."""
    return {"error": coded(code, message), "code": code, **extra}
