#!/usr/bin/env bash
# Set up everything (idempotent) and run the whole test suite: the Rust ring's
# cargo tests, then pytest, which starts a throwaway local Slurm cluster
# (tools/slurm_cluster.sh) for the tests marked `slurm`.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k ring -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
# Rust lints first (seconds on a warm build): formatting (rust/rustfmt.toml) and clippy with
# warnings as errors. A missing component is installed with rustup; only if that fails
# (offline, no rustup) is the lint skipped, saying so.
have_cargo_tool() {  # $1: cargo subcommand, $2: its rustup component
    cargo "$1" --version >/dev/null 2>&1 && return 0
    if command -v rustup >/dev/null && rustup component add "$2" >/dev/null 2>&1 \
        && cargo "$1" --version >/dev/null 2>&1; then
        return 0
    fi
    echo "[test] SKIPPED cargo $1: the rustup component '$2' is missing and could not be installed" \
        "(run: rustup component add $2)" >&2
    return 1
}
if have_cargo_tool fmt rustfmt; then
    echo "[test] cargo fmt --check (rust/)"
    cargo fmt --check
fi
if have_cargo_tool clippy clippy; then
    echo "[test] cargo clippy -D warnings (rust/, with the python feature)"
    cargo clippy -q --all-targets --features python -- -D warnings
fi
echo "[test] ruff check + ruff format --check (pyproject.toml [tool.ruff])"
ruff check rollout_hpc tests tools
ruff format --check rollout_hpc tests tools
echo "[test] mypy rollout_hpc"
mypy rollout_hpc
echo "[test] cargo test (rust/)"
cargo test -q -p rollout-ring --release 2>&1 | tail -n 25
# Every test run starts ranks that import the package; where PYTHONDONTWRITEBYTECODE is set (as in CI's
# container) nothing caches the compiled modules, so each process would compile them again: do it once here.
python -m compileall -q rollout_hpc tools tests >/dev/null
echo "[test] pytest"
exec python -m pytest -q -ra -p no:cacheprovider --durations=30 "$@"
