"""The run configuration: one YAML file, typed and validated with pydantic.

Every error names the field path, the file and line where the YAML has one,
and how to fix it (`ConfigError`). `--set a.b=value` overrides are applied to
the raw mapping before validation, so they are checked like file values.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout_hpc.algos.table import ALGORITHM_NAMES, ALGORITHMS  # torch-free: the algorithm names come from the table
from rollout_hpc.errors import ConfigError, UserError  # noqa: F401  (re-exported: config.UserError)

GROUP_ESTIMATORS = ("group_normalized", "group_centered", "leave_one_out")  # baselines from a prompt's own samples

# Values that reach the job script's #SBATCH lines are not shell-quoted there (sbatch reads them as they are), so
# each is held to what Slurm accepts; a newline would end the #SBATCH line and start a shell command.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")  # partition (or a list), account, qos
_SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|!*:\[\]()=-]+")  # feature expression, no spaces
_SLURM_MEM = re.compile(r"\d+(\.\d+)?[KMGT]?B?")
_SBATCH_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*([= ]\S.*)?")


def _no_control(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise ValueError(f"{what} {value!r} contains a control character (newline, tab, ...); remove it")
    return value


def _slurm_value(value: str | None, pattern: re.Pattern, what: str, example: str) -> str | None:
    if value is None:
        return value
    _no_control(value, what)
    if not pattern.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid {what} for Slurm; write it like {example}")
    return value


class _Section(BaseModel):
    # Unknown keys are errors: a typo must never be silently ignored on a cluster.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def parse_slurm_time(text: str) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text) * 60
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", text)
    if m:
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + s
    parts = text.split(":")
    if all(p.isdigit() for p in parts) and 2 <= len(parts) <= 3:
        nums = [int(p) for p in parts]
        if len(nums) == 2:
            return nums[0] * 60 + nums[1]
        return (nums[0] * 60 + nums[1]) * 60 + nums[2]
    raise ValueError(f"'{text}' is not a Slurm time limit; use MM, MM:SS, HH:MM:SS or D-HH:MM:SS (e.g. 02:00:00)")


class RunSection(_Section):
    name: str = Field("quickstart", description="Run name; also names shared-memory segments.")
    dir: str | None = Field(
        None,
        description="Run directory (default: runs/<name>). Put it on the shared filesystem; $VARS and ~ are expanded.",
    )
    dir_mode: str = Field(
        "0700",
        description="Permissions of the run directory (octal): 0700 keeps checkpoints, logs and data private to you; "
        "0750 (or 2770 with a shared group) shares them with your group.",
    )
    seed: int = Field(0, description="Global seed; every rank derives its own from it.")
    program: Literal["train", "sft", "hello", "profile"] = Field(
        "train",
        description="What the ranks run: 'train' (warmup.sft_steps of SFT, if any, then the RL loop), 'sft' "
        "(only the warm-up: supervised fine-tuning on the dataset's answers), 'hello' (prove the MPI world and exit), "
        "or 'profile' (measure the costs `rollout-hpc plan` predicts from; `rollout-hpc profile` sets it).",
    )
    hang_timeout: float = Field(
        300.0,
        ge=0,
        description="Seconds a rank may make no progress (no step done, no wait on another rank) before the job dumps "
        "every rank's Python stacks into logs/stacks-rank*.txt and ends (after a checkpoint where one can be written); "
        "0 = never. Counted from the end of start-up; raise it when one step can take longer. It also bounds MPI "
        "start-up (a rank whose peers never join prints where it waits and exits 1).",
    )

    @field_validator("dir_mode", mode="before")
    @classmethod
    def _dir_mode_is_octal(cls, v: object) -> str:
        def owner_rwx(text: str) -> bool:
            return bool(re.fullmatch(r"0?[0-7]{3,4}", text)) and int(text, 8) & 0o700 == 0o700

        text = str(v)
        if isinstance(v, int) and not isinstance(v, bool) and not owner_rwx(text):
            text = f"{v:o}"  # YAML 1.1 read 0750 as the octal number 488; 750 or 2770 stay as written
        if not owner_rwx(text):
            raise ValueError(
                f"'{text}' is not an octal mode that leaves the run's owner rwx; use e.g. 0700 (private) or 0750 (group)"
            )
        return text.zfill(4)

    @field_validator("name")
    @classmethod
    def _name_is_filename_safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
            raise ValueError("use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    def resolved_dir(self) -> Path:
        if not self.dir:
            return Path(f"runs/{self.name}")
        expanded = os.path.expanduser(os.path.expandvars(self.dir))
        unset = re.search(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expanded)
        if unset:
            raise ConfigError(
                f"run.dir '{self.dir}': the environment variable ${unset.group(1)} is not set here; "
                "set it, or write the path out"
            )
        return Path(expanded)


class LoraSection(_Section):
    rank: int = Field(8, gt=0, description="LoRA rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: the update is B @ A * alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Last names of the linear layers to adapt (e.g. q_proj, v_proj), or ['all-linear'] "
        "(every linear layer but the output head).",
    )


class ModelSection(_Section):
    path: str | None = Field(None, description="Local Hugging Face causal-LM directory. None = built-in tiny model.")
    init_from: str | None = Field(
        None,
        description="Start from the weights of another run: its directory (the newest valid checkpoint) or one "
        "checkpoint file (RUN_DIR/checkpoints/step-N.h5), e.g. an SFT run (run.program: sft). Same model.* otherwise.",
    )
    # Built-in tiny model (random init from this config, tokenizer made in code).
    hidden_size: int = Field(64, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(64, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraSection | None = Field(
        None,
        description="Train LoRA adapters (peft) instead of every weight: the base is frozen, the optimizer and "
        "checkpoints hold only the adapters, the generators get the merged weights (docs/training.md).",
    )

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSection:
        if self.path is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of model.num_heads ({self.num_heads})"
            )
        return self


class EnvSection(_Section):
    """How a multi-turn task's episodes are played (task.env; docs/agentic.md)."""

    max_turns: int | None = Field(
        None, ge=1, description="Model turns after which an episode ends (truncated); default: the environment's own."
    )
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="Tokens the model may generate in one turn; default: algorithm.max_new_tokens."
    )
    parallel_envs: int = Field(
        64,
        ge=1,
        description="Episodes a generator rank steps at once: every turn their next prompts go to the generator in "
        "one batched call; a finished episode leaves the batch and the next waiting one joins it.",
    )
    format_penalty: float = Field(
        0.0,
        ge=0,
        description="Subtracted from an episode's reward for every turn whose reply the environment could not parse "
        "(its step() info says format_error or invalid).",
    )
    step_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds one reset() or step() of an environment may take; past it the episode ends as an "
        "environment error (counted, reward 0) and the run goes on.",
    )


class TaskSection(_Section):
    name: str = Field(
        "arithmetic",
        description="Built-in task (arithmetic, sokoban, frozenlake, dataset), a gymnasium environment 'gym:ENV_ID', "
        "or a plugin 'pkg.mod:attr' / 'file.py:attr'.",
    )
    reward: str | None = Field(
        None,
        description="The reward: built-in 'math', 'exact' or 'regex:PATTERN', or a plugin 'pkg.mod:fn' / 'file.py:fn' "
        "fn(prompt_item, response_text) -> float; overrides the task's own. Required for task.name 'dataset'.",
    )
    format_reward: float = Field(
        0.0,
        ge=0,
        description="Weight of a format bonus added to built-in rewards "
        "(math: the response has a \\boxed{} answer; with format_pattern: the regex is found).",
    )
    format_pattern: str | None = Field(
        None, description="Regex a well-formatted response contains (for format_reward)."
    )
    reward_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds one sample's reward may take; past it the sample "
        "scores 0 and counts as a reward error (the run goes on).",
    )
    reward_workers: int = Field(
        2,
        ge=0,
        description="Reward worker processes per generator rank; 0: score in the generator rank itself (faster "
        "for a fast reward such as exact match, but no reward_timeout and no isolation from a reward that hangs).",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the task.")
    env: EnvSection = Field(default_factory=EnvSection, description="Multi-turn episodes (sokoban, gym:..., plugins).")

    def sources(self) -> list[dict] | None:
        """The sources of a mixed dataset (task.name 'dataset' with task.params.train a list), else None."""
        train = self.params.get("train")
        return train if self.name == "dataset" and isinstance(train, list) else None


_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


class ValSource(_Section):
    """One held-out source of a mixed dataset (task.params.val as a list): its name matches a training source."""

    name: str = Field(description="The source's name: in metrics, the log and file names (letters, digits, _ . -).")
    path: str = Field(description="Its file or directory (any format task.params.train takes).")
    prompt_key: str | None = Field(None, description="Default: task.params.prompt_key.")
    answer_key: str | None = Field(None, description="Default: task.params.answer_key.")
    system_prompt: str | None = Field(None, description="Default: task.params.system_prompt.")

    @field_validator("name")
    @classmethod
    def _name_is_filename_safe(cls, v: str) -> str:
        if not _SOURCE_NAME.fullmatch(v):
            raise ValueError(
                f"source name {v!r}: use 1-32 letters, digits, '_', '.' or '-', starting with a letter or digit"
            )
        return v


class TrainSource(ValSource):
    """One training source of a mixed dataset (task.params.train as a list)."""

    weight: float = Field(1.0, gt=0, description="Share of every step's prompts (a quota: floor(w / sum w x P)).")
    reward: str | None = Field(None, description="This source's reward (default: task.reward).")
    quota: int | None = Field(
        None, description="Derived: prompts of each step from this source (written into the resolved config)."
    )


class RewardModelSpec(_Section):
    """One learned reward: a sequence classifier or an LLM judge, scored next to the rule reward (docs/rewards.md)."""

    name: str = Field(description="Names the model in metrics and the log (letters, digits, _ . -).")
    path: str = Field(
        description="Local Hugging Face model directory (AutoModelForSequenceClassification or causal LM)."
    )
    kind: Literal["classifier", "judge"] = Field(
        description="classifier: the model's logit scores (prompt, response); judge: a causal LM prompted with "
        "`template` whose reply `pattern` parses into a score."
    )
    weight: float = Field(1.0, description="The score's weight in the sample's reward (after normalization).")
    backend: Literal["hf", "vllm"] = Field("hf", description="hf (CPU or GPU, transformers); vllm (judge on GPUs).")
    nodes: int = Field(
        0, ge=0, description="0: scored in the generator ranks' processes; N > 0: a het group of N nodes of its own."
    )
    tasks_per_node: int = Field(1, ge=1, description="Reward ranks per node (nodes > 0).")
    batch_size: int = Field(16, ge=1, description="Samples per forward pass.")
    max_length: int = Field(1024, ge=8, description="Tokens of (prompt, response) it reads; longer: the start is cut.")
    normalize: bool = Field(True, description="Scale by the running mean and std of its scores (state in checkpoints).")
    domains: list[str] | None = Field(
        None, description="A mixed dataset's sources it scores (default: all); others get no score from it."
    )
    positive_label: int | None = Field(
        None, description="classifier with several labels: the label whose probability is the score (default: last)."
    )
    template: str | None = Field(
        None, description="judge: the prompt, with {question}, {response} and {answer} (default: a 0-10 rating)."
    )
    pattern: str = Field(
        r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}",
        description="judge: a regular expression whose first group is the score (default: \\boxed{N}).",
    )
    max_new_tokens: int = Field(16, ge=1, description="judge: tokens of its reply.")
    parse_failure_score: float = Field(
        0.0, description="judge: the raw score of a reply `pattern` does not match (counted as a parse failure)."
    )

    @field_validator("name")
    @classmethod
    def _name_is_filename_safe(cls, v: str) -> str:
        if not _SOURCE_NAME.fullmatch(v):
            raise ValueError(f"reward model name {v!r}: use 1-32 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as exc:
            raise ValueError(f"pattern {v!r} is not a regular expression: {exc}") from None
        if groups < 1:
            raise ValueError(f"pattern {v!r} has no group; put the score in one, e.g. 'Score: (\\d+)'")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> RewardModelSpec:
        if self.kind == "classifier" and self.template is not None:
            raise ValueError(f"{self.name}: template is for kind 'judge'; a classifier reads the chat as it is")
        if self.kind == "judge" and self.positive_label is not None:
            raise ValueError(f"{self.name}: positive_label is for kind 'classifier'")
        return self


class TaskResources(_Section):
    """What each rank of a het group gets from Slurm."""

    gpus_per_task: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    mem: str | None = Field(None, description="Slurm --mem for this group, e.g. 64G.")
    partition: str | None = Field(None, description="Partition for this group only (default: slurm.partition).")
    constraint: str | None = Field(None, description="Node features for this group only (default: slurm.constraint).")

    @field_validator("mem")
    @classmethod
    def _mem_is_a_size(cls, v: str | None) -> str | None:
        return _slurm_value(v, _SLURM_MEM, "memory size", "'64G', '500M' or '0' (all of a node's memory)")

    @field_validator("partition")
    @classmethod
    def _partition_is_a_name(cls, v: str | None) -> str | None:
        return _slurm_value(v, _SLURM_NAME, "partition name", "'gpu' or 'gpu,gpu-long'")

    @field_validator("constraint")
    @classmethod
    def _constraint_is_an_expression(cls, v: str | None) -> str | None:
        return _slurm_value(v, _SLURM_CONSTRAINT, "constraint", "'a100', 'a100&ib' or '[rack1|rack2]' (no spaces)")


class RewardGroupSection(TaskResources):
    """Resources of each rank of the reward group (the models with nodes > 0; their nodes and tasks_per_node size it)."""


class EnvsSection(TaskResources):
    """Where a multi-turn task's environments run (docs/agentic.md "Environment workers"): in threads of each
    generator rank (the default), in worker processes beside it (workers), or on a het group of their own (nodes)."""

    workers: int = Field(
        0,
        ge=0,
        description="Environment worker processes per rank that hosts environments (a generator rank, or an "
        "environment rank when nodes > 0); 0: threads of that rank. Processes keep a simulator's CPU work off the "
        "rank's interpreter lock, and a crash of one ends its episodes, not the run.",
    )
    nodes: int = Field(
        0,
        ge=0,
        description="> 0: the environments run on an environment group of their own, a het component of this many "
        "nodes after the trainers (CPU-only unless gpus_per_task); generator rank g's episodes step on environment "
        "rank g mod (nodes x tasks_per_node).",
    )
    tasks_per_node: int = Field(1, ge=1, description="Environment ranks per node of the environment group.")


class RewardsSection(_Section):
    """Learned rewards next to the task's rule reward: reward = rule_weight x rule + sum of weight x score."""

    rule_weight: float = Field(1.0, ge=0, description="Weight of the task's rule reward (0: the models alone).")
    models: list[RewardModelSpec] = Field(default_factory=list, description="Reward models and LLM judges.")
    group: RewardGroupSection = Field(
        default_factory=RewardGroupSection,
        description="Per-rank resources of the reward group: the het component of the models with nodes > 0.",
    )

    @field_validator("models")
    @classmethod
    def _unique(cls, v: list[RewardModelSpec]) -> list[RewardModelSpec]:
        names = [m.name for m in v]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards.models: names must be unique, got {names}")
        if len(v) > 8:
            raise ValueError(f"rewards.models: at most 8 reward models, got {len(v)}")
        return v


def mixture_quotas(weights: list[float], prompts_per_step: int) -> list[int]:
    """Per-step prompts of each source: floor(w_k / sum(w) x P), the remainder to the last source."""
    total = sum(weights)
    # + 1e-9: decimal weights (0.1, 0.2, 0.7) are not exact in binary; their quotas must not round down a whole prompt
    quotas = [int(w * prompts_per_step / total + 1e-9) for w in weights[:-1]]
    return quotas + [prompts_per_step - sum(quotas)]


_S = TypeVar("_S", bound=ValSource)


def _source_list(value: Any, where: str, model: type[_S]) -> list[_S]:
    """task.params.train / val as a list of source mappings, each validated (errors name the entry)."""
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"{where}[{i}] must be a mapping {{name, path, ...}}, got {type(item).__name__}")
        try:
            out.append(model.model_validate(item))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            raise ValueError(f"{where}[{i}] ({item.get('name', '?')}): {problems}") from None
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: source names must be unique, got {names}")
    return out


class WarmupSection(_Section):
    """Supervised warm-up before RL: teacher-forced training on the task's (prompt, answer) pairs, in the same run."""

    sft_steps: int = Field(
        0,
        ge=0,
        description="SFT steps before the first RL step (0: none). With run.program 'sft' the run is these steps only.",
    )
    batch_size: int | None = Field(
        None,
        gt=0,
        description="(prompt, answer) pairs per SFT step (default: algorithm.prompts_per_step x algorithm.group_size).",
    )
    lr: float | None = Field(None, gt=0, description="SFT learning rate (default: algorithm.lr); constant.")


class EvalSection(_Section):
    """Validation during training: the task's held-out prompts, generated by the current policy, not trained on."""

    every_steps: int = Field(
        10, ge=0, description="Evaluate every N steps (0: only at the end); always after the last step."
    )
    at_start: bool = Field(True, description="Also evaluate the initial policy, before the first update.")
    samples_per_prompt: int = Field(1, ge=1, description="k: samples per eval prompt (pass@k, mean@k).")
    greedy: bool = Field(True, description="Temperature 0 when samples_per_prompt is 1.")
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate at most this many held-out prompts (default: all)."
    )
    max_new_tokens: int | None = Field(None, gt=0, description="Default: algorithm.max_new_tokens.")
    pass_threshold: float = Field(1.0, description="A sample counts as correct when its reward is at least this.")


class AlgorithmSection(_Section):
    name: Literal[ALGORITHM_NAMES] = Field("grpo", description="A row of rollout_hpc/algos/table.py.")  # type: ignore[valid-type]
    steps: int = Field(30, gt=0, description="Train steps in the whole run (across all allocations).")
    prompts_per_step: int = Field(8, gt=0)
    group_size: int = Field(4, gt=0, description="Samples per prompt.")
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    lr: float = Field(1e-3, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="DAPO clip-higher upper bound (default: clip_eps).")
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    step_advantage_weight: float = Field(
        0.0,
        ge=0,
        description="Multi-turn tasks, group-based algorithms (grpo, dapo, dr_grpo, rloo): GiGPO's step-level "
        "advantage. Turns of one group's episodes that acted on the same observation are compared by their "
        "return-to-go (discounted by gamma); this weight times that normalised difference is added to the "
        "episode-level advantage of each turn's tokens. 0: off (every turn gets its episode's advantage).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards are all equal and refill the step with new prompts (on by default for dapo).",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        ge=1,
        description="Dynamic sampling: at most this many generation rounds per step (1 = drop without refilling).",
    )
    normalize_by_domain: bool = Field(
        True,
        description="Mixed datasets: where an estimator normalises across the batch (reinforce_pp, ppo), do it "
        "within each source's rows instead (group-normalised advantages are per group anyway).",
    )
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong shaping: penalty ramps over the last N tokens.")
    overlong_penalty: float = Field(1.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate after warmup: constant, or linear / cosine decay to lr * min_lr_ratio at the "
        "last optimizer step (steps x mini_batches x epochs).",
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from lr / warmup_steps to lr.")
    warmup_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Warmup as a fraction of the run's optimizer steps (verl's lr_warmup_steps_ratio); "
        "give warmup_steps or warmup_ratio, not both.",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear / cosine: the final learning rate as a fraction of lr."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay (all parameters, as verl).")
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer updates per step: the step's batch (each rank's share) is "
        "split into this many mini-batches (PPO; verl ppo_mini_batch_size).",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="Passes over the step's batch; the ratio is taken against the behaviour "
        "policy's log-probs (the generators'), so updates after the first are clipped as in PPO.",
    )
    value_clip: float = Field(
        0.2,
        gt=0,
        description="PPO critic: value-loss clip range around the old values (a large value turns clipping off).",
    )
    critic_lr: float | None = Field(
        None, gt=0, description="PPO critic: its optimizer's learning rate (default: algorithm.lr)."
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a response ends once its text contains one "
        "(the tokenizer's EOS and generation_config.json eos_token_id end it too).",
    )

    @model_validator(mode="after")
    def _one_warmup(self) -> AlgorithmSection:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(
                f"algorithm.warmup_steps ({self.warmup_steps}) and algorithm.warmup_ratio ({self.warmup_ratio}) "
                "both set; give one of them"
            )
        return self


class GroupSection(TaskResources):
    """One het group: its nodes, its ranks per node, and each rank's resources."""

    nodes: int = Field(1, description="Nodes in this het group (>= 1).")
    tasks_per_node: int = Field(1, description="MPI ranks per node.")

    @field_validator("nodes", "tasks_per_node")
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be at least 1: each het group needs at least one node and one task per node")
        return v

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


class GeneratorSection(GroupSection):
    backend: Literal["hf", "vllm"] = "hf"
    tensor_parallel: int = Field(1, ge=1)
    extra_prompts: int = Field(
        0,
        ge=0,
        description="Sample-level rollout scheduling: generate this many prompts more than a step trains on; the "
        "step takes the groups that finish first and aborts the rest, whose prompts are retried (fresh samples) at "
        "the next step, where they must finish. Cuts the long tail of on-policy steps; which prompts a step trains on "
        "then depends on when groups finish (0: exactly algorithm.prompts_per_step, bitwise-reproducible resume). With "
        "dynamic sampling, uninformative groups are dropped as they finish instead of in refill rounds.",
    )


class TrainerSection(GroupSection):
    backend: Literal["torch", "deepspeed", "megatron"] = "torch"
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    max_tokens_per_microbatch: int | None = Field(
        None,
        gt=0,
        description="Split each rank's share of a mini-batch into micro-batches of at most this many padded "
        "tokens (rows x longest row), accumulating gradients: the update equals the unsplit one (None: one micro-batch).",
    )
    micro_batch_size: int | None = Field(None, gt=0, description="At most this many sequences per micro-batch.")
    logprob_chunk_tokens: int | None = Field(
        1024,
        gt=0,
        description="Project hidden states to vocabulary logits this many tokens at a time (recomputed in "
        "backward), so full-vocabulary fp32 logits never exist for a whole micro-batch (None: full logits).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in backward (HF models)."
    )
    packing: bool = Field(
        False,
        description="Padding-free packing: each micro-batch's sequences end to end in one row with their own "
        "position ids (no attention across them); max_tokens_per_microbatch then counts real tokens "
        "(Llama, Mistral, Qwen2, Qwen3; torch and deepspeed backends).",
    )

    @model_validator(mode="after")
    def _packing_has_a_backend(self) -> TrainerSection:
        if self.packing and self.backend == "megatron":
            raise ValueError(
                "trainer.packing is not supported by trainer.backend 'megatron'; use torch or deepspeed, "
                "or set trainer.packing: false"
            )
        return self


class ExchangeSection(_Section):
    ring_dir: str = Field("/dev/shm", description="Directory of the node ring segments (tmpfs).")
    ring_bytes: int = Field(64 << 20, gt=4096, description="Capacity of each node ring.")
    max_inflight_bytes: int = Field(256 << 20, gt=0, description="Bound on bytes sent over MPI but not yet received.")
    max_staleness: int = Field(0, ge=0, description="Policy versions a trajectory may lag; 0 = strictly on-policy.")
    weight_chunk_bytes: int = Field(64 << 20, gt=0)


class CheckpointSection(_Section):
    every_steps: int = Field(10, ge=0, description="Periodic checkpoint every N steps (0 = off).")
    every_minutes: float = Field(0, ge=0, description="Periodic checkpoint every M minutes (0 = off).")
    keep_last: int = Field(3, ge=1)


class TensorBoardSection(_Section):
    dir: str | None = Field(None, description="Event file directory (default: RUN_DIR/tensorboard).")


class WandbSection(_Section):
    mode: Literal["online", "offline"] | None = Field(
        None,
        description="Default: $WANDB_MODE, else offline (compute nodes often have no network: `wandb sync` later).",
    )
    project: str | None = Field(None, description="Default: $WANDB_PROJECT, else rollout-hpc.")
    entity: str | None = Field(None, description="Default: $WANDB_ENTITY, else your default entity.")
    init_timeout_s: float = Field(60.0, gt=0, description="Give up on wandb.init after this long (one warning).")


class MLflowSection(_Section):
    tracking_uri: str | None = Field(
        None, description="Default: $MLFLOW_TRACKING_URI, else file:RUN_DIR/mlruns (a file store)."
    )
    experiment: str | None = Field(None, description="Experiment name (default: run.name).")


class LoggingSection(_Section):
    """Experiment trackers fed with the metrics the run writes to HDF5 (docs/trackers.md)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Any of tensorboard, wandb, mlflow (pip install 'rollout-hpc[trackers]')."
    )
    tensorboard: TensorBoardSection = Field(default_factory=TensorBoardSection)
    wandb: WandbSection = Field(default_factory=WandbSection)
    mlflow: MLflowSection = Field(default_factory=MLflowSection)


class ContainerSection(_Section):
    image: str
    runtime: Literal["pyxis", "apptainer"] = "pyxis"
    mounts: list[str] = Field(default_factory=list)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return _no_control(v, "slurm.container.image")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for item in v:
            _no_control(item, "slurm.container.mounts item")
        return v


class SlurmSection(_Section):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = Field("00:30:00", description="Time limit of each allocation (Slurm syntax).")
    constraint: str | None = None
    gpus_per_node: int = Field(8, ge=0, description="GPUs a node of this cluster has (validation bound).")
    signal_lead_seconds: int = Field(120, ge=10, description="--signal=B:USR1@N: warning before the time limit.")
    max_requeues: int = Field(10, ge=0)
    mpi: Literal["pmix", "pmix_v3", "pmix_v4", "pmi2", "none"] = "pmix"
    modules: list[str] = Field(default_factory=list, description="`module load` lines, in order.")
    container: ContainerSection | None = None
    extra_sbatch: list[str] = Field(
        default_factory=list, description="Extra '#SBATCH' options, e.g. '--mail-type=END'."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment exported in the job.")
    gpu_request: Literal["gpus-per-task", "gres"] = Field(
        "gpus-per-task",
        description="How GPUs are requested: --gpus-per-task=N, or --gres=gpu:N per node (older clusters).",
    )
    python: str | None = Field(
        None,
        description="Python interpreter on the compute nodes. Default: the one running `rollout-hpc submit` "
        "(right for a venv on a shared filesystem), or python3 inside a container.",
    )

    @field_validator("partition", "account", "qos")
    @classmethod
    def _names(cls, v: str | None, info) -> str | None:
        return _slurm_value(v, _SLURM_NAME, info.field_name, "'gpu', 'proj123' or 'normal'")

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        return _slurm_value(v, _SLURM_CONSTRAINT, "constraint", "'a100', 'a100&ib' or '[rack1|rack2]' (no spaces)")

    @field_validator("modules", "extra_sbatch")
    @classmethod
    def _lines_have_no_control_characters(cls, v: list[str], info) -> list[str]:
        for item in v:
            _no_control(item, f"slurm.{info.field_name} item")
        return v

    @field_validator("python")
    @classmethod
    def _python_path(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "slurm.python")

    @field_validator("time")
    @classmethod
    def _time_parses(cls, v: str) -> str:
        parse_slurm_time(v)
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _extra_are_options(cls, v: list[str]) -> list[str]:
        for line in v:
            if not _SBATCH_OPTION.fullmatch(line):
                raise ValueError(f"'{line}' is not an sbatch option; write it like '--mail-type=END'")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"'{name}' is not an environment variable name; use letters, digits and '_'")
            _no_control(v[name], f"slurm.env {name}")
        return v

    @property
    def time_seconds(self) -> int:
        return parse_slurm_time(self.time)


class Config(_Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    envs: EnvsSection = Field(default_factory=EnvsSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    generator: GeneratorSection = Field(default_factory=GeneratorSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    exchange: ExchangeSection = Field(default_factory=ExchangeSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    eval: EvalSection | None = Field(None, description="Validation during training (off when absent).")
    logging: LoggingSection = Field(default_factory=LoggingSection)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    launcher: Literal["auto", "slurm", "local"] = "auto"
    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: generator and trainer groups on nodes of their own (het job); colocated: both on "
        "the same node(s), taking turns, each using all of the node's cores in its phase (on-policy; on Slurm one "
        "job of one component, each node running its generator and trainer tasks).",
    )

    @model_validator(mode="after")
    def _feasible(self) -> Config:
        if self.placement == "colocated":
            self._check_colocated()
        if self.generator.extra_prompts:
            self._check_extra_prompts()
        a = self.algorithm
        if a.step_advantage_weight and ALGORITHMS[a.name].advantage not in GROUP_ESTIMATORS:
            raise ValueError(
                f"algorithm.step_advantage_weight compares the turns of one group's episodes, but algorithm "
                f"'{a.name}' has no groups (its advantage: {ALGORITHMS[a.name].advantage}); use grpo, dr_grpo, dapo or "
                "rloo, or set algorithm.step_advantage_weight: 0"
            )
        cap = self.slurm.gpus_per_node
        for name in ("generator", "trainer"):
            g: GroupSection = getattr(self, name)
            need = g.tasks_per_node * g.gpus_per_task
            if need > cap:
                raise ValueError(
                    f"{name}: tasks_per_node x gpus_per_task = {need} GPUs per node, but slurm.gpus_per_node is {cap}; "
                    f"lower {name}.tasks_per_node or {name}.gpus_per_task, or raise slurm.gpus_per_node"
                )
        envs = self.env_group
        if envs is not None and envs.ranks > self.generator.ranks:
            raise ValueError(
                f"envs: {envs.ranks} environment ranks (nodes x tasks_per_node) for {self.generator.ranks} generator "
                "rank(s); each generator rank steps its environments on one environment rank, so the rest would idle: "
                "lower envs.nodes / envs.tasks_per_node (use envs.workers for more processes per rank)"
            )
        if self.generator.backend == "vllm" and self.generator.gpus_per_task < 1:
            raise ValueError("generator.backend 'vllm' needs generator.gpus_per_task >= 1; use backend 'hf' on CPUs")
        if self.trainer.backend == "megatron" and self.trainer.gpus_per_task < 1:
            raise ValueError(
                "trainer.backend 'megatron' needs trainer.gpus_per_task >= 1; use 'torch' or 'deepspeed' on CPUs"
            )
        if self.trainer.backend == "megatron" and self.trainer.pipeline_parallel > 1:
            raise ValueError(
                "trainer.pipeline_parallel > 1 is not wired into the RL loop yet; set it to 1 and split the model with "
                "trainer.tensor_parallel (the remaining trainer ranks are data parallel)"
            )
        needs_critic = ALGORITHMS[self.algorithm.name].needs_critic
        critic_free = ", ".join(row.name for row in ALGORITHMS.values() if not row.needs_critic)
        if self.trainer.backend == "megatron" and needs_critic:
            raise ValueError(
                f"algorithm.name '{self.algorithm.name}' needs a critic, which trainer.backend 'megatron' does not "
                "have; use trainer.backend 'deepspeed' (zero_stage 3 shards policy and critic) or 'torch', or a "
                f"critic-free algorithm ({critic_free})"
            )
        if self.model.lora and self.trainer.backend == "megatron":
            raise ValueError(
                "model.lora is not supported by trainer.backend 'megatron'; use trainer.backend 'torch' or "
                "'deepspeed' for LoRA, or remove model.lora"
            )
        if self.model.lora and needs_critic:
            raise ValueError(
                f"model.lora with algorithm.name '{self.algorithm.name}': the critic cannot train LoRA adapters yet; "
                f"use a critic-free algorithm ({critic_free}) or remove model.lora"
            )
        if self.warmup.sft_steps and self.run.program == "train" and self.algorithm.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_coef > 0 with warmup.sft_steps: the KL reference would be the model before the warm-up; "
                "run the warm-up as its own run (run.program: sft) and start RL from it with model.init_from: RUN_DIR "
                "(the reference is then the warmed-up model), or set algorithm.kl_coef: 0"
            )
        row = ALGORITHMS[self.algorithm.name]
        if self.algorithm.group_size < row.min_group_size:
            raise ValueError(
                f"algorithm.group_size {self.algorithm.group_size} is too small for '{row.name}' ({row.advantage} "
                f"advantages compare samples of one prompt): set algorithm.group_size to at least {row.min_group_size} "
                "(4-16 is usual)"
            )
        if self.model.path is None and self.algorithm.max_new_tokens >= self.model.max_seq_len:
            raise ValueError(
                f"algorithm.max_new_tokens ({self.algorithm.max_new_tokens}) leaves no room for the prompt in the built-in "
                f"model's context of model.max_seq_len {self.model.max_seq_len}: raise model.max_seq_len or lower "
                "algorithm.max_new_tokens"
            )
        if self.run.program == "sft" and self.warmup.sft_steps == 0:
            raise ValueError("run.program 'sft' trains warmup.sft_steps steps; set warmup.sft_steps (e.g. 200)")
        if self.slurm.signal_lead_seconds >= self.slurm.time_seconds:
            raise ValueError(
                f"slurm.time ({self.slurm.time} = {self.slurm.time_seconds}s) must be longer than "
                f"slurm.signal_lead_seconds ({self.slurm.signal_lead_seconds}s), or the warning would come before the job starts"
            )
        return self

    @model_validator(mode="after")
    def _mixture_quotas(self) -> Config:
        """A mixed dataset: check its sources and write each one's per-step quota into it (the data layout of every
        step follows from the quotas: envs.datafile.QuotaLayout)."""
        train = self.task.sources()
        if train is None:
            return self
        if not train:
            raise ValueError(
                "task.params.train is an empty list; give one path, or a list of sources {name, path, weight}"
            )
        sources = _source_list(train, "task.params.train", TrainSource)
        val = self.task.params.get("val")
        if isinstance(val, list):
            known = {s.name for s in sources}
            for v in _source_list(val, "task.params.val", ValSource):
                if v.name not in known:
                    raise ValueError(
                        f"task.params.val source '{v.name}' is not a training source ({', '.join(sorted(known))}); "
                        "name each held-out file after the training source it belongs to"
                    )
        P = self.algorithm.prompts_per_step
        quotas = mixture_quotas([s.weight for s in sources], P)
        for s, q in zip(sources, quotas):
            if q < 1:
                raise ValueError(
                    f"task.params.train source '{s.name}' gets 0 of the {P} prompts of a step (weight {s.weight:g} of "
                    f"{sum(x.weight for x in sources):g}); raise its weight or algorithm.prompts_per_step"
                )
            if s.quota is not None and s.quota != q:
                raise ValueError(
                    f"task.params.train source '{s.name}': quota {s.quota} disagrees with its weight, which gives {q} "
                    f"of algorithm.prompts_per_step {P}; remove quota (it is derived)"
                )
        self.task.params["train"] = [{**s.model_dump(exclude_none=True), "quota": q} for s, q in zip(sources, quotas)]
        return self

    @model_validator(mode="after")
    def _reward_models(self) -> Config:
        """Where each reward model runs, and which sources it scores."""
        models = self.rewards.models
        if not models:
            if self.rewards.rule_weight == 0:
                raise ValueError("rewards.rule_weight is 0 and rewards.models is empty: nothing would score a sample")
            return self
        known = [s["name"] for s in self.task.sources() or []]
        grouped = [m for m in models if m.nodes > 0]
        for m in grouped[1:]:  # one het component hosts every model with nodes > 0: each of its ranks loads them all
            if (m.nodes, m.tasks_per_node) != (grouped[0].nodes, grouped[0].tasks_per_node):
                raise ValueError(
                    f"rewards.models {m.name}: nodes {m.nodes} x tasks_per_node {m.tasks_per_node}, but "
                    f"{grouped[0].name} has {grouped[0].nodes} x {grouped[0].tasks_per_node}; the models with nodes > 0 "
                    "share one reward group (each of its ranks loads them all): give them the same nodes and tasks_per_node"
                )
        if grouped and self.algorithm.dynamic_sampling:
            raise ValueError(
                f"algorithm.dynamic_sampling decides on refills from the rewards on the generator ranks, but "
                f"rewards.models {grouped[0].name} is scored in a reward group of its own (nodes {grouped[0].nodes}); "
                "set its nodes: 0, or turn dynamic_sampling off"
            )
        if grouped and self.placement == "colocated":
            raise ValueError(
                f"placement 'colocated' shares each node between a generator and a trainer; rewards.models "
                f"{grouped[0].name} asks for a reward group of its own (nodes {grouped[0].nodes}): set its nodes: 0, "
                "or use placement: disaggregated"
            )
        for m in models:
            if m.backend == "vllm" and m.kind != "judge":
                raise ValueError(
                    f"rewards.models {m.name}: backend 'vllm' serves judges (generation); a classifier scores with "
                    "backend: hf (one forward pass per batch)"
                )
            if m.backend == "vllm" and (m.nodes == 0 or self.rewards.group.gpus_per_task < 1):
                raise ValueError(
                    f"rewards.models {m.name}: backend 'vllm' runs its own engine on a GPU of its own: put it on the "
                    "reward group (nodes: 1 or more) with rewards.group.gpus_per_task >= 1, or use backend: hf"
                )
            for d in m.domains or []:
                if d not in known:
                    raise ValueError(
                        f"rewards.models {m.name}: domains names '{d}', which is not a source of task.params.train "
                        f"({', '.join(known) or 'the task has no named sources'}); leave domains out to score every sample"
                    )
        return self

    def _check_extra_prompts(self) -> None:
        extra, a = self.generator.extra_prompts, self.algorithm
        why = None
        if extra > a.prompts_per_step:
            why = (
                f"is more than algorithm.prompts_per_step ({a.prompts_per_step}): a step retries at most as many "
                "prompts as it trains; lower it"
            )
        elif self.exchange.max_staleness:
            why = (
                f"cuts the long tail of on-policy steps, but exchange.max_staleness is {self.exchange.max_staleness} "
                "(the tail already overlaps training there); set one of them to 0"
            )
        elif (a.dynamic_sampling or ALGORITHMS[a.name].dynamic_sampling) and self.rewards.models:
            why = (
                f"with dynamic sampling (algorithm {a.name}) drops uninformative groups as their rule rewards come in, "
                "but rewards.models' scores are mixed in later (normalized over the step by the trainers): set "
                "generator.extra_prompts: 0, or leave out rewards.models"
            )
        elif self.generator.backend != "hf":
            why = (
                f"aborts the slow groups inside the HF backend's sampling loop; backend '{self.generator.backend}' "
                "has no such abort yet: set generator.extra_prompts: 0"
            )
        if why:
            raise ValueError(f"generator.extra_prompts ({extra}) {why}")

    def _check_colocated(self) -> None:
        if self.exchange.max_staleness:
            raise ValueError(
                f"placement 'colocated' runs generation and training in turn on the same cores, so it is on-policy: "
                f"exchange.max_staleness is {self.exchange.max_staleness}; set it to 0, or use placement "
                "'disaggregated' to overlap them on separate nodes"
            )
        if self.generator.nodes != self.trainer.nodes:
            raise ValueError(
                f"placement 'colocated' puts the generator and the trainer on the same nodes, but generator.nodes is "
                f"{self.generator.nodes} and trainer.nodes {self.trainer.nodes}; make them equal"
            )
        if self.envs.nodes:
            raise ValueError(
                f"placement 'colocated' runs the generators and trainers of a node in one Slurm job of one component, "
                f"but envs.nodes is {self.envs.nodes} (an environment group is a het component of its own); set "
                "envs.nodes: 0 (environments in the generators' worker processes: envs.workers), or use placement "
                "'disaggregated'"
            )

    # --- derived facts used by the launchers and the runtime -----------------
    @property
    def total_steps(self) -> int:
        """Steps of the whole run: the SFT warm-up, then algorithm.steps of RL (none for run.program 'sft')."""
        return self.warmup.sft_steps + (0 if self.run.program == "sft" else self.algorithm.steps)

    @property
    def reward_group(self) -> GroupSection | None:
        """The reward group's layout and resources (the het component after the trainers), or None: every reward
        model (if any) is scored in the generator ranks."""
        grouped = [m for m in self.rewards.models if m.nodes > 0]
        if not grouped:
            return None
        return GroupSection(
            nodes=grouped[0].nodes, tasks_per_node=grouped[0].tasks_per_node, **self.rewards.group.model_dump()
        )

    @property
    def env_group(self) -> GroupSection | None:
        """The environment group's layout and resources (the het component after the trainers and the reward group),
        or None: each generator rank hosts its own environments (envs.nodes: 0)."""
        if not self.envs.nodes:
            return None
        resources = self.envs.model_dump(exclude={"workers", "nodes", "tasks_per_node"})
        return GroupSection(nodes=self.envs.nodes, tasks_per_node=self.envs.tasks_per_node, **resources)

    @property
    def het_groups(self) -> list[tuple[str, GroupSection, str]]:
        """(role, layout, the config key that sets its nodes) of every group of the run, in world-rank and het
        component order: generator, trainer, then the reward group and the environment group if the config has them."""
        out = [("generator", self.generator, "generator"), ("trainer", self.trainer, "trainer")]
        reward, env = self.reward_group, self.env_group
        if reward is not None:
            out.append(("reward", reward, "rewards.models[]"))
        if env is not None:
            out.append(("env", env, "envs"))
        return out

    @property
    def world_size(self) -> int:
        """Ranks of the MPI world: generators, then trainers, then the reward and environment groups (if any)."""
        return sum(group.ranks for _, group, _ in self.het_groups)

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """SHA-256 of the resolved config (stable key order); names a run's identity."""
        blob = json.dumps(self.resolved(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


# --- loading -----------------------------------------------------------------


def _key_lines(node: yaml.Node, prefix: tuple = ()) -> dict[tuple, int]:
    """Map each key path in a composed YAML tree to its 1-based line."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = prefix + (k.value,)
            lines[path] = k.start_mark.line + 1
            lines.update(_key_lines(v, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            path = prefix + (i,)
            lines[path] = v.start_mark.line + 1
            lines.update(_key_lines(v, path))
    return lines


def _key_path(key: str) -> list[str | int]:
    """'task.params.train[1].path' (or 'task.params.train.1.path') -> ['task', 'params', 'train', 1, 'path']."""
    path: list[str | int] = []
    for part in key.strip().split("."):
        for name, index in re.findall(r"([^\[\]]+)|\[(\d+)\]", part):
            path.append(int(index) if index else int(name) if name.isdigit() else name)
    return path


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """'a.b.c=value' -> (['a','b','c'], value parsed as YAML, so 3 is int and [x] a list); a list item is
    addressed by its index: 'task.params.train[1].path=...' (or 'train.1.path')."""
    if "=" not in text:
        raise ConfigError(f"--set '{text}': expected KEY.PATH=VALUE, e.g. --set algorithm.steps=5")
    key, _, raw = text.partition("=")
    path = _key_path(key)
    if not path:
        raise ConfigError(f"--set '{text}': the key is empty; write e.g. --set run.seed=3")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set '{text}': the value is not valid YAML ({exc})") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise ConfigError(f"--set '{text}': '{path[depth - 1]}' is not a list, so it has no item [{part}]")
                if not 0 <= part < len(node):
                    raise ConfigError(
                        f"--set '{text}': '{path[depth - 1]}' has {len(node)} item(s), so no item [{part}] "
                        f"(items count from 0)"
                    )
            elif not isinstance(node, dict):
                raise ConfigError(f"--set '{text}': '{path[depth - 1]}' is not a section, so it has no key '{part}'")
            if last:
                node[part] = value
            else:
                if isinstance(part, str) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return data


def _format_validation(exc: ValidationError, source: str, lines: dict[tuple, int], overridden: set[tuple]) -> str:
    out = [f"invalid config {source}:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc) or "(top level)"
        where = ""
        # The value came from --set when the error's field is, contains or lies inside an overridden key.
        if loc and any(loc[: len(o)] == o or o[: len(loc)] == loc for o in overridden):
            where = " (from --set)"
        else:
            for i in range(len(loc), 0, -1):
                if loc[:i] in lines:
                    where = f" (line {lines[loc[:i]]})"
                    break
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in loc[:-1]) or "the top level"
            msg = f"unknown key; remove it or check its spelling (see `rollout-hpc schema` for the keys of {parent})"
        elif err["type"] == "missing":
            msg = "required, but not given"
        out.append(f"  {field}{where}: {msg}")
    return "\n".join(out)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config. path None = all defaults (the quickstart)."""
    overrides = overrides or []
    lines: dict[tuple, int] = {}
    if path is None:
        data: Any = {}
        source = "(defaults)"
    else:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(
                f"config file {p} not found; pass the path of a YAML file such as configs/quickstart.yaml"
            )
        text = p.read_text()
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{p}: the top level must be a mapping of sections (run:, model:, ...), not a {type(data).__name__}"
            )
        if node is not None:
            lines = _key_lines(node)
    data = apply_overrides(data, overrides)
    overridden = {tuple(parse_override(o)[0]) for o in overrides}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source, lines, overridden)) from None


def json_schema() -> dict:
    return Config.model_json_schema()
