"""Sample-level rollout scheduling (generator.extra_prompts: N): a step generates N prompts more than it trains
on, takes the groups that finish first, and aborts the long tail.

The rule, per generator rank r (P_r of the step's P prompts, N_r of the N extra: contiguous splits):

- its candidates are the prompts it deferred at the previous step ("retries", N_r of them after the first step),
  then fresh prompts from the stream's cursor, P_r + N_r in all;
- retries must finish (each prompt is deferred at most once, so a prompt whose answers are always long still
  trains, one step late: the data is not biased toward short answers); they are sampled afresh
  (derive_seed(run seed, prompt, sample, RETRY)), not replaying the tail they were cut from;
- the rank's step is its retries plus the first P_r - (retries) fresh groups to finish (ties: stream order); a
  group finishes when all of its samples have; the moment that set is known, generation of the others stops;
- the fresh prompts left out are this rank's retries at the next step.

With dynamic sampling (DAPO's, or algorithm.dynamic_sampling: true) a group whose rewards are all equal teaches
nothing, and it is dropped as it completes instead of in refill rounds: the rank's step is its retries plus fresh
groups in the order they finish (each scored as it finishes) until P_r of the groups taken are informative; the
uninformative ones taken on the way are consumed (logged, not trained, never retried), like a refill round's. If
all of its candidates finish with fewer than P_r informative, the step takes them all and trains on fewer groups,
as dynamic sampling does when its rounds run out. Retries are at most N_r either way. A rank's batch puts its
dropped groups first, and it travels as one record, so the trainers know the rank's share is complete once they
hold P_r informative groups of it (or all of its candidates).

Every rank applies it to its own candidates, so no message passes between generators; the trainers replay the
same rule from what arrived (which prompts each generator rank trained) to know the next step's candidates, check
that nothing was trained twice or skipped, checkpoint the state, and publish it with the weights
(WeightSync meta): the generators read it from there, so it has one owner and survives a resume. Exactly-once
holds; which prompts a step trains on depends on timing (on the HF backend on a CPU it is still deterministic).

Each sample is scored as soon as it finishes (the reward workers run beside the rest of the generation), not
when its whole batch has.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from rollout_hpc.backends.generator import derive_seed, episode_batch, stop_string_end, trajectory_batch
from rollout_hpc.envs.base import dataset_item
from rollout_hpc.trajectory import TrajectoryBatch

RETRY = 1  # the seed part that tells a retried prompt's samples from its first attempt's


def _split(total: int, n_ranks: int) -> list[int]:
    """Sizes of the contiguous split of `total` over ranks (as runtime.step_plan.rank_share splits prompts)."""
    return [len(part) for part in np.array_split(np.arange(total), n_ranks)]


class PromptSampler:
    """Which prompts each generator rank generates at the next step, with generator.extra_prompts: the stream's
    cursor and each rank's retries. Owned by the trainers (checkpointed); generators get it with the weights."""

    CHECKPOINT_KEY = "prompt_sampler"

    def __init__(self, prompts_per_step: int, extra_prompts: int, n_ranks: int):
        self.quotas = _split(prompts_per_step, n_ranks)
        self.extras = _split(extra_prompts, n_ranks)
        self.cursor = 0  # the next fresh prompt of the stream
        self.retries: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(n_ranks)]

    @classmethod
    def for_config(cls, cfg) -> PromptSampler:
        return cls(cfg.algorithm.prompts_per_step, cfg.generator.extra_prompts, cfg.generator.ranks)

    @property
    def n_ranks(self) -> int:
        return len(self.quotas)

    def _fresh_counts(self) -> list[int]:
        return [q + x - len(r) for q, x, r in zip(self.quotas, self.extras, self.retries)]

    def candidates(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(retries, fresh prompts) of generator group rank `rank` for the coming step, in stream order."""
        counts = self._fresh_counts()
        start = self.cursor + sum(counts[:rank])
        return self.retries[rank], np.arange(start, start + counts[rank], dtype=np.int64)

    def advance(self, trained: dict[int, np.ndarray], informative: dict[int, int] | None = None) -> int:
        """After a step: `trained` = {generator group rank: prompts its step took}. Checks them against the rule
        (every retry, P_r prompts, only candidates; with dynamic sampling, `informative` = {rank: informative groups
        among them}: P_r of them, or every candidate taken) and moves on; returns how many prompts were deferred."""
        retries = []
        for rank in range(self.n_ranks):
            retry, fresh = self.candidates(rank)
            got = np.unique(np.asarray(trained.get(rank, ()), np.int64))
            quota, problem = self.quotas[rank], None
            if not np.isin(retry, got).all():
                problem = f"retried prompts {np.setdiff1d(retry, got)[:5].tolist()} are missing"
            elif not np.isin(got, np.concatenate([retry, fresh])).all():
                problem = (
                    f"prompts {np.setdiff1d(got, np.concatenate([retry, fresh]))[:5].tolist()} were not its to run"
                )
            elif informative is None and len(got) != quota:
                problem = f"{len(got)} prompts trained, its share is {quota}"
            elif informative is not None and informative.get(rank, 0) != quota and len(got) != len(retry) + len(fresh):
                problem = (
                    f"{informative.get(rank, 0)} informative groups among the {len(got)} prompts taken, its share is "
                    f"{quota} (fewer only when it took all {len(retry) + len(fresh)} candidates)"
                )
            if problem:
                raise ValueError(
                    f"generator rank {rank}: {problem} (candidates: retries {retry.tolist()}, fresh "
                    f"[{fresh[0] if len(fresh) else self.cursor}, +{len(fresh)})): generators and trainers disagree "
                    "on the prompt sampler"
                )
            retries.append(np.setdiff1d(fresh, got))
        self.cursor += sum(self._fresh_counts())
        self.retries = retries
        return sum(len(r) for r in retries)

    # --- persistence: the checkpoint (arrays) and the weight sync's meta (JSON) ---------------------------------

    def state_dict(self) -> dict:
        ranks = np.concatenate([np.full(len(r), i, np.int64) for i, r in enumerate(self.retries)])
        return {
            "cursor": np.int64(self.cursor),
            "retries": np.concatenate(self.retries),
            "retry_ranks": ranks,
            "n_ranks": np.int64(self.n_ranks),
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        retries, ranks = np.asarray(state["retries"], np.int64), np.asarray(state["retry_ranks"], np.int64)
        counts = np.bincount(ranks, minlength=self.n_ranks) if len(ranks) else np.zeros(self.n_ranks, np.int64)
        if "n_ranks" in state:  # with dynamic sampling a rank may owe fewer than its share of the extra prompts
            regroup = int(state["n_ranks"]) != self.n_ranks
        else:  # a checkpoint from before n_ranks was saved: each rank owed exactly its share after the first step
            regroup = len(counts) > self.n_ranks or bool(len(retries) and counts.tolist() != self.extras)
        if regroup:
            # The generator group changed size since the checkpoint: deal the retries out again, in order, as many
            # to each rank as its share of the extra prompts (never more than it trains in a step).
            bounds = np.cumsum([0, *self.extras])
            merged = np.sort(retries)
            self.retries = [merged[bounds[i] : bounds[i + 1]] for i in range(self.n_ranks)]
            return
        self.retries = [retries[ranks == i] for i in range(self.n_ranks)]

    def meta(self) -> dict:
        """state_dict() as JSON data (what the weight sync carries)."""
        return {key: value.tolist() for key, value in self.state_dict().items()}

    @classmethod
    def from_meta(cls, cfg, meta: dict | None) -> PromptSampler:
        if meta is None:
            raise RuntimeError("generator.extra_prompts: the weights came without the prompt sampler's state")
        sampler = cls.for_config(cfg)
        sampler.load_state_dict(meta)
        return sampler


def pick_groups(
    done_at: np.ndarray, group_size: int, n_retries: int, quota: int, informative: np.ndarray | None = None
) -> np.ndarray | None:
    """Candidate groups (indices; the first `n_retries` are retries) that make the step, or None while that is not
    known yet. done_at: per row, the token index at which it finished (-1: still generating). `informative`, with
    dynamic sampling: per group 1, 0, or -1 while not scored yet; the step then takes finished groups until `quota`
    of those taken are informative (all of them if they never are)."""
    rows = done_at.reshape(-1, group_size)
    finished: np.ndarray = np.asarray((rows >= 0).all(axis=1))
    known = np.ones(len(rows), np.int8) if informative is None else np.asarray(informative, np.int8)
    if not finished[:n_retries].all() or (known[:n_retries] < 0).any():
        return None
    need = quota - int(known[:n_retries].sum())
    fresh = np.flatnonzero(finished[n_retries:]) + n_retries
    taken = []
    for g in fresh[np.lexsort((fresh, rows[fresh].max(axis=1)))]:  # first to finish; ties in stream order
        if need <= 0:
            break
        if known[g] < 0:
            return None  # the order is known but not yet whether this group counts
        taken.append(g)
        need -= int(known[g])
    if need > 0 and not (finished.all() and (known >= 0).all()):
        return None
    return np.sort(np.concatenate([np.arange(n_retries), np.asarray(taken, np.int64)]))


@dataclass
class ScheduledRollout:
    """One rank's share of a step: the chosen groups' records (rewards in `results`), their reward keys and texts."""

    batch: TrajectoryBatch
    keys: list
    texts: list[str]
    results: list
    aborted: int  # samples cut off before they finished


@dataclass(frozen=True)
class RankShare:
    """One generator rank's part of a step: whose candidates (sampler, group rank) and how its records are stamped."""

    sampler: PromptSampler
    rank: int  # in the generator group
    group_size: int
    gen_rank: int  # world rank: the records' gen_rank
    version: int  # the policy version generating


# with dynamic sampling: (rewards [k, G], response lengths [k, G]) -> [k] bool, which groups count
Informative = Callable[[np.ndarray, np.ndarray], np.ndarray] | None


def _candidate_rows(gen, share: RankShare):
    """(retries, [(prompt, sample)] rows of every candidate, their seeds) of this rank's step; None without any.
    A retry's samples are drawn afresh (RETRY), not replaying the tail they were cut from."""
    retry, fresh = share.sampler.candidates(share.rank)
    G = share.group_size
    prompts_ids = np.concatenate([retry, fresh])
    if not len(prompts_ids):
        return None
    rows = [(int(i), s) for i in prompts_ids for s in range(G)]
    seeds = [
        derive_seed(gen.seed, i, s, RETRY) if r < len(retry) * G else derive_seed(gen.seed, i, s)
        for r, (i, s) in enumerate(rows)
    ]
    return retry, rows, seeds


def _chosen_rows(groups: np.ndarray, group_ok: np.ndarray | None, G: int) -> np.ndarray:
    """The rows of the chosen groups; with dynamic sampling the dropped groups first (the trainers count the
    informative ones to know a rank's batch is whole)."""
    if group_ok is not None:
        groups = np.concatenate([groups[group_ok[groups] == 0], groups[group_ok[groups] == 1]])
    return (groups[:, None] * G + np.arange(G)[None, :]).reshape(-1)


def scheduled_rollout(
    gen, dataset, share: RankShare, workers, informative: Informative = None
) -> ScheduledRollout | None:
    """Generate this rank's candidates, stop once the step's groups are known, score each sample as it finishes.
    `informative(rewards [k, G], response lengths [k, G]) -> [k] bool`, with dynamic sampling: which groups count.
    None when the rank has no prompts this step."""
    if (got := _candidate_rows(gen, share)) is None:
        return None
    (retry, rows, seeds), G, t_start = got, share.group_size, time.time()
    n, quota = len(rows), share.sampler.quotas[share.rank]
    tokens = {i: gen.encode_prompt(dataset_item(dataset, i)) for i, s in rows if s == 0}
    keys = [("train", i) for i, _ in rows]
    stops = gen.sampling.stop
    done_at = np.full(n, -1, np.int64)
    row_text: list[str | None] = [None] * n  # the text each early-scored row was scored on
    row_len = np.zeros(n, np.int64)  # its response length (cut at a stop string, as the batch will hold it)
    results: list = [None] * n
    group_ok = None if informative is None else np.full(n // G, -1, np.int8)  # per group: informative, once scored
    # One scoring call at a time, of every row that finished since the last one went out: a call per token would
    # spend more on the reward workers' round trips (and the GIL) than a cheap reward costs.
    scoring = ThreadPoolExecutor(1, thread_name_prefix="early-scoring")
    pending: list[tuple[np.ndarray, Future]] = []  # sent, results not taken yet
    waiting: list[int] = []  # finished rows not sent yet
    picked: list[np.ndarray | None] = [None]

    def text(ids: list[int]) -> tuple[str, int]:
        end = stop_string_end(gen.tokenizer, ids, stops) if stops else None
        ids = ids[:end] if end is not None else ids
        return gen.tokenizer.decode(ids), len(ids)

    def take_scores(wait: bool) -> None:
        """Results of the scoring calls that are done (all of them with `wait`); decides the groups they complete."""
        while pending and (wait or pending[0][1].done()):
            idx, fut = pending.pop(0)
            for i, r in zip(idx, fut.result()):
                results[i] = r
            if group_ok is not None:
                assert informative is not None  # they come together
                for g in np.unique(idx // G):
                    if group_ok[g] < 0 and all(results[i] is not None for i in range(g * G, (g + 1) * G)):
                        values = np.array([[results[i].value for i in range(g * G, (g + 1) * G)]], np.float32)
                        group_ok[g] = int(bool(informative(values, row_len[g * G : (g + 1) * G][None])[0]))

    def send_waiting() -> None:
        if waiting and (not pending or pending[-1][1].done()):
            rows_out = np.array(waiting)
            waiting.clear()
            pending.append((rows_out, scoring.submit(workers.score, [(keys[i], row_text[i]) for i in rows_out])))

    def watch(t: int, finished, out_ids, lengths) -> bool:
        fin = finished.cpu().numpy()
        new = np.flatnonzero(fin & (done_at < 0))
        if len(new):
            done_at[new] = t
            ids, ends = out_ids[torch.as_tensor(new)].tolist(), lengths[torch.as_tensor(new)].tolist()
            for j, i in enumerate(new):
                row_text[i], row_len[i] = text(ids[j][: ends[j]])
            waiting.extend(new.tolist())
        take_scores(wait=False)
        send_waiting()
        picked[0] = pick_groups(done_at, G, len(retry), quota, group_ok)
        return picked[0] is not None

    try:
        out = gen.generate([tokens[i] for i, _ in rows], seeds, watch=watch)
        if picked[0] is None and informative is not None:
            # Every row has run to its end: score what has not been (the truncated rows too), then decide.
            take_scores(wait=True)
            for i in np.flatnonzero(done_at < 0):
                row_text[i], row_len[i] = text(out.response_ids[i])
            done_at[done_at < 0] = gen.sampling.max_new_tokens
            waiting[:] = [i for i in range(n) if results[i] is None]  # nothing is in flight now
            send_waiting()
            take_scores(wait=True)
            picked[0] = pick_groups(done_at, G, len(retry), quota, group_ok)
        take_scores(wait=True)
    finally:
        scoring.shutdown(wait=True)
    aborted = int((done_at < 0).sum())
    if picked[0] is None:  # every row ran to max_new_tokens: the truncated ones count as finished there
        done_at[done_at < 0] = gen.sampling.max_new_tokens
        picked[0] = pick_groups(done_at, G, len(retry), quota)
        aborted = 0
    groups = picked[0]
    assert groups is not None  # every row is finished now
    chosen = _chosen_rows(groups, group_ok, G)
    texts: list[str] = [
        t if (t := row_text[i]) is not None else gen.tokenizer.decode(out.response_ids[i]) for i in chosen
    ]
    late = [j for j, i in enumerate(chosen) if results[i] is None]  # finished at the last token, or truncated
    if late:
        for j, r in zip(late, workers.score([(keys[chosen[j]], texts[j]) for j in late])):
            results[chosen[j]] = r
    batch = trajectory_batch(
        [tokens[rows[i][0]] for i in chosen],
        [out.response_ids[i] for i in chosen],
        [out.logprobs[i] for i in chosen],
        [0.0] * len(chosen),
        truncated=[out.truncated[i] for i in chosen],
        prompt_index=[rows[i][0] for i in chosen],
        sample_idx=[rows[i][1] for i in chosen],
        gen_rank=share.gen_rank,
        policy_version=share.version,
        t_start=t_start,
        t_end=t_start,
    )
    return ScheduledRollout(batch, [keys[i] for i in chosen], texts, [results[i] for i in chosen], aborted)


def scheduled_episodes(gen, dataset, share: RankShare, informative: Informative = None) -> ScheduledRollout | None:
    """scheduled_rollout for a multi-turn task: this rank's candidate episodes, played batched until the step's groups
    are known (a group finishes when its last episode ends; the clock is the batch's turn), the rest abandoned. The
    episodes score themselves, so `keys`, `texts` and `results` stay empty. None when the rank has no prompts."""
    if (got := _candidate_rows(gen, share)) is None:
        return None
    (retry, rows, seeds), G, t_start = got, share.group_size, time.time()
    n, quota = len(rows), share.sampler.quotas[share.rank]
    items = {i: dataset_item(dataset, i) for i, s in rows if s == 0}
    done_at = np.full(n, -1, np.int64)
    group_ok = None if informative is None else np.full(n // G, -1, np.int8)
    clock = [0]
    picked: list[np.ndarray | None] = [None]

    def judge(groups, eps) -> None:
        """Whether each finished group of `groups` is informative (its episodes' rewards)."""
        if group_ok is None or informative is None:
            return
        for g in groups:
            members = range(g * G, (g + 1) * G)
            if group_ok[g] < 0 and all(done_at[j] >= 0 for j in members):
                values = np.array([[eps[j].reward for j in members]], np.float32)
                lengths = np.array([[len(eps[j].response_ids) for j in members]], np.int64)
                group_ok[g] = int(bool(informative(values, lengths)[0]))

    def watch(ended: list[int], eps) -> bool:
        if ended:
            done_at[ended] = clock[0]
            judge(np.unique(np.asarray(ended) // G), eps)
        clock[0] += 1
        picked[0] = pick_groups(done_at, G, len(retry), quota, group_ok)
        return picked[0] is not None

    labels = [f"prompt {i} sample {s}" for i, s in rows]  # what the rank's log names
    eps = gen.play_episodes([items[i] for i, _ in rows], seeds, labels=labels, watch=watch)
    aborted = int((done_at < 0).sum())
    if picked[0] is None:  # every episode has ended (some perhaps before the last watch saw them)
        done_at[done_at < 0] = clock[0]
        judge(range(n // G), eps)
        picked[0] = pick_groups(done_at, G, len(retry), quota, group_ok)
        aborted = 0
    groups = picked[0]
    assert groups is not None  # every episode has ended now
    chosen = _chosen_rows(groups, group_ok, G)
    common = dict(
        prompt_index=[rows[j][0] for j in chosen],
        sample_idx=[rows[j][1] for j in chosen],
        gen_rank=share.gen_rank,
        policy_version=share.version,
        t_start=t_start,
    )
    return ScheduledRollout(episode_batch([eps[j] for j in chosen], common), [], [], [], aborted)
