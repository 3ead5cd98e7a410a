"""Generator backend on vLLM (generator.backend 'vllm'): one LLM engine per generator rank,
tensor-parallel over generator.tensor_parallel GPUs, same interface as HFGenerator.

vLLM is imported only when this backend is built, so CPU-only installs never need it.
Sampling log-probabilities come from vLLM with logprobs_mode "processed_logprobs" (after
temperature and top-p, the distribution sampled from, as in generate_hf) where the installed
vLLM supports it; older versions return the raw model log-probabilities (documented in the
metric `logprobs_mode`). Prompts and responses are token ids (skip_tokenizer_init), so the
built-in character tokenizer works too: the tiny model is saved to a temporary directory first.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from rollout_hpc.errors import VLLMUnavailable, import_vllm, vllm_needs  # noqa: F401 (re-exported)

from .generator import Generation, Generator, SamplingParams, cut_at_stop_strings

NEEDS = vllm_needs("generator.backend 'vllm'")


def _load_weights_on_worker(worker, weights: list[tuple[str, Any]]) -> None:
    """Runs inside each vLLM worker (collective_rpc): copy the new weights into its shard."""
    worker.model_runner.model.load_weights(weights=[(k, torch.as_tensor(v)) for k, v in weights])


class VLLMGenerator(Generator):
    def __init__(
        self,
        model_cfg,
        tokenizer,
        task,
        sampling: SamplingParams,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        model=None,
    ) -> None:
        # Weight updates call a function of ours in vLLM's workers (collective_rpc); recent vLLM only pickles a
        # function across its own engine processes (all on this node, this rank's children) when this is set.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        vllm = import_vllm()
        self.tokenizer, self.task, self.sampling, self.seed = tokenizer, task, sampling, seed
        self._vllm = vllm
        path = model_cfg.path
        if path is None:
            # The built-in tiny model exists only in memory: give vLLM a directory to load it from.
            if model is None:
                raise ValueError("the built-in tiny model needs model=<the built policy> for the vLLM backend")
            self._tmp = tempfile.TemporaryDirectory(prefix="rollout-hpc-vllm-")
            model.save_pretrained(self._tmp.name)
            path = self._tmp.name
        self.max_context = model_cfg.max_seq_len if model_cfg.path is None else None
        kwargs = dict(
            model=path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=model_cfg.dtype,
            seed=seed,
            skip_tokenizer_init=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=True,
        )
        try:
            self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            self.logprobs_mode = "processed_logprobs"
        except TypeError:  # vLLM before logprobs_mode: raw log-probabilities of the model
            self.llm = vllm.LLM(**kwargs)
            self.logprobs_mode = "raw_logprobs"
        if self.max_context is None:
            self.max_context = self.llm.llm_engine.model_config.max_model_len

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams | None = None,
        cache_keys=None,
        watch=None,
    ) -> Generation:
        # cache_keys: ignored; the engine's own prefix caching (enable_prefix_caching) serves an episode's turns
        if watch is not None:  # config refuses generator.extra_prompts with this backend
            raise NotImplementedError("the vLLM backend cannot abort a generation midway (generator.extra_prompts)")
        vllm = self._vllm
        s = params or self.sampling
        # Stop strings need text, and the engine has no tokenizer (skip_tokenizer_init): responses are cut after
        # generation (cut_at_stop_strings), the same cut the HF backend makes.
        per_prompt = [
            vllm.SamplingParams(
                temperature=0.0 if s.greedy else s.temperature,
                top_p=1.0 if s.greedy else s.top_p,
                max_tokens=s.max_new_tokens,
                stop_token_ids=list(s.stop_ids),
                logprobs=1,
                seed=seed % (1 << 63),
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], per_prompt, use_tqdm=False)
        responses, logprobs, truncated = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            # logprobs[j] maps candidate token ids to Logprob objects; the sampled token is always present.
            lps = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs)]
            responses.append(ids)
            logprobs.append(lps)
            truncated.append(completion.finish_reason == "length")
        return cut_at_stop_strings(Generation(responses, logprobs, truncated), self.tokenizer, s.stop)

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Update the engine's weights in place from {name: array} (Hugging Face names; vLLM's
        load_weights maps and shards them, fusing q/k/v and gate/up projections itself)."""
        items = list(weights.items())
        if hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
        else:  # older single-process engines
            runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
            _load_weights_on_worker(type("W", (), {"model_runner": runner}), items)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
