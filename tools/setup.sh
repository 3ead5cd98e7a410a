#!/usr/bin/env bash
# Sets up a Debian 12 machine for rollout-hpc: system packages, the Rust toolchain check, and the Python venv
# with the project installed editable (which builds the Rust ring extension). Idempotent: a second run only
# checks, and takes seconds. Run as root, or as a user with sudo (only apt-get uses sudo).
#
#   tools/setup.sh              # venv at ${ROLLOUT_VENV:-<repo>/.venv}, python from ${PYTHON:-python3}
#   tools/setup.sh --bench      # also the benchmarks' baselines (TRL, Ray, datasets): tools/bench_*.py compare with them
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ROLLOUT_VENV:-$REPO/.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=train,analysis,test
for arg in "$@"; do
    case $arg in
        --bench) EXTRAS=$EXTRAS,bench ;;
        *) echo "usage: tools/setup.sh [--bench]" >&2; exit 2 ;;
    esac
done
APT_PACKAGES=(slurm-wlm munge openmpi-bin libopenmpi-dev libpmix-dev build-essential)
STAMP=$VENV/.rollout-setup-stamp

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "not root and no sudo: run as root to install system packages"
    SUDO=(sudo)
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

step_apt() {
    local wanted=("${APT_PACKAGES[@]}") missing=() pkg
    # Only a venv that does not exist yet needs venv support from the system python.
    if [[ ! -x $VENV/bin/python ]] && ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
        wanted+=(python3-venv)
    fi
    for pkg in "${wanted[@]}"; do installed "$pkg" || missing+=("$pkg"); done
    if ((${#missing[@]} == 0)); then
        say "apt: ok (already installed)"
        return
    fi
    say "apt: installing ${missing[*]}"
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    say "apt: ok (installed ${missing[*]})"
}

step_rust() {
    [[ -x $HOME/.cargo/bin/cargo ]] && PATH=$HOME/.cargo/bin:$PATH
    if ! command -v cargo >/dev/null; then
        echo "[setup] ERROR: cargo (Rust) not found; the ring extension needs it. Install it with:" >&2
        echo "  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \$HOME/.cargo/env" >&2
        echo "then run tools/setup.sh again." >&2
        exit 1
    fi
    say "rust: ok ($(cargo --version))"
}

# Everything that changes what `pip install -e` produces: the package metadata and the Rust sources.
inputs_digest() {
    (
        cd "$REPO"
        {
            echo "venv-python $("$VENV/bin/python" -c 'import sys; print(sys.version)')"
            echo "extras $EXTRAS"
            find pyproject.toml Cargo.toml Cargo.lock rust -type f -not -path 'rust/target/*' 2>/dev/null |
                LC_ALL=C sort | xargs -d '\n' sha256sum
        } | sha256sum | cut -d' ' -f1
    )
}

step_venv() {
    if [[ -x $VENV/bin/python ]]; then
        say "venv: ok ($VENV)"
    else
        say "venv: creating $VENV"
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
    local digest
    digest=$(inputs_digest)
    if [[ -f $STAMP && $(<"$STAMP") == "$digest" ]]; then
        say "pip: ok (nothing changed since the last install)"
        return
    fi
    say "pip: installing rollout-hpc[$EXTRAS] editable (builds the Rust extension)"
    (cd "$REPO" && "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]")
    "$VENV/bin/python" -c "import rollout_hpc._ring" || die "the Rust extension rollout_hpc._ring does not import"
    echo "$digest" >"$STAMP"
    say "pip: ok (installed)"
}

# Bytecode of the package, once: every rank, worker and command imports ~80 of its modules, and where
# PYTHONDONTWRITEBYTECODE is set (as on many managed machines) each process would compile them again (~0.3 s).
step_bytecode() {
    "$VENV/bin/python" -m compileall -q "$REPO/rollout_hpc" "$REPO/tools" >/dev/null || die "compileall failed"
    say "bytecode: ok"
}

step_apt
step_rust
step_venv
step_bytecode
say "done. Activate with: . $VENV/bin/activate   Local Slurm cluster: tools/slurm_cluster.sh start"
