"""Prompts as the model sees them: chat templates (a tokenizer's own, a .jinja file, the built-in one), BOS exactly
once, the stop ids of generation_config.json, stop strings and greedy decoding in the HF generator. Real tokenizers
and tiny models saved to disk (tests/tiny_hf.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_hf import make_tiny_qwen
from transformers import AutoTokenizer

from rollout_hpc.backends.generate_hf import Generation, RowStreams, SamplingParams, cut_at_stop_strings, generate
from rollout_hpc.config import AlgorithmSection, ModelSection, TaskSection
from rollout_hpc.envs import load_task
from rollout_hpc.envs.base import Prompt
from rollout_hpc.models import build_model, load_tokenizer
from rollout_hpc.models.prompting import encode_prompt_item
from rollout_hpc.models.tokenizer import CharTokenizer

CHAT = (Prompt("2+2?", messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})),)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_tiny_qwen(tmp_path_factory.mktemp("m") / "qwen")


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    """A tokenizer with a BOS token whose chat template writes the BOS itself (as Llama 3's does)."""
    return make_tiny_qwen(tmp_path_factory.mktemp("m") / "bos", bos=True)


def test_chat_prompt_is_the_templates_text_with_the_assistant_turn_opened(qwen):
    tok = load_tokenizer(ModelSection(path=str(qwen)))
    ids = encode_prompt_item(tok, CHAT[0])
    reference = AutoTokenizer.from_pretrained(qwen).apply_chat_template(
        [dict(m) for m in CHAT[0].messages], add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(ids, skip_special=False) == reference
    assert reference.endswith("<|im_start|>assistant\n")
    # none: raw text of the turns, no template markers
    raw = tok.decode(encode_prompt_item(tok, CHAT[0], "none"), skip_special=False)
    assert raw == "Be brief.\n2+2?"


def test_a_template_that_writes_bos_gets_exactly_one(llama3_style):
    tok = load_tokenizer(ModelSection(path=str(llama3_style)))
    ids = encode_prompt_item(tok, CHAT[0])
    assert tok.bos_id is not None and ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_a_jinja_file_replaces_the_template(tmp_path, qwen):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "hi there", "answer": "x"}) + "\n")
    task = load_task(
        TaskSection(
            name="dataset",
            reward="exact",
            params={"train": str(tmp_path / "d.jsonl"), "chat_template": str(template), "system_prompt": "Answer."},
        )
    )
    item = task.prompts(0)[0]
    tok = load_tokenizer(ModelSection(path=str(qwen)))
    text = tok.decode(encode_prompt_item(tok, item, task.chat_template), skip_special=False)
    assert text == "[system] Answer.\n[user] hi there\n[assistant] "
    with pytest.raises(Exception, match="chat_template"):
        load_task(
            TaskSection(
                name="dataset",
                reward="exact",
                params={"train": str(tmp_path / "d.jsonl"), "chat_template": str(tmp_path / "nope.jinja")},
            )
        )


def test_built_in_tokenizer_has_a_template_of_its_own():
    tok = CharTokenizer()
    ids = encode_prompt_item(tok, CHAT[0])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids, skip_special=False) == "<s>system: Be brief.\nuser: 2+2?\nassistant: "
    # plain-text prompts (the built-in tasks) keep BOS + text
    assert encode_prompt_item(tok, Prompt("3+4=")) == [tok.bos_id] + tok.encode("3+4=")


def test_generation_config_stop_ids_end_responses(qwen):
    tok = load_tokenizer(ModelSection(path=str(qwen)))
    im_end, endoftext = (tok._tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert set(tok.stop_ids) == {im_end, endoftext}
    params = SamplingParams.from_config(AlgorithmSection(max_new_tokens=6), tok)
    assert set(params.stop_ids) == {im_end, endoftext}
    # A model that always prefers <|endoftext|> (the second stop id, not the tokenizer's eos) stops at once.
    model = build_model(ModelSection(path=str(qwen)), tok.vocab_size)
    head = torch.nn.Linear(model.config.hidden_size, tok.vocab_size)  # untied, logits = bias only
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(0.0)
        head.bias[endoftext] = 20.0
    model.lm_head = head
    out = generate(model, [tok.encode_prompt("hi")], params, tok.pad_id, torch.Generator().manual_seed(0))
    assert out.response_ids[0][-1] == endoftext and len(out.response_ids[0]) < 6 and out.truncated == [False]


def test_stop_strings_cut_the_response_after_the_completing_token():
    tok = CharTokenizer()
    gen = Generation([tok.encode("12 </a> xx"), tok.encode("no stop")], [[0.1] * 10, [0.2] * 7], [True, True])
    cut = cut_at_stop_strings(gen, tok, ["</a>"])
    assert tok.decode(cut.response_ids[0]) == "12 </a>" and cut.logprobs[0] == [0.1] * 7 and cut.truncated[0] is False
    assert tok.decode(cut.response_ids[1]) == "no stop" and cut.truncated[1] is True


def test_stop_strings_and_greedy_in_the_sampling_loop():
    from rollout_hpc.models import tiny_config

    tok = CharTokenizer()
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config(ModelSection(), tok.vocab_size)).eval()
    prompts = [tok.encode_prompt("1+1=")] * 3
    free = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=12, stop_ids=(tok.eos_id,)),
        tok.pad_id,
        RowStreams(range(3)),
    )
    # pick a character the free run produced and make it a stop string: the response must end right after it
    target = next(c for ids in free.response_ids for c in tok.decode(ids) if c.strip())
    params = SamplingParams(max_new_tokens=12, stop_ids=(tok.eos_id,), stop=(target,))
    stopped = generate(model, prompts, params, tok.pad_id, RowStreams(range(3)), stop_text=tok.decode)
    for full, cut in zip(free.response_ids, stopped.response_ids):
        text = tok.decode(full)
        if target in text:
            assert tok.decode(cut).endswith(target) and target not in tok.decode(cut)[:-1]
    greedy = SamplingParams(max_new_tokens=5, greedy=True)
    a = generate(model, prompts, greedy, tok.pad_id, RowStreams(range(3)))
    assert a.response_ids[0] == a.response_ids[1] == a.response_ids[2]  # argmax: seeds do not matter
    logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    assert a.response_ids[0][0] == int(logits.argmax())
