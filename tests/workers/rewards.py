"""Reward functions that misbehave on purpose (imported by the reward service's workers)."""

import os
import signal
import time


def flaky(response_text, answer, **row):
    if response_text == "die":  # a verifier that crashes its process
        os.kill(os.getpid(), signal.SIGKILL)
    if response_text == "hang":  # a verifier stuck on a pathological answer
        time.sleep(3600)
    if response_text == "slow":
        time.sleep(1.0)
    return float(response_text == answer)
