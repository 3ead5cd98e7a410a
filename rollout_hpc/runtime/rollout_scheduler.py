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
from rollout_hpc.envs.datafile import QuotaLayout
from rollout_hpc.runtime.step_plan import domain_quotas, stamp_domains
from rollout_hpc.trajectory import TrajectoryBatch

RETRY = 1  # the seed part that tells a retried prompt's samples from its first attempt's


def _split(total: int, n_ranks: int) -> list[int]:
    """Sizes of the contiguous split of `total` over ranks (as runtime.step_plan.rank_share splits prompts)."""
    return [len(part) for part in np.array_split(np.arange(total), n_ranks)]


def _apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` by largest remainders (ties: the first): each part is at most
    ceil(total x w / sum w), so no source gets more extra prompts than its quota while total <= sum(weights)."""
    whole = sum(weights)
    if not whole:
        return [0] * len(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(e) for e in exact]
    for k in sorted(range(len(weights)), key=lambda k: (parts[k] - exact[k], k))[: total - sum(parts)]:
        parts[k] += 1
    return parts


class PromptSampler:
    """Which prompts each generator rank generates at the next step, with generator.extra_prompts: each source's
    cursor and each rank's retries. Owned by the trainers (checkpointed); generators get it with the weights.

    A mixed dataset (envs.datafile.QuotaLayout) keeps its quotas: rank r's share of the step is its contiguous
    slice of the layout's block (as without extra prompts), so it owes q[r][k] prompts of source k; its extra prompts
    are split over those sources in proportion; the pick rule runs per source, and each source has its own cursor in
    its own stream. With one source all of this is the plain rule."""

    CHECKPOINT_KEY = "prompt_sampler"

    def __init__(self, prompts_per_step: int, extra_prompts: int, n_ranks: int, quotas: list[int] | None = None):
        self.layout = QuotaLayout(quotas or [prompts_per_step])
        self.quotas = _split(prompts_per_step, n_ranks)
        self.extras = _split(extra_prompts, n_ranks)
        K, edges = len(self.layout.quotas), np.cumsum([0, *self.quotas])
        # rank r's slice [edges[r], edges[r+1]) of the block meets source k's [starts[k], starts[k+1])
        lo, hi = self.layout.starts[:-1], self.layout.starts[1:]
        self.source_quotas = [
            [int(max(0, min(hi[k], edges[r + 1]) - max(lo[k], edges[r]))) for k in range(K)] for r in range(n_ranks)
        ]
        self.source_extras = [_apportion(x, q) for x, q in zip(self.extras, self.source_quotas)]
        self.cursors = np.zeros(K, np.int64)  # per source: the next fresh position of its own stream
        self.retries: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(n_ranks)]

    @classmethod
    def for_config(cls, cfg) -> PromptSampler:
        return cls(cfg.algorithm.prompts_per_step, cfg.generator.extra_prompts, cfg.generator.ranks, domain_quotas(cfg))

    @property
    def n_ranks(self) -> int:
        return len(self.quotas)

    @property
    def n_sources(self) -> int:
        return len(self.layout.quotas)

    def _fresh_counts(self) -> np.ndarray:
        """[rank, source]: fresh prompts each rank generates of each source at the coming step."""
        owed = np.array([np.bincount(self.layout.domain_of(r), minlength=self.n_sources) for r in self.retries])
        return np.array(self.source_quotas) + np.array(self.source_extras) - owed.reshape(self.n_ranks, -1)

    def candidates(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(retries, fresh prompts) of generator group rank `rank` for the coming step, in stream order."""
        counts = self._fresh_counts()
        fresh = [
            self.layout.index(k, self.cursors[k] + counts[:rank, k].sum() + np.arange(counts[rank, k]))
            for k in range(self.n_sources)
        ]
        return self.retries[rank], np.sort(np.concatenate(fresh)).astype(np.int64)

    def pick(self, rank: int, done_at: np.ndarray, group_size: int, informative: np.ndarray | None = None):
        """pick_groups for rank `rank`'s candidates (retries first, then fresh, as `candidates` lists them), source by
        source: each source's retries plus its first groups to finish, up to its quota. None while not known."""
        if self.n_sources == 1:  # called at every generated token: no candidate list needed for one source
            return pick_groups(done_at, group_size, len(self.retries[rank]), self.quotas[rank], informative)
        retry, fresh = self.candidates(rank)
        domains = self.layout.domain_of(np.concatenate([retry, fresh]))
        rows = done_at.reshape(-1, group_size)
        taken = []
        for k in range(self.n_sources):
            mine = np.flatnonzero(domains == k)  # retries of source k first: candidates are retries, then fresh
            sub = None if informative is None else np.asarray(informative)[mine]
            got = pick_groups(
                rows[mine].reshape(-1), group_size, int((mine < len(retry)).sum()), self.source_quotas[rank][k], sub
            )
            if got is None:
                return None
            taken.append(mine[got])
        return np.sort(np.concatenate(taken))

    def share_complete(self, rank: int, held: np.ndarray, informative) -> bool:
        """With dynamic sampling: whether the trainers hold all that rank `rank` sends at this step, given the
        prompts of the whole groups they hold of it (`held`) and the informative groups among them (an int, or per
        source): each source's quota of informative groups, or all of that source's candidates. A rank's batch
        puts its dropped groups first, so holding the informative groups means holding the rest."""
        retry, fresh = self.candidates(rank)
        mine = self.layout.domain_of(np.concatenate([retry, fresh]))
        got = self.layout.domain_of(np.asarray(held, np.int64))
        informative = np.broadcast_to(np.asarray(informative, np.int64), (self.n_sources,))
        return all(
            informative[k] >= self.source_quotas[rank][k] or (got == k).sum() == (mine == k).sum()
            for k in range(self.n_sources)
        )

    def advance(self, trained: dict[int, np.ndarray], informative: dict | None = None) -> int:
        """After a step: `trained` = {generator group rank: prompts its step took}. Checks them against the rule
        (every retry, its quota of each source, only candidates; with dynamic sampling, `informative` = {rank:
        informative groups among them, an int or one per source}: each source's quota of them, or all of that
        source's candidates taken) and moves on; returns how many prompts were deferred."""
        counts, retries = self._fresh_counts(), []
        for rank in range(self.n_ranks):
            retry, fresh = self.candidates(rank)
            both = np.concatenate([retry, fresh])
            got = np.unique(np.asarray(trained.get(rank, ()), np.int64))
            problem = None
            if not np.isin(retry, got).all():
                problem = f"retried prompts {np.setdiff1d(retry, got)[:5].tolist()} are missing"
            elif not np.isin(got, both).all():
                problem = f"prompts {np.setdiff1d(got, both)[:5].tolist()} were not its to run"
            else:
                useful = None if informative is None else np.broadcast_to(informative.get(rank, 0), (self.n_sources,))
                got_k, all_k = self.layout.domain_of(got), self.layout.domain_of(both)
                for k, quota in enumerate(self.source_quotas[rank]):
                    source = f" of source {k}" if self.n_sources > 1 else ""
                    n_got, n_all = int((got_k == k).sum()), int((all_k == k).sum())
                    if useful is None and n_got != quota:
                        problem = f"{n_got} prompts{source} trained, its share is {quota}"
                    elif useful is not None and int(useful[k]) != quota and n_got != n_all:
                        problem = (
                            f"{int(useful[k])} informative groups among the {n_got} prompts{source} taken, its share "
                            f"is {quota} (fewer only when it took all {n_all} candidates)"
                        )
                    if problem:
                        break
            if problem:
                raise ValueError(
                    f"generator rank {rank}: {problem} (candidates: retries {retry.tolist()}, fresh "
                    f"{fresh[:8].tolist()}{'...' if len(fresh) > 8 else ''}): generators and trainers disagree "
                    "on the prompt sampler"
                )
            retries.append(np.setdiff1d(fresh, got))
        self.cursors = self.cursors + counts.sum(axis=0)
        self.retries = retries
        return sum(len(r) for r in retries)

    # --- persistence: the checkpoint (arrays) and the weight sync's meta (JSON) ---------------------------------

    def state_dict(self) -> dict:
        ranks = np.concatenate([np.full(len(r), i, np.int64) for i, r in enumerate(self.retries)])
        state = {
            "retries": np.concatenate(self.retries),
            "retry_ranks": ranks,
            "n_ranks": np.int64(self.n_ranks),
        }
        if self.n_sources == 1:  # one source: its cursor is the stream's (the format before mixtures)
            state["cursor"] = np.int64(self.cursors[0])
        else:
            state["cursors"] = self.cursors.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        cursors = np.atleast_1d(np.asarray(state["cursors"] if "cursors" in state else state["cursor"], np.int64))
        if len(cursors) != self.n_sources:
            raise ValueError(
                f"generator.extra_prompts: the checkpoint's prompt sampler has {len(cursors)} data sources, the "
                f"config {self.n_sources}: a resumed run keeps task.params.train's sources"
            )
        self.cursors = cursors.copy()
        retries, ranks = np.asarray(state["retries"], np.int64), np.asarray(state["retry_ranks"], np.int64)
        counts = np.bincount(ranks, minlength=self.n_ranks) if len(ranks) else np.zeros(self.n_ranks, np.int64)
        if "n_ranks" in state:  # with dynamic sampling a rank may owe fewer than its share of the extra prompts
            regroup = int(state["n_ranks"]) != self.n_ranks
        else:  # a checkpoint from before n_ranks was saved: each rank owed exactly its share after the first step
            regroup = len(counts) > self.n_ranks or bool(len(retries) and counts.tolist() != self.extras)
        if regroup:
            self.retries = self._deal(np.sort(retries))
            return
        self.retries = [retries[ranks == i] for i in range(self.n_ranks)]

    def _deal(self, retries: np.ndarray) -> list[np.ndarray]:
        """The generator group changed size since the checkpoint: deal the retries out again, in order, each source's
        to the ranks that owe that source, as many to each as its share of the extra prompts, then (where the shares
        moved between sources) up to its quota: a step must be able to train every retry it owes."""
        dealt: list[list[np.ndarray]] = [[] for _ in range(self.n_ranks)]
        for k in range(self.n_sources):
            todo = retries[self.layout.domain_of(retries) == k]
            room = [self.source_extras[r][k] for r in range(self.n_ranks)]
            for cap in (room, [self.source_quotas[r][k] - room[r] for r in range(self.n_ranks)]):
                for r in range(self.n_ranks):
                    dealt[r].append(todo[: cap[r]])
                    todo = todo[cap[r] :]
        return [np.sort(np.concatenate(parts)).astype(np.int64) for parts in dealt]

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
    """([(prompt, sample)] rows of every candidate, retries first, and their seeds) of this rank's step; None without any.
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
    return rows, seeds


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
    (rows, seeds), G, t_start = got, share.group_size, time.time()
    n = len(rows)
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
        picked[0] = share.sampler.pick(share.rank, done_at, G, group_ok)
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
            picked[0] = share.sampler.pick(share.rank, done_at, G, group_ok)
        take_scores(wait=True)
    finally:
        scoring.shutdown(wait=True)
    aborted = int((done_at < 0).sum())
    if picked[0] is None:  # every row ran to max_new_tokens: the truncated ones count as finished there
        done_at[done_at < 0] = gen.sampling.max_new_tokens
        picked[0] = share.sampler.pick(share.rank, done_at, G)
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
    stamp_domains(batch, dataset)
    return ScheduledRollout(batch, [keys[i] for i in chosen], texts, [results[i] for i in chosen], aborted)


def scheduled_episodes(gen, dataset, share: RankShare, informative: Informative = None) -> ScheduledRollout | None:
    """scheduled_rollout for a multi-turn task: this rank's candidate episodes, played batched until the step's groups
    are known (a group finishes when its last episode ends; the clock is the batch's turn), the rest abandoned. The
    episodes score themselves, so `keys`, `texts` and `results` stay empty. None when the rank has no prompts."""
    if (got := _candidate_rows(gen, share)) is None:
        return None
    (rows, seeds), G, t_start = got, share.group_size, time.time()
    n = len(rows)
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
        picked[0] = share.sampler.pick(share.rank, done_at, G, group_ok)
        return picked[0] is not None

    labels = [f"prompt {i} sample {s}" for i, s in rows]  # what the rank's log names
    eps = gen.play_episodes([items[i] for i, _ in rows], seeds, labels=labels, watch=watch)
    aborted = int((done_at < 0).sum())
    if picked[0] is None:  # every episode has ended (some perhaps before the last watch saw them)
        done_at[done_at < 0] = clock[0]
        judge(range(n // G), eps)
        picked[0] = share.sampler.pick(share.rank, done_at, G, group_ok)
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
