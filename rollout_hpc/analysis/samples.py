"""Pick trajectories out of a log (best, worst, random; by step or prompt) and show them as text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollout_hpc.analysis.run_info import run_dir_of
from rollout_hpc.config import load_config
from rollout_hpc.envs.registry import load_task
from rollout_hpc.rundir_layout import RESOLVED_CONFIG, data_dir
from rollout_hpc.store.trajlog import TrajectoryReader, read_meta

Decode = Callable[[np.ndarray], str]
Answer = Callable[[int], "str | None"]  # prompt id -> the task's reference answer for it
SCAN_ROWS = 1 << 16


def load_decoder(run_dir: str | Path) -> Decode | None:
    """The run's tokenizer decode, or None when the run does not say (then token ids are shown). Special tokens
    are kept: the text shown is exactly what the model saw (chat template markers, BOS, the stop token)."""
    run_dir = run_dir_of(run_dir)
    try:
        # In here: the models package imports torch and transformers, needed only to decode.
        from rollout_hpc.models.tokenizer import load_tokenizer_for_run

        tokenizer = load_tokenizer_for_run(run_dir)
        return lambda ids: tokenizer.decode(ids, skip_special=False)
    except Exception:  # no config in the run dir, a model dir that moved, or no models package: show ids
        return None


def load_answers(run_dir: str | Path) -> Answer | None:
    """prompt id -> the reference answer the reward compared against: the run's task rebuilt from its resolved
    config over the rows frozen in RUN_DIR/data (a mixed dataset's stream maps the id to its source, as the
    generators did). None when the run does not say (a bare log) or the task cannot be rebuilt here."""
    run_dir = run_dir_of(run_dir)
    try:
        cfg = load_config(run_dir / RESOLVED_CONFIG, [])
        prompts = load_task(cfg.task, data_dir=data_dir(run_dir)).prompts(cfg.run.seed)
    except Exception:  # an older config, a plugin task whose module is not importable here, a moved data file
        return None

    def answer(prompt_id: int) -> str | None:
        try:
            value = getattr(prompts[int(prompt_id)], "answer", None)
        except Exception:  # a plugin task's prompts that fail on this index: no answer to show
            return None
        return None if value is None else str(value)

    return answer


def last_step(reader: TrajectoryReader) -> int | None:
    return int(reader.column("step", reader.rows - 1)[0]) if reader.rows else None


def select_rows(
    reader: TrajectoryReader,
    step: int | None = None,
    prompt: int | None = None,
    mode: str = "best",
    k: int = 3,
    seed: int = 0,
) -> np.ndarray:
    """Row indices of up to k trajectories matching step/prompt, by reward (best/worst) or at random."""
    if mode not in ("best", "worst", "random"):
        raise ValueError(f"mode must be best, worst or random, not {mode!r}")
    rows, rewards = [], []
    for chunk in reader.iter_chunks(SCAN_ROWS, ["step", "prompt_id", "reward"]):
        keep = np.ones(len(chunk["row"]), bool)
        if step is not None:
            keep &= chunk["step"] == step
        if prompt is not None:
            keep &= chunk["prompt_id"] == prompt
        rows.append(chunk["row"][keep])
        rewards.append(chunk["reward"][keep])
    found = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    reward = np.concatenate(rewards) if rewards else np.zeros(0, np.float32)
    if mode == "random":
        pick = np.random.default_rng(seed).permutation(len(found))[:k]
    else:
        order = np.argsort(-reward if mode == "best" else reward, kind="stable")
        pick = order[:k]
    return found[pick]


def load_samples(reader: TrajectoryReader, rows: np.ndarray) -> list[dict]:
    meta = read_meta(reader)
    sources = list(meta.get("domains") or [])  # a mixed dataset's source names, by record `domain`
    models = list(meta.get("reward_models") or [])  # what reward_parts 1.. are
    out = []
    for row in rows:
        record = reader.batch([int(row)]).record(0)
        record["row"] = int(row)
        record["step"] = int(reader.column("step", int(row), int(row) + 1)[0])
        record["staleness"] = int(reader.column("staleness", int(row), int(row) + 1)[0])
        if len(sources) > 1 and int(record["domain"]) < len(sources):
            record["source"] = sources[int(record["domain"])]
        if models:
            record["reward_models"] = models
        out.append(record)
    return out


def _text(ids: np.ndarray, decode: Decode | None) -> str:
    if decode is None:
        return "[" + " ".join(str(int(i)) for i in ids) + "]"
    return decode(ids)


def _segments(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, is_policy) runs of equal loss_mask values."""
    if not len(mask):
        return []
    change = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = np.concatenate([[0], change, [len(mask)]])
    return [(int(a), int(b), bool(mask[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def render_sample(s: dict, decode: Decode | None, answer: Answer | None = None) -> str:
    """A trajectory as text: header, prompt, the reference answer (where the task has one), then the response
    turn by turn (policy vs environment text)."""
    status = int(s.get("reward_status", 0))
    episode = int(s.get("episode_status", 0))
    flags = " [hit max_new_tokens]" if s["truncated"] and not episode else ""  # an episode: its last turn says
    if episode:  # a multi-turn episode: how it ended (envs failing are not the reward's fault)
        status = 0
        flags += {
            2: " [environment failed: scored 0, not trained on]",
            3: " [environment hung: scored 0, not trained on]",
        }.get(episode, "")
        flags += f"  {s['n_turns']} turns" + (" solved" if s.get("success") else "")
        flags += f", {s['format_errors']} unparsable" if s.get("format_errors") else ""
    flags += {1: " [reward raised: scored 0]", 2: " [reward timed out: scored 0]"}.get(status, "")
    source = f"  source {s['source']}" if s.get("source") else ""
    lines = [
        f"row {s['row']}  step {s['step']}{source}  prompt {s['prompt_id']} sample {s['sample_idx']}  reward {s['reward']:.4g}  "
        f"policy v{s['policy_version']} (staleness {s['staleness']})  {s['response_len']} response tokens{flags}",
        f"  prompt: {_text(s['prompt_ids'], decode)}",
    ]
    parts = s.get("reward_parts", ())
    if len(parts):  # rewards.models: the rule reward and each model's raw score
        names = ["rule", *s.get("reward_models", [f"model {k}" for k in range(1, len(parts))])]
        shown = [f"{n} {'unparsed' if np.isnan(v) else f'{float(v):.4g}'}" for n, v in zip(names, parts)]
        lines.append(f"  reward parts: {', '.join(shown)}")
    reference = answer(s["prompt_id"]) if answer is not None else None
    if reference is not None:
        lines.append(f"  reference answer: {reference}")
    response, mask, starts = s["response_ids"], s["loss_mask"], list(s["turn_starts"])
    bounds = [int(x) for x in starts] + [len(response)]
    if len(starts) <= 1:
        bounds = [0, len(response)]
    rewards = s.get("turn_rewards", ())
    for t, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        label = "  response:" if len(bounds) == 2 and not episode else f"  turn {t + 1}:"
        if episode and t < len(rewards):  # the environment's answer to this turn
            last = t == len(bounds) - 2
            ended = " (done)" if last and not s["truncated"] else " (truncated)" if last else ""
            label = f"  turn {t + 1}: reward {float(rewards[t]) + 0.0:.4g}{ended}"  # (+ 0.0: no "-0")
        lines.append(label)
        for lo, hi, policy in _segments(mask[a:b]):
            who = "policy" if policy else "env   "
            lines.append(f"    {who} | {_text(response[a + lo : a + hi], decode)}")
    return "\n".join(lines)
