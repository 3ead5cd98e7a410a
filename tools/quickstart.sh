#!/usr/bin/env bash
# Set up everything (idempotent), then run the quickstart locally under mpirun: a tiny built-in model learns
# two-digit sums from configs/data/, SFT warm-up then GRPO, with held-out accuracy before and after RL.
# Extra arguments go to `rollout-hpc submit`, e.g. `--set algorithm.steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
rollout-hpc submit configs/quickstart.yaml --local --set run.dir="$run_dir" "$@"
rollout-hpc analyze "$run_dir"
# Held-out accuracy just before the first RL update (the end of the warm-up) and after the last step.
rollout-hpc analyze "$run_dir" --json | python -c '
import json, sys, yaml
warmup = yaml.safe_load(open(sys.argv[1] + "/config.resolved.yaml"))["warmup"]["sft_steps"]
ev = json.load(sys.stdin)["eval"] or {}
steps, acc = ev.get("step", []), ev.get("accuracy", [])
if warmup in steps:
    print(f"[quickstart] held-out accuracy before RL (step {warmup}): {acc[steps.index(warmup)]:.3f}  "
          f"after RL (step {steps[-1]}): {acc[-1]:.3f}")' "$run_dir"
echo "[quickstart] run dir: $run_dir  (try: rollout-hpc plot $run_dir)"
