"""Built-in verifiable rewards: pure functions `(response_text, answer) -> float` (semantics: docs/rewards.md).

- `math_reward`: the response's final answer (last `\\boxed{...}`, else the last number) equals the gold answer,
  compared by math-verify (1/2 == 0.5 == \\frac{1}{2}; \\sqrt{2} == \\sqrt 2).
- `exact_reward`: normalized string match; numbers compare as numbers.
- `regex_reward(pattern)`: the last match's group 1 equals the answer, or (no group) the pattern occurs.
- `builtin_reward(spec, format_weight, format_pattern)`: the reward a config names ("math", "exact",
  "regex:PATTERN"), as `fn(answer, response) -> float` (the plugin calling convention), plus an optional format
  bonus `weight * format_ok(response, ...)`.

A gold answer may be a number, a string (GSM8K "... #### 1,234" solutions are cut to "1234"), a list/tuple of
accepted answers, a mapping with an "answer" key or an object with an `answer` attribute (a Prompt). Nothing here
raises on unparsable text: it scores 0.0.
math-verify is imported on first use (it pulls in sympy: ~0.3 s); its own signal.alarm timeouts are switched off
(they only work in a main thread) — the reward pool enforces the per-sample timeout by killing the worker.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from rollout_hpc.errors import RewardSpecError
from rollout_hpc.rewards.code_sandbox import CODE_FENCE, code_limits, code_reward

# ---------------------------------------------------------------------------------------------------- answers

_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# A number in running text: a minus sign counts only when it does not follow a word or a closing bracket
# ("5-3" ends in 3, "= -3" in -3); "1,234" is one number, "42." ends in 42.
_NUMBER_IN_TEXT = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def _number_text(value: float | int) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    text = repr(value)
    if "e" in text or "E" in text:
        text = f"{value:.17f}".rstrip("0").rstrip(".")
    return text


def _strip_thousands(text: str) -> str:
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def gold_answer(answer: Any) -> tuple[str, ...]:
    """The accepted gold answers as strings: numbers formatted ("42", "0.5"), strings stripped, a GSM8K solution
    cut to what follows its last "####", thousands separators removed from numbers ("1,234" -> "1234"). A list or
    tuple means any of its answers is accepted; a mapping is read at its "answer" key, an object with an `answer`
    attribute (rollout_hpc.envs.Prompt) at that attribute. None -> ()."""
    if answer is None:
        return ()
    if isinstance(answer, Mapping):
        return gold_answer(answer.get("answer"))
    if isinstance(answer, (list, tuple, set, frozenset)):
        out: list[str] = []
        for item in answer:
            out.extend(g for g in gold_answer(item) if g not in out)
        return tuple(out)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return (_number_text(answer),)
    if not isinstance(answer, (str, bytes, int, float)) and hasattr(answer, "answer"):  # a Prompt (rollout_hpc.envs)
        return gold_answer(answer.answer)
    if hasattr(answer, "item") and callable(answer.item):  # a numpy scalar, without importing numpy
        try:
            return gold_answer(answer.item())
        except Exception:
            pass
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    text = _strip_thousands(text)
    return (text,) if text else ()


# ------------------------------------------------------------------------------------------------ normalizing

_QUOTES = ("$", '"', "'", "`")


def normalize_text(text: Any) -> str:
    """The form `exact_reward` compares: whitespace collapsed, casefolded, without trailing periods and without
    surrounding $ or quotes (repeated until nothing changes)."""
    text = " ".join(str(text).split()).casefold()
    previous = None
    while text != previous:
        previous = text
        text = text.strip()
        if text.endswith("."):
            text = text[:-1]
        for q in _QUOTES:
            if len(text) >= 2 and text[0] == q and text[-1] == q:
                text = text[1:-1]
    return text


def _as_number(text: str) -> float | None:
    text = _strip_thousands(text)
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _same_text(candidate: str, gold: str) -> bool:
    a, b = normalize_text(candidate), normalize_text(gold)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0)


# ---------------------------------------------------------------------------------------------------- exact


def exact_reward(response: str, answer: Any) -> float:
    """1.0 when the whole response, normalized (see `normalize_text`), equals one gold answer; numbers compare as
    numbers ("7" == "7.0" == "7."). Else 0.0."""
    try:
        response = "" if response is None else str(response)
        return 1.0 if any(_same_text(response, g) for g in gold_answer(answer)) else 0.0
    except Exception:
        return 0.0


# ---------------------------------------------------------------------------------------------------- regex


def _compile(pattern: str | re.Pattern, what: str) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise RewardSpecError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    except TypeError:
        raise RewardSpecError(f"{what} must be a string, got {type(pattern).__name__} {pattern!r}") from None


def regex_reward(pattern: str) -> Callable[[str, Any], float]:
    """A reward `(response, answer) -> float`. With a capture group: 1.0 when group 1 of the LAST match,
    normalized like `exact_reward`, equals a gold answer. Without a group: 1.0 when the pattern occurs anywhere
    in the response (the answer is ignored). An invalid pattern raises RewardSpecError (a UserError)."""
    rx = _compile(pattern, "reward regex")

    if rx.groups:

        def reward(response: str, answer: Any) -> float:
            try:
                last = None
                for last in rx.finditer(response or ""):  # noqa: B007 - the last match is what is wanted
                    pass
                if last is None or last.group(1) is None:
                    return 0.0
                return 1.0 if any(_same_text(last.group(1), g) for g in gold_answer(answer)) else 0.0
            except Exception:
                return 0.0
    else:

        def reward(response: str, answer: Any) -> float:
            try:
                return 1.0 if rx.search(response or "") else 0.0
            except Exception:
                return 0.0

    reward.__name__ = "regex_reward"
    reward.__dict__["pattern"] = rx.pattern  # a function attribute, for whoever inspects the reward
    return reward


# ----------------------------------------------------------------------------------------------------- math

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in text, braces balanced; None if none."""
    if not text:
        return None
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def last_number(text: str) -> str | None:
    """The last number in text, thousands separators removed ("... so the answer is 1,234." -> "1234")."""
    if not text:
        return None
    found = None
    for found in _NUMBER_IN_TEXT.finditer(text):  # noqa: B007 - the last number is what is wanted
        pass
    return None if found is None else found.group(0).replace(",", "")


@lru_cache(maxsize=1)
def _mv():
    """math_verify, imported on first use, with its signal-based timeouts off (the pool does timeouts)."""
    import logging

    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass parsing_timeout=None / timeout_seconds=None on purpose: do not log math-verify's warning about it.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    configs = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    return math_verify, configs


def _parse_math(expr: str) -> list:
    mv, configs = _mv()
    expr = expr.strip()
    while len(expr) >= 2 and expr[0] == "$" and expr[-1] == "$":
        expr = expr[1:-1].strip()
    expr = _strip_thousands(expr)
    if not expr:
        return []
    return mv.parse(f"${expr}$", configs, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    boxed = last_boxed(gold)
    return tuple(_parse_math(boxed if boxed is not None else gold))


def math_answer(response: str) -> str | None:
    """The final answer math_reward reads from a response: the last \\boxed{} content, else the last number."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def math_reward(response: str, answer: Any) -> float:
    """1.0 when the response's final answer (the last `\\boxed{...}`, else the last number in the text) equals a
    gold answer by math-verify (numeric and symbolic equality: "0.5" == "\\frac{1}{2}"); when math-verify cannot
    parse one side, a normalized string match. Else 0.0 (also for empty or unparsable text)."""
    try:
        golds = gold_answer(answer)
        predicted = math_answer("" if response is None else str(response))
        if predicted is None or not golds:
            return 0.0
        mv, _ = _mv()
        pred = _parse_math(predicted)
        for gold in golds:
            gold_parsed = list(_parse_gold(gold))
            if gold_parsed and pred:
                if mv.verify(gold_parsed, pred, timeout_seconds=None):
                    return 1.0
            elif _same_text(predicted, gold):
                return 1.0
        return 0.0
    except Exception:
        return 0.0


# --------------------------------------------------------------------------------------------------- format


def format_ok(response: str, kind: str | re.Pattern) -> bool:
    """True when the response has the expected answer format: kind "math" -> it contains a complete
    `\\boxed{...}`; any other kind is a regular expression that must occur in the response."""
    response = response or ""
    if kind == "math":
        return last_boxed(response) is not None
    return _compile(kind, "reward format pattern").search(response) is not None


# -------------------------------------------------------------------------------------------------- builtins

BUILTIN_REWARDS: dict[str, Callable[[str, Any], float]] = {"math": math_reward, "exact": exact_reward}


def is_builtin_reward(spec: Any) -> bool:
    """True for "math", "exact", "code" and "regex:PATTERN" (check this before treating a spec as a 'module:attr'
    plugin: "regex:..." contains a colon)."""
    return isinstance(spec, str) and (spec in BUILTIN_REWARDS or spec == "code" or spec.startswith("regex:"))


def builtin_reward(
    spec: str,
    format_weight: float = 0.0,
    format_pattern: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> Callable[[Any, str], float] | None:
    """The built-in reward `spec` names, as `fn(answer, response) -> float`, or None when spec is not a built-in
    (then it is a plugin spec). The reward is `correctness + format_weight * format_ok(response, kind)` where kind
    is format_pattern if given, else "math" for math, the reward's own pattern for regex and a fenced code block
    for code; "exact" with a nonzero format_weight needs a format_pattern. Invalid patterns raise RewardSpecError
    (a UserError). params: the task.params a reward reads (code: its code_* limits, code_sandbox.code_limits).

    Also the pool factory of the built-ins: RewardPool("rollout_hpc.rewards.verifiers:builtin_reward", (spec, w, p)).
    """
    if not is_builtin_reward(spec):
        return None
    if spec == "code":
        correctness = code_reward(code_limits(params))
        default_format: str | None = CODE_FENCE.pattern
    elif spec.startswith("regex:"):
        pattern = spec[len("regex:") :]
        if not pattern:
            raise RewardSpecError(f"reward '{spec}': the regex after 'regex:' is empty")
        correctness = regex_reward(pattern)
        default_format = pattern
    else:
        correctness = BUILTIN_REWARDS[spec]
        default_format = "math" if spec == "math" else None
        if spec == "math":
            math_reward("\\boxed{1}", "1")  # import math-verify and warm its parser now, not in the first job
    try:
        weight = float(format_weight or 0.0)
    except (TypeError, ValueError):
        raise RewardSpecError(f"reward '{spec}': format weight must be a number, got {format_weight!r}") from None
    if not math.isfinite(weight):
        raise RewardSpecError(f"reward '{spec}': format weight must be finite, got {format_weight!r}")
    kind: str | re.Pattern | None = format_pattern if format_pattern else default_format
    if weight != 0.0 and kind is None:
        raise RewardSpecError(
            f"reward '{spec}': a format weight needs a format pattern (a regex the response must contain)"
        )
    if kind is not None and kind != "math":
        kind = _compile(kind, f"reward '{spec}': format pattern")

    if weight == 0.0:

        def reward(answer: Any, response: str) -> float:
            return correctness(response, answer)
    else:
        assert kind is not None  # checked above: a format weight needs a format pattern

        def reward(answer: Any, response: str) -> float:
            return correctness(response, answer) + weight * float(format_ok(response, kind))

    reward.__name__ = f"{spec.split(':', 1)[0]}_reward"
    reward.__dict__["spec"] = spec  # a function attribute, for whoever inspects the reward
    return reward


def reward_factory(
    spec: str, format_weight: float = 0.0, format_pattern: str | None = None, field: str = "task.reward"
) -> Callable[[Any, str], float]:
    """The reward a config names, built-in or plugin, as `fn(answer_or_item, response) -> float`: the RewardPool
    factory for any reward spec, `RewardPool("rollout_hpc.rewards.verifiers:reward_factory", (spec, w, pattern))`.
    A plugin ('package.module:fn' or 'path/to/file.py:fn') is returned unwrapped (the pool checks its values: NaN or
    a non-number is RewardFatal) plus the format bonus when format_weight is nonzero (needs format_pattern)."""
    fn = builtin_reward(spec, format_weight, format_pattern)
    if fn is not None:
        return fn
    from rollout_hpc.plugins import PluginError, load_plugin

    plugin = load_plugin(spec, field)
    if not callable(plugin):
        raise PluginError(
            f"{field} '{spec}' is a {type(plugin).__name__}, not a function fn(prompt_item, response_text) -> float"
        )
    weight = float(format_weight or 0.0)
    if weight == 0.0:
        return plugin
    if not format_pattern:
        raise RewardSpecError(
            f"{field} '{spec}': a format weight needs a format pattern (a regex the response must contain)"
        )
    rx = _compile(format_pattern, f"{field} '{spec}': format pattern")

    def reward(item: Any, response: str):
        value = plugin(item, response)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return value  # let the caller's check name the bad value
        return value + weight * float(format_ok(response, rx))

    reward.__name__ = getattr(plugin, "__name__", "reward")
    return reward
