"""Check command-line override keys against the schemas before Hydra composes anything.

Hydra rejects an unknown key but suggests appending it with ``+``, which the schema would reject
later anyway; and a ``+key=value`` override bypasses the schema entirely. Here every key an
override names must exist in ``LaminarConfig`` (or be a config group or ``hydra.*``), and a typo
gets the closest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Iterable, List, Optional

from .schema import LaminarConfig
from .validate import ConfigError

_HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp",
                           "--config-name", "-cn", "--config-dir", "-cd", "--info",
                           "--experimental-rerun"}


def _dataclass_of(tp) -> Optional[type]:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _resolve(key: str) -> Optional[str]:
    """None if ``key`` names a schema field, else the error message for it."""
    node: type = LaminarConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            prefix = ".".join(parts[:i])
            where = f"'{prefix}'" if prefix else "the root config"
            close = difflib.get_close_matches(part, list(hints), n=1)
            hint = f"; did you mean {'.'.join(parts[:i] + [close[0]])}?" if close else ""
            return (f"LMC-E100: unknown config key '{key}': {where} has no field '{part}'{hint} "
                    f"(valid: {', '.join(sorted(hints))})")
        child = _dataclass_of(hints[part])
        if child is None:
            if i != len(parts) - 1:
                return (f"LMC-E100: unknown config key '{key}': "
                        f"'{'.'.join(parts[:i + 1])}' is a value, not a section")
            return None
        node = child
    return None


def override_keys(argv: Iterable[str]) -> List[str]:
    keys, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _HYDRA_FLAGS_WITH_VALUE:
            skip = True
            continue
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        keys.append(key)
    return keys


def check_overrides(argv: Iterable[str], conf_dir: str) -> None:
    """Raise ``ConfigError`` for the first override whose key the schema does not have."""
    groups = {d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d))}
    problems = []
    for key in override_keys(argv):
        if key.startswith("hydra.") or key == "hydra" or key.split("@")[0] in groups:
            continue
        message = _resolve(key)
        if message:
            problems.append(message)
    if problems:
        raise ConfigError("invalid override:\n  - " + "\n  - ".join(problems))
