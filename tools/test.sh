#!/usr/bin/env bash
# Set up everything (idempotent) and run the whole test suite: the Rust ring's
# cargo tests, then pytest, which starts a throwaway local Slurm cluster
# (tools/slurm_cluster.sh) for the tests marked `slurm`.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k ring -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
echo "[test] cargo test (rust/)"
cargo test -q -p rollout-ring --release 2>&1 | tail -n 25
echo "[test] pytest"
exec python -m pytest -q -ra -p no:cacheprovider "$@"
