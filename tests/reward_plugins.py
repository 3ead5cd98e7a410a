"""Reward factories for tests/test_rewards.py's RewardPool tests (loaded in fresh worker interpreters).

Each factory is called once per worker and returns fn(key, text) -> float.
"""

from __future__ import annotations

import os
import time


def correct(bonus: float = 0.0):
    """1.0 when text == str(key), else 0.0 (+ bonus)."""

    def fn(key, text):
        return (1.0 if text == str(key) else 0.0) + bonus

    return fn


def length():
    """len(text): a trivial reward for the benchmark."""

    def fn(key, text):
        return float(len(text))

    return fn


def flaky():
    """Raises ValueError for keys that are multiples of 3, else returns the key as a float."""

    def fn(key, text):
        if key % 3 == 0:
            raise ValueError(f"no reward for {key}")
        return float(key)

    return fn


def hangs():
    """Sleeps forever for key 'hang'; 1.0 otherwise."""

    def fn(key, text):
        if key == "hang":
            while True:
                time.sleep(60)
        return 1.0

    return fn


def nan_reward():
    """NaN for key 'nan', else 1.0."""

    def fn(key, text):
        return float("nan") if key == "nan" else 1.0

    return fn


def wrong_type():
    """A string instead of a number."""

    def fn(key, text):
        return "one"

    return fn


def dies():
    """The worker exits abruptly (os._exit(3)) for key 'die'; 1.0 otherwise."""

    def fn(key, text):
        if key == "die":
            os._exit(3)
        return 1.0

    return fn


def prints():
    """Writes to stdout (which must not disturb the worker protocol) and returns 1.0."""

    def fn(key, text):
        print("noise from a reward", key, flush=True)
        os.write(1, b"raw noise\n")
        return 1.0

    return fn


def pid():
    """The worker's pid: shows which worker scored a job."""

    def fn(key, text):
        return float(os.getpid())

    return fn


def broken_factory():
    """The factory itself fails."""
    raise RuntimeError("cannot load the reward model")


def not_callable():
    return 42


def sleeps():
    """Sleeps `key` seconds, returns 1.0."""

    def fn(key, text):
        time.sleep(float(key))
        return 1.0

    return fn


def loaded_modules():
    """1.0 when none of the heavy or MPI modules is loaded in the worker, else 0.0 (text names the modules)."""
    import sys

    def fn(key, text):
        return 0.0 if any(m in sys.modules for m in text.split()) else 1.0

    return fn
