"""rollout-hpc: Slurm-native reinforcement learning for large language models.

One YAML file becomes a heterogeneous Slurm job: a generator node group and a
trainer node group in one MPI world, experience flowing through a node-local
Rust shared-memory ring and MPI, durable state in HDF5.
"""

__version__ = "0.1.0"
