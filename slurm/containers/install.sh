#!/bin/bash
# Installs rollout-hpc with its GPU stack into a container image; run as root at build time by
# slurm/containers/rollout-hpc.def (Apptainer) and slurm/containers/Dockerfile (Docker -> enroot/pyxis).
#   bash install.sh SRC      SRC: a copy of the repository (default /opt/rollout-hpc)
# Base: an Ubuntu 24.04 CUDA "devel" image (Python 3.12; nvcc for DeepSpeed's just-in-time ops).
# The versions are pinned together: vLLM pins torch (and a transformers range), megatron-core 0.19 needs
# Python >= 3.12. Change them together, and only to a set you have built and tested.
set -euo pipefail

SRC=${1:-/opt/rollout-hpc}
VENV=${VENV:-/opt/venv}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}                     # pins torch 2.14.0 (CUDA 13 wheels)
MEGATRON_CORE_VERSION=${MEGATRON_CORE_VERSION:-0.19.2}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.2}
RUST_TOOLCHAIN=${RUST_TOOLCHAIN:-1.95.0}                 # only to build the ring extension; removed afterwards

export DEBIAN_FRONTEND=noninteractive
apt-get update
# Open MPI 4.1 built against the external PMIx (libpmix2) and UCX: the ranks join `srun --mpi=pmix`.
# ibverbs-providers: InfiniBand/RoCE for UCX and NCCL (the host's devices are bound in at run time).
apt-get install -y --no-install-recommends \
    ca-certificates curl build-essential pkg-config \
    python3 python3-dev python3-venv \
    openmpi-bin libopenmpi-dev libpmix-dev \
    ibverbs-providers libibverbs-dev librdmacm-dev
rm -rf /var/lib/apt/lists/*

export RUSTUP_HOME=/tmp/rustup CARGO_HOME=/tmp/cargo
curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --no-modify-path --profile minimal --default-toolchain "$RUST_TOOLCHAIN"
export PATH="$CARGO_HOME/bin:$PATH"

python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --no-cache-dir "$@"; }
pip install -U pip
# The GPU stack first, in one resolve: vLLM fixes torch; megatron-core and DeepSpeed are resolved against it.
pip install "vllm==$VLLM_VERSION" "megatron-core==$MEGATRON_CORE_VERSION" "deepspeed==$DEEPSPEED_VERSION"
# mpi4py compiled against the image's Open MPI (a pip-bundled MPI would not talk to srun's PMIx).
MPICC=mpicc pip install --no-binary=mpi4py "mpi4py==$MPI4PY_VERSION"
# The package itself (maturin builds rollout_hpc._ring); every requirement above is already satisfied,
# so pip keeps those versions.
rm -f "$SRC"/rollout_hpc/_ring*.so
pip install "$SRC[train,analysis,gpu]"

rm -rf "$RUSTUP_HOME" "$CARGO_HOME" "$SRC/target" /root/.cache
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(rollout-hpc|vllm|torch|megatron-core|deepspeed|transformers|mpi4py) '
