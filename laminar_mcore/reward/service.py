"""An asynchronous reward service: reward functions run in a process pool so that slow
verifiers never block the controller's event loop. Functions are named by dotted path
(``package.module:function`` or ``package.module.function``)."""

from __future__ import annotations

import asyncio
import importlib
import math
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Optional, Tuple


def load_reward_fn(path: str) -> Callable[..., float]:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function {path!r} must be 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward function {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


def _score(path: str, response_text: str, answer, row: dict) -> float:
    fn = load_reward_fn(path)
    extra = {k: v for k, v in row.items() if k not in ("response_text", "answer")}
    value = float(fn(response_text, answer, **extra))
    if not math.isfinite(value):
        raise ValueError(f"reward {value} is not finite")
    return value


class RewardService:
    def __init__(self, fn_path: str, workers: int = 1):
        load_reward_fn(fn_path)  # fail at start-up, not at the first trajectory
        self.fn_path = fn_path
        self.pool = ProcessPoolExecutor(max_workers=workers)

    async def score(self, response_text: str, answer, row: Optional[dict] = None
                    ) -> Tuple[Optional[float], Optional[str]]:
        """(reward, None), or (None, error message) when the reward function failed."""
        loop = asyncio.get_running_loop()
        try:
            value = await loop.run_in_executor(self.pool, _score, self.fn_path, response_text,
                                               answer, dict(row or {}))
        except Exception as exc:  # noqa: BLE001 - reported as a discard reason by the caller
            return None, f"{type(exc).__name__}: {exc}"
        return value, None

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
