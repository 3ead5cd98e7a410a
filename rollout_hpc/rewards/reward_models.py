"""Learned rewards: a sequence classifier or an LLM judge scoring (question, response) pairs in batches.

`load_reward_model(spec)` reads a local Hugging Face directory named by one entry of `rewards.models`
(config.RewardModelSpec) and returns an object with `score(questions, responses, answers) -> float64 [B]`:

- classifier: `AutoModelForSequenceClassification`; the conversation (the question's messages, then the response as
  the assistant turn) goes through the model's chat template when it has one; the score is the logit of a one-label
  head, or the probability of `positive_label` (default: the last label) of a several-label head.
- judge: a causal LM prompted with `template` ({question}, {response}, {answer}); its greedy reply is parsed with
  `pattern` (first group, a number); a reply that does not parse scores NaN, which the caller counts as a parse
  failure and replaces by `parse_failure_score` (rewards/mixing.py).

Batches of `batch_size`; inputs longer than `max_length` tokens lose their start (the response's end is what a
reward model judges). Where the generator ranks have a GPU, the model runs on it. Imports torch and transformers on
first use (this package stays light for the reward worker processes).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollout_hpc.errors import RewardError, import_vllm

DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from 0 (wrong or useless) to 10 (correct and complete).\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Response: {response}\n"
    "Reply with the rating only, as \\boxed{{N}}."
)


class RewardModelError(RewardError):
    """A rewards.models entry whose directory cannot be used as its kind says; the message names the entry and fix."""


def parse_score(pattern: re.Pattern, reply: str) -> float:
    """The number in `pattern`'s first group of the reply's first match; NaN when nothing matches or it is no finite
    number (a parse failure)."""
    m = pattern.search(reply)
    if m is None:
        return math.nan
    try:
        value = float(m.group(1))
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def fill_template(template: str, question: str, response: str, answer: str) -> str:
    """The judge's prompt: {question}, {response}, {answer} replaced; every other brace kept as written (a template
    asking for \\boxed{N} needs no escaping). {{ and }} still read as one brace, as in str.format."""
    out = template
    for key in ("question", "answer", "response"):
        out = out.replace("{" + key + "}", "\0" + key + "\0")
    out = out.replace("{{", "{").replace("}}", "}")
    for key, value in (("question", question), ("answer", answer), ("response", response)):
        out = out.replace("\0" + key + "\0", value)
    return out


def _architectures(spec) -> list[str]:
    path = Path(spec.path)
    where = f"rewards.models {spec.name}: path {spec.path}"
    if not path.is_dir():
        raise RewardModelError(f"{where} is not a directory; give a local Hugging Face model directory")
    config = path / "config.json"
    if not config.is_file():
        raise RewardModelError(f"{where} has no config.json; save the model there with save_pretrained()")
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError) as exc:
        raise RewardModelError(f"{where}: config.json cannot be read: {exc}") from None


def check_reward_model(spec) -> None:
    """What `validate` and `submit` check without loading weights: a directory whose config's architecture fits
    the kind. Raises RewardModelError naming the entry and the fix."""
    arch = _architectures(spec)
    where = f"rewards.models {spec.name} ({spec.path})"
    if spec.kind == "classifier" and arch and not any(a.endswith("ForSequenceClassification") for a in arch):
        raise RewardModelError(
            f"{where}: kind 'classifier' needs a sequence-classification model (its config names {', '.join(arch)}); "
            "save an AutoModelForSequenceClassification, or use kind: judge for a causal LM"
        )
    if spec.kind == "judge" and arch and not any(a.endswith("ForCausalLM") for a in arch):
        raise RewardModelError(
            f"{where}: kind 'judge' needs a causal LM (its config names {', '.join(arch)}); "
            "use kind: classifier for a sequence-classification model"
        )


class _HFRewardModel:
    """What both kinds share: the tokenizer, the device, the chat template, batching."""

    padding_side = "right"

    def __init__(self, spec, auto_class: str, device: str | None = None):
        import torch  # heavy: only where a reward model is used
        import transformers

        check_reward_model(spec)
        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the ranks' logs
        self.spec, self.name, self.torch = spec, spec.name, torch
        where = f"rewards.models {spec.name} ({spec.path})"
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(spec.path)
            self.model = getattr(transformers, auto_class).from_pretrained(spec.path)
        except (OSError, ValueError) as exc:
            raise RewardModelError(f"{where} cannot be loaded with transformers.{auto_class}: {exc}") from None
        tok = self.tokenizer
        if tok.pad_token_id is None:
            if tok.eos_token_id is None:
                raise RewardModelError(f"{where}: its tokenizer has neither a pad nor an EOS token; set pad_token")
            tok.pad_token = tok.eos_token
        tok.truncation_side = "left"  # the response's end is what is judged
        tok.padding_side = self.padding_side
        self.model.config.pad_token_id = tok.pad_token_id
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(spec.max_length, positions) if positions else spec.max_length  # what it can read
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device).eval()
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def _encode(self, texts: list[str]):
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not self.has_chat_template,  # a chat template writes its own
        )
        return {k: v.to(self.device) for k, v in enc.items()}

    def score(self, questions: Sequence, responses: Sequence[str], answers: Sequence[Any]) -> np.ndarray:
        """float64 [B] (a judge's unparsable reply: NaN); in batches of samples of similar length (padding to the
        longest of a batch of long-tailed lengths would cost more than the short ones' work): padded_batches."""
        out = np.zeros(len(responses), np.float64)
        size = [len(_question_text(q)) + len(r) for q, r in zip(questions, responses)]
        with self.torch.inference_mode():
            for rows in padded_batches(size, self.spec.batch_size):
                out[rows] = self._score_batch(
                    [questions[i] for i in rows], [responses[i] for i in rows], [answers[i] for i in rows]
                )
        return out

    def _score_batch(self, questions: list, responses: list[str], answers: list) -> np.ndarray:
        raise NotImplementedError


PADDING_LIMIT = 1.25  # a batch's padded work (rows x its longest) at most this times its real work


def padded_batches(sizes: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Row indices in batches of at most batch_size rows, shortest first, each closed before padding its rows to the
    longest would cost more than PADDING_LIMIT x their own lengths. Deterministic in `sizes` alone."""
    order = np.argsort(np.asarray(sizes), kind="stable")
    batches: list[list[int]] = []
    total = 0
    for i in order:
        n = max(int(sizes[i]), 1)
        rows = batches[-1] if batches else None
        if rows is None or len(rows) >= batch_size or n * (len(rows) + 1) > PADDING_LIMIT * (total + n):
            batches.append([int(i)])
            total = n
        else:
            rows.append(int(i))
            total += n
    return [np.asarray(b, np.int64) for b in batches]


def _messages(question) -> list[dict]:
    """A question as chat messages: a list of {role, content} as it is, a string as one user turn."""
    if isinstance(question, list):
        return list(question)
    return [{"role": "user", "content": str(question)}]


def _question_text(question) -> str:
    if isinstance(question, list):
        return "\n".join(str(m.get("content", "")) for m in question)
    return str(question)


class ClassifierRewardModel(_HFRewardModel):
    def __init__(self, spec, device: str | None = None):
        super().__init__(spec, "AutoModelForSequenceClassification", device)
        labels = int(self.model.config.num_labels)
        label = spec.positive_label if spec.positive_label is not None else labels - 1
        if labels > 1 and not 0 <= label < labels:
            raise RewardModelError(
                f"rewards.models {spec.name}: positive_label {label} is not a label of its {labels}-label head"
            )
        self.labels, self.label = labels, label

    def conversation(self, question, response: str) -> str:
        if self.has_chat_template:
            chat = _messages(question) + [{"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(chat, tokenize=False))
        return f"{_question_text(question)}\n{response}"

    def _score_batch(self, questions: list, responses: list[str], answers: list) -> np.ndarray:
        enc = self._encode([self.conversation(q, r) for q, r in zip(questions, responses)])
        logits = self.model(**enc).logits.float()
        if self.labels == 1:
            return logits[:, 0].cpu().numpy().astype(np.float64)
        return self.torch.softmax(logits, dim=-1)[:, self.label].cpu().numpy().astype(np.float64)


def judge_prompt(tokenizer, template: str, question, response: str, answer) -> str:
    """The judge's input: the template filled in, through the tokenizer's chat template (with the generation prompt)
    when it has one."""
    text = fill_template(template, _question_text(question), response, "" if answer is None else str(answer))
    if getattr(tokenizer, "chat_template", None):
        return str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        )
    return text


class JudgeRewardModel(_HFRewardModel):
    padding_side = "left"  # generation continues every row from its last token

    def __init__(self, spec, device: str | None = None):
        super().__init__(spec, "AutoModelForCausalLM", device)
        self.template = spec.template or DEFAULT_JUDGE_TEMPLATE
        self.pattern = re.compile(spec.pattern)
        self.last_replies: list[str] = []  # the last batch's replies (tests, debugging a pattern)

    def prompt(self, question, response: str, answer) -> str:
        return judge_prompt(self.tokenizer, self.template, question, response, answer)

    def _score_batch(self, questions: list, responses: list[str], answers: list) -> np.ndarray:
        enc = self._encode([self.prompt(q, r, a) for q, r, a in zip(questions, responses, answers)])
        out = self.model.generate(
            **enc,
            max_new_tokens=self.spec.max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        replies = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        self.last_replies = replies
        return np.array([parse_score(self.pattern, r) for r in replies], np.float64)


class VLLMJudge:
    """A judge served by vLLM (backend vllm, on a reward rank's own GPU): the same prompt, greedy reply and parsing as
    JudgeRewardModel; vLLM schedules the whole call itself (continuous batching), so batch_size does not apply."""

    def __init__(self, spec, gpu_memory_utilization: float = 0.85):
        vllm = import_vllm(f"rewards.models {spec.name}: backend 'vllm'")
        import transformers

        check_reward_model(spec)
        self.spec, self.name = spec, spec.name
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(spec.path)
        self.tokenizer.truncation_side = "left"  # the response's end is what is judged
        self.template = spec.template or DEFAULT_JUDGE_TEMPLATE
        self.pattern = re.compile(spec.pattern)
        self.llm = vllm.LLM(
            model=spec.path,
            dtype="auto",
            seed=0,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=spec.max_length + spec.max_new_tokens,
        )
        self.params = vllm.SamplingParams(temperature=0.0, max_tokens=spec.max_new_tokens)
        self.last_replies: list[str] = []

    def score(self, questions: Sequence, responses: Sequence[str], answers: Sequence[Any]) -> np.ndarray:
        texts = [judge_prompt(self.tokenizer, self.template, q, r, a) for q, r, a in zip(questions, responses, answers)]
        ids = self.tokenizer(texts, truncation=True, max_length=self.spec.max_length, add_special_tokens=False)[
            "input_ids"
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(x)} for x in ids], self.params, use_tqdm=False)
        self.last_replies = [o.outputs[0].text for o in outputs]
        return np.array([parse_score(self.pattern, r) for r in self.last_replies], np.float64)


def load_reward_model(spec, device: str | None = None):
    """The reward model of one rewards.models entry: a classifier or a judge on transformers (backend hf), or a judge
    on vLLM (backend vllm)."""
    if spec.backend == "vllm":
        return VLLMJudge(spec)
    if spec.kind == "classifier":
        return ClassifierRewardModel(spec, device)
    return JudgeRewardModel(spec, device)
