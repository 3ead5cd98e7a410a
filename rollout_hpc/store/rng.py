"""Capture and restore every random number generator a rank uses, as checkpointable values."""

from __future__ import annotations

import random

import numpy as np


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    try:
        import torch
    except ImportError:  # pragma: no cover
        return state
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state (accepts what a checkpoint load returns)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
