"""DeepSpeed trainer: ZeRO stages 0-3 over the trainer group.

On CPUs it runs with DS_ACCELERATOR=cpu and the gloo backend (DeepSpeed
JIT-builds a small shared-memory op with g++ the first time); on GPUs with
NCCL. torch.distributed is started from the MPI trainer group first, so
DeepSpeed finds it initialised and never looks for a launcher's environment.

Under ZeRO-3 the parameters are partitioned: `full_weights` gathers them
(collective over the group) so the weight sync can send whole tensors.

Checkpoints are independent of the ZeRO layout: each rank's shard holds the
whole (unpartitioned) fp32 master value and AdamW moments of every n-th
parameter, by name (parameter i on rank i % n), so no rank ever holds the whole
optimizer. Loading redistributes them parameter by parameter from whichever rank
read them, and each rank keeps the slice its own partition owns: a run resumes
on the same or a different number of trainer ranks and ZeRO stage, exactly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rollout_hpc.backends.optimizer import make_optimizer
from rollout_hpc.backends.trainer import EngineTrainer, init_torch_distributed
from rollout_hpc.errors import TrainerError
from rollout_hpc.store.rng import capture_rng_state, restore_rng_state


def deepspeed_config(cfg) -> dict:
    """The DeepSpeed JSON config built from the run config."""
    a, t = cfg.algorithm, cfg.trainer
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        # gather small tiny-model layers eagerly; keeps CPU runs from thrashing on many tiny all-gathers
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0})
    conf = {
        # we call forward/backward/step ourselves; micro-batches set the accumulation boundary explicitly
        # (Trainer.optimize: engine.set_gradient_accumulation_boundary), so DeepSpeed never rescales the loss
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": a.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16" and t.gpus_per_task > 0:
        conf["bf16"] = {"enabled": True}
    elif cfg.model.dtype == "float16" and t.gpus_per_task > 0:
        conf["fp16"] = {"enabled": True}
    return conf


def _ninja_on_path() -> None:
    """DeepSpeed JIT-builds its CPU communication op with ninja; the pip `ninja` package puts it next to
    the interpreter, which is not on PATH when a venv's python is run by full path (mpirun, srun)."""
    if shutil.which("ninja") is None:
        bindir = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(bindir, "ninja")):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


class DeepSpeedTrainer(EngineTrainer):
    def __init__(self, cfg, model: torch.nn.Module, world):
        on_gpu = cfg.trainer.gpus_per_task > 0 and torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            _ninja_on_path()
        try:
            import deepspeed  # in here: a heavy optional dependency, imported only when this backend is chosen
        except ImportError as exc:
            raise TrainerError(
                f"trainer.backend 'deepspeed' needs the deepspeed package ({exc}); pip install deepspeed, or use backend 'torch'"
            ) from None
        super().__init__(cfg, world)
        if on_gpu:
            torch.cuda.set_device(self.device)
        backend = "nccl" if on_gpu else "gloo"
        init_torch_distributed(world, backend)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        self._deepspeed = deepspeed
        self.stage = cfg.trainer.zero_stage
        a = cfg.algorithm
        model = model.to(self.device)
        optimizer = make_optimizer(model.parameters(), a)
        scoring = self._prepare_model(model)  # the engine's forward gives logits, values or chunked log-probs
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=scoring, optimizer=optimizer, config=deepspeed_config(cfg)
        )
        self.module = self.engine.module.model  # parameter names are the model's own

    def _zero_grad(self) -> None:
        pass  # engine.step() zeroes the gradients after each update

    def _micro_batch_context(self, last: bool):
        # Set before each forward/backward: ZeRO reduces (stage 2/3 partitions) per backward and steps only
        # at the boundary; gradient_accumulation_steps stays 1 so engine.backward never rescales the loss.
        self.engine.set_gradient_accumulation_boundary(last)
        return super()._micro_batch_context(last)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.backward(loss)

    def _step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()  # clips to gradient_clipping, steps, zeroes grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _param_groups(self) -> list[dict]:
        return self._base_optimizer().param_groups

    def _gathered(self, modifier_rank=None):
        """Context in which every parameter is whole (a no-op below ZeRO-3)."""
        if self.stage != 3:
            return contextlib.nullcontext()
        return self._deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank)

    def full_weights(self) -> dict[str, np.ndarray]:
        # Collective under ZeRO-3: every trainer rank must call it.
        with self._gathered():
            if self.lora:
                return self._lora_sync_weights(self.module)
            return {k: v.detach().float().cpu().numpy().copy() for k, v in self.module.state_dict().items()}

    def load_full_weights(self, weights: dict[str, np.ndarray] | None) -> None:
        """Set every parameter from group rank 0's `weights` (other ranks may pass None); with LoRA the
        adapters only (a checkpoint's weights). Collective."""
        with self._gathered(modifier_rank=0), torch.no_grad():
            tensors = self.module.state_dict(keep_vars=True)
            if self.lora:
                tensors = {name: t for name, t in tensors.items() if t.requires_grad}
            if self.world.group_rank == 0:
                assert weights is not None  # group rank 0 always passes them
                for name, tensor in tensors.items():
                    tensor.data.copy_(torch.as_tensor(np.asarray(weights[name])).to(tensor.dtype))
            if self.stage != 3:  # replicated parameters: rank 0's values everywhere
                for tensor in tensors.values():
                    dist.broadcast(tensor.data, src=0)
        if self.stage in (1, 2) and hasattr(self.engine.optimizer, "refresh_fp32_params"):
            # ZeRO-1/2 keep an fp32 master copy of each partition: refresh it from the new weights.
            self.engine.optimizer.refresh_fp32_params()

    sharded_checkpoint = True

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's shard: its share of the optimizer by parameter name (see the module doc), and on
        group rank 0 the full weights. Collective over the trainer group."""
        with self._gathered() if self.lora else contextlib.nullcontext():  # collective under ZeRO-3 (either way)
            weights = self._checkpoint_weights(self.module)
        state = {
            "optimizer": self._optimizer_share(),
            "zero_stage": self.stage,
            "n_ranks": self.world.group_size,
            "rng": capture_rng_state(),
            "steps_done": self.steps_done,
            "lr_schedule": self.lr_schedule_state(),
            **self._lora_state(),
        }
        if self.world.group_rank == 0:
            state["weights"] = weights
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Collective. `state["optimizer"]["params"]` may hold any parameters, as long as every one is held
        by some rank: after a change of trainer count the checkpointer gives each rank the union of the
        shards it read (runtime/checkpointing.py)."""
        if "optimizer" not in state:
            raise TrainerError(
                "the checkpoint's DeepSpeed state is an opaque per-rank optimizer blob (written by an older "
                "rollout-hpc); resume it with that version, or start a new run"
            )
        saved = f"ZeRO-{int(state['zero_stage'])} over {int(state['n_ranks'])} rank(s)"
        now = f"ZeRO-{self.stage} over {self.world.group_size} rank(s)"
        self.load_full_weights(state.get("weights"))
        self._load_optimizer_share(state["optimizer"])
        restore_rng_state(state["rng"])
        self.steps_done = int(state["steps_done"])
        if saved != now and self.world.group_rank == 0:
            print(f"rollout-hpc: resharded the DeepSpeed state: {saved} -> {now}", file=sys.stderr, flush=True)

    # --- the optimizer by parameter name -----------------------------------------------
    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW itself (ZeRO wraps it; its state is keyed by the flat fp32 partitions)."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    def _master_tensors(self) -> list[torch.Tensor]:
        """The tensors the AdamW steps: ZeRO's flat fp32 partitions of this rank, or the parameters themselves."""
        opt = self.engine.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            if getattr(opt, attr, None) is not None:
                return list(getattr(opt, attr))
        return [param for _, param in self._trained()]

    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the optimizer steps, by name (all of them; with LoRA the adapters)."""
        return [(name, param) for name, param in self.module.named_parameters() if param.requires_grad]

    def _adam_step(self) -> torch.Tensor | None:
        """AdamW's step count (the same for every tensor it steps); None before the first step."""
        state = self._base_optimizer().state
        for tensor in self._master_tensors():
            if "step" in state.get(tensor, {}):
                return torch.as_tensor(state[tensor]["step"]).clone()
        return None

    def _full(self, param, key: str) -> torch.Tensor:
        """The whole fp32 master value ("fp32") or AdamW moment of `param`. Collective under ZeRO."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # optional dependency

        if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # partitioned by ZeRO (or bf16's fp32 copy)
            return safe_get_full_fp32_param(param) if key == "fp32" else safe_get_full_optimizer_state(param, key)
        return param.data if key == "fp32" else self._base_optimizer().state[param][key]

    def _set_full(self, param, key: str, value: torch.Tensor) -> None:
        """Set this rank's part of `param`'s fp32 master value or AdamW moment from the whole `value`."""
        from deepspeed import utils as ds  # optional dependency

        if hasattr(param, "ds_id"):
            # ZeRO-3: rank r owns elements [r*k, (r+1)*k), zero-padded at the end. Its safe_set_full_* slices the
            # unpadded value and fails on the last rank when the parameter does not divide evenly: set the slice.
            k, me = param.partition_numel(), self.world.group_rank
            part = torch.zeros(k, dtype=torch.float32)
            mine = value.reshape(-1)[me * k : (me + 1) * k]
            part[: mine.numel()] = mine
            ds.safe_set_local_fp32_param(param, part) if key == "fp32" else ds.safe_set_local_optimizer_state(
                param, part, key
            )
        elif hasattr(param, "_hp_mapping"):  # ZeRO-1/2 (or bf16's fp32 copy): each rank copies its fragment
            ds.safe_set_full_fp32_param(param, value) if key == "fp32" else ds.safe_set_full_optimizer_state(
                param, value, key
            )
        else:
            target = param.data if key == "fp32" else self._base_optimizer().state[param][key]
            target.copy_(value.view_as(target))

    def _optimizer_share(self) -> dict[str, Any]:
        n, me = self.world.group_size, self.world.group_rank
        step = self._adam_step()
        keys = ("fp32",) if step is None else ("fp32", *ADAM_MOMENTS)
        params = {}
        for i, (name, param) in enumerate(self._trained()):
            whole = {key: self._full(param, key) for key in keys}  # every rank joins the gathers ...
            if i % n == me:  # ... and keeps every n-th parameter
                params[name] = {
                    key: t.detach().float().cpu().reshape(_shape(param)).clone() for key, t in whole.items()
                }
        # lr: what this engine ran with, for the record (a resume takes algorithm.lr / critic_lr from its config)
        share: dict[str, Any] = {"params": params, "lr": float(self._base_optimizer().param_groups[0]["lr"])}
        if step is not None:
            share["step"] = step
        return share

    def _load_optimizer_share(self, share: dict[str, Any]) -> None:
        comm = self.world.group_comm
        held = share.get("params", {})
        owner: dict[str, int] = {}
        for rank, names in enumerate(comm.allgather(sorted(held))):
            for name in names:
                owner.setdefault(name, rank)
        named = self._trained()
        missing = [name for name, _ in named if name not in owner]
        if missing or len(owner) != len(named):
            unknown = sorted(set(owner) - {name for name, _ in named})
            raise TrainerError(
                f"the checkpoint's optimizer state does not match this model (missing {missing[:3]}, "
                f"unknown {unknown[:3]}): resume with the model the checkpoint was written for"
            )
        keys: tuple[str, ...] = ("fp32",)
        if "step" in share:
            keys = ("fp32", *ADAM_MOMENTS)
            step = share["step"]
            base = self._base_optimizer()
            for tensor in self._master_tensors():  # a fresh engine has no AdamW state yet: make it, then fill it
                st = base.state[tensor]
                st["step"] = torch.as_tensor(step).clone()
                for key in ADAM_MOMENTS:
                    st[key] = torch.zeros_like(tensor)  # zero also in ZeRO's alignment padding, as after any step
            if hasattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
                self.engine.optimizer._hp_optimizer_states_linked = False
                self.engine.optimizer._lazy_init_hp_params_optimizer_state()  # ZeRO-1/2: views of the new state
        for name, param in named:
            numel = int(np.prod(_shape(param)))
            buf = np.empty((len(keys), numel), np.float32)
            if owner[name] == comm.Get_rank():
                for row, key in enumerate(keys):
                    buf[row] = torch.as_tensor(held[name][key]).reshape(-1).numpy()
            comm.Bcast(buf, root=owner[name])
            for row, key in enumerate(keys):
                self._set_full(param, key, torch.from_numpy(buf[row]).view(_shape(param)))


# AdamW's per-element state besides the fp32 master value.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _shape(param) -> tuple[int, ...]:
    """A parameter's full shape (ZeRO-3 leaves an empty placeholder in `param.shape`)."""
    return tuple(getattr(param, "ds_shape", param.shape))
