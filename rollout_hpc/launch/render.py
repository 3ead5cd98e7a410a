"""Render the job script: slurm/directives.j2 fills the blocks of slurm/rollout.sbatch from a config.

The base template is itself a valid sbatch script (its '#%' template lines are bash comments), so
`sbatch slurm/rollout.sbatch` works without the CLI; the CLI only replaces the #SBATCH directives,
the environment block and the job step's srun/exec prefix arrays.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

from rollout_hpc import __version__
from rollout_hpc.config import Config, GroupSection
from rollout_hpc.errors import UserError
from rollout_hpc.launch.mpi_env import placement_env

BASE_TEMPLATE = "rollout.sbatch"
CONFIG_TEMPLATE = "directives.j2"
PACKAGED_TEMPLATES = "slurm_templates"  # package data (pyproject.toml [tool.maturin] include)


def template_dir() -> Path:
    """$ROLLOUT_TEMPLATES if set; else the templates shipped in the package (rollout_hpc/slurm_templates: in a
    checkout a link to its top-level slurm/, in a wheel a copy); else slurm/ of the checkout this module is in."""
    override = os.environ.get("ROLLOUT_TEMPLATES")
    if override:
        path = Path(override)
    else:
        shipped = Path(str(resources.files("rollout_hpc") / PACKAGED_TEMPLATES))
        path = shipped if (shipped / BASE_TEMPLATE).is_file() else Path(__file__).resolve().parents[2] / "slurm"
    if not (path / BASE_TEMPLATE).is_file():
        raise UserError(
            f"the job script template {path / BASE_TEMPLATE} is missing; "
            "set ROLLOUT_TEMPLATES to the directory holding rollout.sbatch and directives.j2"
        )
    return path


def template_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        # '#%' lines are bash comments, so the base template stays a runnable script.
        line_statement_prefix="#%",
        # bash's ${#array[@]} must not open a Jinja comment.
        comment_start_string="{##",
        comment_end_string="##}",
        keep_trailing_newline=True,
        trim_blocks=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


@dataclass
class Component:
    """One het component: the role it hosts and its #SBATCH options."""

    role: str
    options: list[str] = field(default_factory=list)


def step_python(cfg: Config) -> str:
    """The interpreter of the job step: the config's, else python3 in a container, else ours."""
    if cfg.slurm.python:
        return cfg.slurm.python
    return "python3" if cfg.slurm.container else sys.executable


def _check_path(run_dir: Path) -> None:
    # #SBATCH lines are not shell-quoted by sbatch, and '%' is a filename pattern there.
    if re.search(r"[\s%]", str(run_dir)):
        raise UserError(
            f"the run directory '{run_dir}' contains a space or '%', which #SBATCH --output cannot hold; "
            "set run.dir (or run.name) to a path without them"
        )


def _group_options(cfg: Config, group: GroupSection) -> list[str]:
    s = cfg.slurm
    opts = [
        f"--nodes={group.nodes}",
        f"--ntasks-per-node={group.tasks_per_node}",
        f"--cpus-per-task={group.cpus_per_task}",
    ]
    if group.gpus_per_task:
        if s.gpu_request == "gres":
            opts.append(f"--gres=gpu:{group.gpus_per_task * group.tasks_per_node}")
        else:
            opts.append(f"--gpus-per-task={group.gpus_per_task}")
    if group.mem:
        opts.append(f"--mem={group.mem}")
    for name, value in (
        ("partition", group.partition or s.partition),
        ("account", s.account),
        ("qos", s.qos),
        ("constraint", group.constraint or s.constraint),
    ):
        if value:
            opts.append(f"--{name}={value}")
    opts.append(f"--time={s.time}")
    return opts


def colocated_group(cfg: Config) -> GroupSection:
    """The one component of placement 'colocated': each node runs its generator tasks and its trainer tasks (the
    step's cyclic distribution puts generator i and trainer i on node i, see colocated_srun_args), with the CPUs and
    memory of both groups; each rank uses all of them in its phase."""
    g, t = cfg.generator, cfg.trainer
    return g.model_copy(
        update={
            "tasks_per_node": g.tasks_per_node + t.tasks_per_node,
            "cpus_per_task": max(g.cpus_per_task, t.cpus_per_task),
            "gpus_per_task": max(g.gpus_per_task, t.gpus_per_task),
            "mem": _node_memory(g.mem, t.mem),
            "partition": g.partition or t.partition,
            "constraint": g.constraint or t.constraint,
        }
    )


_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def _node_memory(a: str | None, b: str | None) -> str | None:
    """--mem of a node running both groups: the sum of theirs ('0', all of the node's memory, wins)."""
    if a is None or b is None or "0" in (a, b):
        return "0" if "0" in (a, b) else a or b
    total = 0.0
    for size in (a, b):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", size)
        assert m is not None  # the config validated it (config._SLURM_MEM)
        total += float(m[1]) * _MB[m[2] or "M"]  # Slurm's default unit: megabytes
    return f"{math.ceil(total)}M"


def colocated_srun_args(cfg: Config) -> list[str]:
    """The job step of a colocated job. World ranks [0, G) are the generators and the trainers follow, with as many
    of each on every node: `cyclic` deals rank r to node r mod N, so node i gets generator i and trainer i (with
    more tasks per node, every node the same share of each). No CPU binding: the two roles of a node take turns,
    each with all of the node's CPUs (runtime/train_program.cpu_threads)."""
    return ["--distribution=cyclic", "--cpu-bind=none"] if cfg.placement == "colocated" else []


def _one_line(text: str, what: str) -> str:
    """A value written into the script outside shell quoting (#SBATCH lines, the header comment) must stay on its line."""
    if re.search(r"[\x00-\x1f\x7f]", text):
        raise UserError(
            f"{what} {text!r} contains a control character (a newline would start a shell command in "
            "the job script); remove it from the config"
        )
    return text


def components(cfg: Config, run_dir: Path) -> list[Component]:
    """Component 0 = generators (with the job-wide options), component 1 = trainers, then the reward group
    (rewards.models with nodes > 0) and the environment group (envs.nodes > 0), if the config has them."""
    job_wide = [
        f"--job-name={cfg.run.name}",
        f"--signal=B:USR1@{cfg.slurm.signal_lead_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir}/logs/slurm-%j.out",
        f"--error={run_dir}/logs/slurm-%j.err",
        *cfg.slurm.extra_sbatch,
    ]
    if cfg.placement == "colocated":
        node = _group_options(cfg, colocated_group(cfg))
        out = [Component("generator and trainer", job_wide[:1] + node + job_wide[1:])]
    else:
        out = [Component("generator", job_wide[:1] + _group_options(cfg, cfg.generator) + job_wide[1:])]
        out += [Component(role, _group_options(cfg, group)) for role, group, _ in cfg.het_groups[1:]]
    for component in out:  # config validation refuses these already; the script must never depend on it
        for option in component.options:
            _one_line(option, "#SBATCH option")
    return out


def _step_prefixes(cfg: Config) -> tuple[list[str], list[str]]:
    """(extra srun options, command before python) for the container runtime, if any."""
    c = cfg.slurm.container
    if c is None:
        return [], []
    if c.runtime == "pyxis":
        srun_args = [f"--container-image={c.image}"]
        if c.mounts:
            srun_args.append(f"--container-mounts={','.join(c.mounts)}")
        return srun_args, []
    prefix = ["apptainer", "exec"]
    if any(group.gpus_per_task for _, group, _ in cfg.het_groups):
        prefix.append("--nv")
    for mount in c.mounts:
        prefix += ["--bind", mount]
    return [], prefix + [c.image]


def render_script(cfg: Config, run_dir: Path, source: str = "(defaults)") -> str:
    """The job script for cfg, with its run directory fixed to run_dir (made absolute)."""
    run_dir = Path(os.path.abspath(run_dir))
    _check_path(run_dir)
    srun_args, exec_prefix = _step_prefixes(cfg)
    srun_args = colocated_srun_args(cfg) + srun_args
    return (
        template_env()
        .get_template(CONFIG_TEMPLATE)
        .render(
            version=__version__,
            source=re.sub(r"[\x00-\x1f\x7f]", "?", source),  # a comment line: a config path must not end it
            digest=cfg.digest(),
            components=components(cfg, run_dir),
            run_dir=run_dir,
            python=step_python(cfg),
            mpi=cfg.slurm.mpi,
            max_requeues=cfg.slurm.max_requeues,
            modules=cfg.slurm.modules,
            env={**placement_env(cfg), **cfg.slurm.env},
            srun_args=srun_args,
            exec_prefix=exec_prefix,
        )
    )


def render_base() -> str:
    """The base template rendered with no overrides: the script `sbatch slurm/rollout.sbatch` runs."""
    return template_env().get_template(BASE_TEMPLATE).render()
