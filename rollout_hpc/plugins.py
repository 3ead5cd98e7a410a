"""Load user code named in the config: 'package.module:attr' or 'path/to/file.py:attr'.

Every failure raises PluginError naming the plugin, the config field it came from and
what to fix: a file or module that is missing or fails to import, a missing attribute,
or a value of the wrong type (also at call time, for reward functions).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_hpc.errors import PluginError


def is_plugin_spec(text: str) -> bool:
    return ":" in text


def load_plugin(spec: str, field: str = "plugin") -> Any:
    """Import the module or file of `spec` and return its attribute."""
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise PluginError(f"{field} '{spec}': expected 'package.module:attr' or 'path/to/file.py:attr'")
    module = (
        _import_file(source, spec, field)
        if source.endswith(".py") or "/" in source
        else _import_module(source, spec, field)
    )
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise PluginError(
            f"{field} '{spec}': {source} has no attribute '{attr}' (it defines: {', '.join(public) or 'nothing'})"
        ) from None


def _import_module(name: str, spec: str, field: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise PluginError(
            f"{field} '{spec}': module '{exc.name}' not found; install it or put it on PYTHONPATH, "
            "or name a file instead ('path/to/file.py:attr')"
        ) from None
    except Exception as exc:  # the user's module raised while importing: show what, not our traceback
        raise PluginError(f"{field} '{spec}': importing '{name}' failed: {type(exc).__name__}: {exc}") from exc


def _import_file(path_text: str, spec: str, field: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{field} '{spec}': file {path} not found (relative paths start at {Path.cwd()})")
    # A stable, unique module name per file: two plugins called reward.py must not collide.
    name = f"rollout_hpc_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:  # no importer for the file's suffix
        raise PluginError(f"{field} '{spec}': {path} is not a Python file; name a .py file ('path/to/file.py:attr')")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PluginError(f"{field} '{spec}': running {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def as_reward(value: Any, who: str) -> float:
    """A reward a plugin returned, checked: a finite real number (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PluginError(f"{who} returned {type(value).__name__} {value!r}; a reward must be a float")
    value = float(value)
    if not math.isfinite(value):
        raise PluginError(f"{who} returned {value}; a reward must be finite")
    return value


def checked_reward_fn(fn: Callable, who: str) -> Callable[[Any, str], float]:
    """Wrap fn(prompt_item, response_text) so a wrong return type names the plugin."""
    if not callable(fn):
        raise PluginError(f"{who} is a {type(fn).__name__}, not a function fn(prompt_item, response_text) -> float")

    def reward(prompt_item, response_text: str) -> float:
        return as_reward(fn(prompt_item, response_text), who)

    # Takes fn's __name__ (if it has one) and sets reward.__wrapped__ = fn.
    return functools.update_wrapper(reward, fn, assigned=("__name__",), updated=())


def load_reward(spec: str, field: str = "task.reward") -> Callable[[Any, str], float]:
    """A reward plugin: fn(prompt_item, response_text) -> float."""
    return checked_reward_fn(load_plugin(spec, field), f"{field} '{spec}'")
