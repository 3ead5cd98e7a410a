"""The figure of docs/scale.md: predicted samples/s of the 7B example against node count, up to 1,000 nodes.

    python tools/scale_figure.py [--out docs/img/scale-7b.png] [--json]

For each node count, `rollout-hpc plan`'s best layout (roofline profile of a 7.6e9-parameter model on H100 nodes,
every assumption in rollout_hpc.scale.roofline.Hardware) under two batch rules: the example's fixed global batch
(128 prompts x 8 samples a step) and a batch that grows with the allocation (16 prompts per node). Prints one row
per node count (the best layout, its step parts and the interruption overhead); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rollout_hpc.config import load_config
from rollout_hpc.scale.plan import plan
from rollout_hpc.scale.roofline import roofline_profile

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "examples" / "grpo-7b-vllm-deepspeed.yaml"
NODES = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
PROMPTS_PER_NODE = 16


def best(nodes: int, prompts: int) -> dict:
    cfg = load_config(CONFIG, [f"algorithm.prompts_per_step={prompts}", "algorithm.steps=1000"])
    profile = roofline_profile(cfg, params=7.6e9)
    top = plan(profile, cfg, nodes, max_staleness=2)[0]
    row = top.row()
    row.update(nodes=nodes, prompts_per_step=prompts)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "scale-7b.png"))
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    args = ap.parse_args()
    t0 = time.perf_counter()
    curves: dict[str, list[dict]] = {"fixed batch (128 prompts)": [], f"{PROMPTS_PER_NODE} prompts per node": []}
    for n in NODES:
        curves["fixed batch (128 prompts)"].append(best(n, 128))
        curves[f"{PROMPTS_PER_NODE} prompts per node"].append(best(n, PROMPTS_PER_NODE * n))
    if not args.json:
        for name, rows in curves.items():
            print(name)
            print(
                f"{'nodes':>6} {'layout':>22} {'k':>2} {'step s':>8} {'samples/s':>10} {'effective':>10} "
                f"{'gen s':>7} {'train s':>8} {'sync s':>7} {'gen idle':>8} {'train idle':>10}"
            )
            for r in rows:
                layout = f"{r['placement'][:5]} {r['generator_nodes']}g+{r['trainer_nodes']}t"
                print(
                    f"{r['nodes']:>6} {layout:>22} {r['max_staleness']:>2} {r['step_s']:>8.2f} "
                    f"{r['samples_per_s']:>10.1f} {r['effective_samples_per_s']:>10.1f} {r['gen_s']:>7.2f} "
                    f"{r['train_s']:>8.2f} {r['sync_s']:>7.2f} {r['gen_idle']:>8.0%} {r['train_idle']:>10.0%}"
                )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, rows in curves.items():
        ax.plot([r["nodes"] for r in rows], [r["effective_samples_per_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes (8 x H100 each)")
    ax.set_ylabel("predicted samples/s (with interruptions)")
    ax.set_title("GRPO, 7.6B model, 1024-token responses: best layout per node count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    summary = {
        name: {str(r["nodes"]): round(r["effective_samples_per_s"], 1) for r in rows} for name, rows in curves.items()
    }
    print(json.dumps({"figure": args.out, "samples_per_s": summary, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
