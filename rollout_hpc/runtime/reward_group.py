"""The reward group's ranks (rewards.models with nodes > 0): score experience on its way from generators to trainers.

    generator ranks --Exchange(generator -> reward)--> reward rank: decode the responses, score them with each of
    the group's models (ModelScorer, batched) --Exchange(reward -> trainer)--> trainer ranks

Each batch is one generator rank's put (a ring record: get_available hands it over whole), so what a model is
batched with does not depend on timing. The generators fill the rule reward and the parts of the models with
nodes: 0; the group fills its models' parts (PENDING until then); the trainers normalize and combine.

A reward rank holds no state of the run: the running normalization is the trainers' (in their checkpoint), and the
group scores and forwards everything it received before the generators' END, then passes the END on. So a stop
(SIGUSR1) neither loses nor scores twice: what the trainers had not trained on at their checkpoint is generated and
scored again after the resume, exactly as without a reward group. A reward rank that dies ends the job like any
rank (the launcher's MPI abort); the run resumes from its last checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

from rollout_hpc.envs import load_task
from rollout_hpc.models import load_tokenizer
from rollout_hpc.rundir_layout import data_dir
from rollout_hpc.runtime import watchdog
from rollout_hpc.runtime.model_rewards import ModelScorer

ALL = 1 << 40  # get_available's bound: one whole ring record (a generator rank's put), however large


class RewardGroup:
    """One reward rank: its models (loaded at construction) and the loop that scores the stream."""

    def __init__(self, world, cfg, run_dir: Path, rate=None):
        task = load_task(cfg.task, data_dir=data_dir(run_dir))
        self.world = world
        self.tokenizer = load_tokenizer(cfg.model)
        self.scorer = ModelScorer(cfg, task.prompts(cfg.run.seed), in_group=True)
        self.scored, self.busy_s = 0, 0.0
        self.rate = rate  # runtime.scoring_rate.RateSender: what each batch took, for the progress line

    def run(self, incoming, outgoing) -> int:
        """Score until every generator node has ended its stream, then end ours to the trainers."""
        watchdog.beat(0)  # the models are loaded: from here a rank that stops making progress is hung
        while True:
            batch = incoming.get_available(ALL, timeout=watchdog.WAIT_SLICE_S)
            if not len(batch):
                if incoming.ended:
                    break
                watchdog.waiting()  # waiting for the generators is not a hang of this rank
                continue
            t0 = time.perf_counter()
            scored = self.score(batch)
            seconds = time.perf_counter() - t0
            outgoing.put(scored)
            self.scored += len(batch)
            self.busy_s += seconds
            if self.rate is not None:
                self.rate.sent(len(batch), seconds)
            watchdog.beat()
        incoming.close()
        outgoing.close()
        if self.world.group_rank == 0:
            print(
                f"rollout-hpc: reward rank {self.world.rank}: scored {self.scored} samples "
                f"({self.scored / max(self.busy_s, 1e-9):.1f}/s while busy)"
            )
        return 0

    def score(self, batch):
        """Fill the group's reward parts of one generator put."""
        batch.fixed = batch.fixed.copy()  # it views a received buffer; scoring writes rewards into it
        offsets = batch.offsets("response_len")
        texts = [self.tokenizer.decode(batch.response_ids[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
        keys = [("train", int(i)) for i in batch.fixed["prompt_id"]]
        return self.scorer.apply(batch, keys, texts)
