"""Which layout to run on N nodes: every candidate simulated from a profile, best predicted throughput first.

shape = run_shape(cfg)
predictions = plan(profile, cfg, nodes=64)        # sorted, best first
layout_of(cfg)                                     # the layout a config (or a finished run) has
"""

from __future__ import annotations

from rollout_hpc.scale.profile import Profile
from rollout_hpc.scale.simulate import Layout, Prediction, RunShape, simulate

# Candidate generator shares of the nodes when there are too many nodes to try every split.
MAX_SPLITS = 40


def run_shape(cfg, steps: int | None = None, **assumptions) -> RunShape:
    """What the config fixes besides the layout. `steps` defaults to the config's RL steps (SFT excluded)."""
    return RunShape(
        prompts_per_step=cfg.algorithm.prompts_per_step,
        group_size=cfg.algorithm.group_size,
        steps=max(1, steps if steps is not None else cfg.algorithm.steps),
        checkpoint_every=cfg.checkpoint.every_steps,
        checkpoint_writers_per_rank=cfg.trainer.backend in ("deepspeed", "megatron"),
        uses_gpus=cfg.generator.gpus_per_task > 0 or cfg.trainer.gpus_per_task > 0,
        ring_bytes=cfg.exchange.ring_bytes,
        max_inflight_bytes=cfg.exchange.max_inflight_bytes,
        time_limit_s=float(cfg.slurm.time_seconds),
        signal_lead_s=float(cfg.slurm.signal_lead_seconds),
        **assumptions,
    )


def layout_of(cfg) -> Layout:
    return Layout(
        placement=cfg.placement,
        generator_nodes=cfg.generator.nodes,
        trainer_nodes=cfg.trainer.nodes,
        max_staleness=cfg.exchange.max_staleness,
        gen_tasks_per_node=cfg.generator.tasks_per_node,
        train_tasks_per_node=cfg.trainer.tasks_per_node,
    )


def candidate_layouts(cfg, nodes: int, max_staleness: int = 2) -> list[Layout]:
    """Disaggregated splits (g generator nodes, nodes - g trainer nodes) with staleness 0..max_staleness, and
    colocated (every node does both, on-policy) where the config's groups can share a node."""
    gt, tt = cfg.generator.tasks_per_node, cfg.trainer.tasks_per_node
    out = []
    for g in _splits(nodes):
        for k in range(max_staleness + 1):
            out.append(Layout("disaggregated", g, nodes - g, k, gt, tt))
    cores_or_gpus_fit = cfg.generator.gpus_per_task == 0 or (
        (gt * cfg.generator.gpus_per_task + tt * cfg.trainer.gpus_per_task) <= cfg.slurm.gpus_per_node
    )
    if cores_or_gpus_fit:
        out.append(Layout("colocated", nodes, nodes, 0, gt, tt))
    return out


def _splits(nodes: int) -> list[int]:
    if nodes < 2:
        return []
    if nodes - 1 <= MAX_SPLITS:
        return list(range(1, nodes))
    # Fine near both ends (a few generator or trainer nodes), even in between.
    picks = {1, nodes - 1}
    x = 1.0
    while x < nodes:
        picks.update({int(x), nodes - int(x)})
        x *= 1.5
    picks.update(round(nodes * i / MAX_SPLITS) for i in range(1, MAX_SPLITS))
    return sorted(g for g in picks if 1 <= g < nodes)


def plan(profile: Profile, cfg, nodes: int, max_staleness: int = 2, steps: int | None = None, **assumptions):
    """Every candidate layout on `nodes` nodes, simulated; best predicted samples/s first."""
    shape = run_shape(cfg, steps, **assumptions)
    predictions = [simulate(profile, lay, shape) for lay in candidate_layouts(cfg, nodes, max_staleness)]
    # Best predicted samples/s first; ties (a staleness the pipeline does not use) go to the fresher policy, then
    # to fewer nodes. Each row also has effective_samples_per_s (with expected allocation ends and node failures).
    return sorted(predictions, key=lambda p: (-round(p.samples_per_s, 6), p.layout.max_staleness, p.layout.nodes))


def predict_run(profile: Profile, cfg, steps: int | None = None) -> Prediction:
    """The prediction for a config's own layout (what `plan --check` compares with a finished run)."""
    return simulate(profile, layout_of(cfg), run_shape(cfg, steps))


def recommended(predictions: list[Prediction]) -> dict:
    best = predictions[0]
    lay = best.layout
    return {
        "generator_nodes": lay.generator_nodes,
        "trainer_nodes": lay.trainer_nodes,
        "placement": lay.placement,
        "max_staleness": lay.max_staleness,
        "step_s": best.step_s,
        "samples_per_s": best.samples_per_s,
        "effective_samples_per_s": best.effective_samples_per_s,
        "overrides": lay.overrides(),
    }
