#!/usr/bin/env bash
# Set up everything (idempotent), then run the quickstart locally under mpirun:
# a tiny built-in model learns single-digit arithmetic with GRPO on the CPU.
# Extra arguments go to `rollout-hpc submit`, e.g. `--set algorithm.steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
rollout-hpc submit configs/quickstart.yaml --local --set run.dir="$run_dir" "$@"
rollout-hpc analyze "$run_dir"
echo "[quickstart] run dir: $run_dir  (try: rollout-hpc plot $run_dir)"
