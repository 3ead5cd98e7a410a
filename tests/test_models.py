"""Built-in tiny model and tokenizers: determinism, round trips, clear load errors."""

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from rollout_hpc.config import ModelSection
from rollout_hpc.errors import TaskError
from rollout_hpc.models import (
    CharTokenizer,
    ModelLoadError,
    build_model,
    load_tokenizer,
    load_tokenizer_for_run,
    response_logprobs,
)
from rollout_hpc.models.logprobs import left_pad, right_pad

torch.set_num_threads(1)
TINY = ModelSection(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=32)


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "3+4=7\n#@$.*+ U D L R up down\tx"  # arithmetic, sokoban glyphs and actions
    ids = tok.encode(text.replace("\t", " "))
    assert tok.decode(ids) == text.replace("\t", " ")
    assert len(ids) == len(text)
    assert {tok.pad_id, tok.bos_id, tok.eos_id}.isdisjoint(ids)
    assert max(ids) < tok.vocab_size
    # special tokens are dropped on decode; the prompt starts with BOS
    assert tok.decode([tok.bos_id] + tok.encode("12") + [tok.eos_id, tok.pad_id]) == "12"
    assert tok.encode_prompt("1+1=")[0] == tok.bos_id
    with pytest.raises(TaskError, match="model.path"):  # a UserError: one line, no traceback
        tok.encode("café")


def test_tiny_model_is_deterministic_given_seed():
    vocab = CharTokenizer().vocab_size
    a, b = build_model(TINY, vocab, seed=3), build_model(TINY, vocab, seed=3)
    c = build_model(TINY, vocab, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    # the global RNG is left alone
    torch.manual_seed(0)
    x = torch.rand(1)
    torch.manual_seed(0)
    build_model(TINY, vocab, seed=5)
    assert torch.equal(torch.rand(1), x)
    cfg = a.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size) == (32, 1, 2, vocab)
    assert build_model(TINY.model_copy(update={"dtype": "bfloat16"}), vocab).dtype == torch.bfloat16


def test_hf_directory_round_trip_and_errors(tmp_path):
    vocab = CharTokenizer().vocab_size
    model = build_model(TINY, vocab, seed=1)
    model.save_pretrained(tmp_path / "m")
    loaded = build_model(ModelSection(path=str(tmp_path / "m")), vocab)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)

    with pytest.raises(ModelLoadError, match="not a directory"):
        build_model(ModelSection(path=str(tmp_path / "missing")), vocab)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        build_model(ModelSection(path=str(tmp_path / "empty")), vocab)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "nonsense-model"}')
    with pytest.raises(ModelLoadError, match="could not load"):
        build_model(ModelSection(path=str(tmp_path / "bad")), vocab)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(ModelSection(path=str(tmp_path / "m")))  # weights but no tokenizer files


def test_load_tokenizer_for_run(tmp_path):
    (tmp_path / "config.resolved.yaml").write_text(yaml.safe_dump({"model": TINY.model_dump(mode="json")}))
    tok = load_tokenizer_for_run(tmp_path)
    assert tok.decode(tok.encode("2+2=4")) == "2+2=4"
    with pytest.raises(FileNotFoundError, match="config.resolved.yaml"):
        load_tokenizer_for_run(tmp_path / "nope")


def test_response_logprobs_match_single_sequence_forward():
    tok = CharTokenizer()
    model = build_model(TINY, tok.vocab_size, seed=2).eval()
    prompts = [tok.encode_prompt("1+2="), tok.encode_prompt("12+3=")]
    responses = [tok.encode("3") + [tok.eos_id], tok.encode("15") + [tok.eos_id]]
    with torch.no_grad():
        scores = response_logprobs(model, prompts, responses, tok.pad_id, with_entropy=True)
        assert scores.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            expect = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(scores.logprobs[i, : len(r)], expect, atol=1e-5, rtol=0)
        assert (scores.entropy[scores.mask.bool()] > 0).all() and scores.logprobs[0, 2] == 0


def test_critic_values_per_token_and_trainable():
    from rollout_hpc.algos import value_loss
    from rollout_hpc.models import build_critic

    critic = build_critic(TINY, CharTokenizer().vocab_size, seed=0)
    ids = torch.tensor([[1, 10, 11, 12], [1, 13, 14, 15]])
    values = critic(ids)
    assert values.shape == (2, 4) and torch.count_nonzero(values) == 0  # zero-initialised head
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    returns = torch.ones(2, 4)
    mask = torch.ones(2, 4)
    first, _ = value_loss(values, values.detach(), returns, mask, clip_eps_value=10.0)
    for _ in range(5):
        v = critic(ids)
        loss, _ = value_loss(v, v.detach(), returns, mask, clip_eps_value=10.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first.item()  # 0.5 * (0 - 1)^2 = 0.5 at the start, and falling


def test_char_tokenizer_as_a_pretrained_fast_tokenizer_has_the_same_ids(tmp_path):
    import random

    from transformers import AutoTokenizer, LlamaConfig

    from rollout_hpc.models.tokenizer import save_pretrained_tokenizer

    tok = CharTokenizer()
    fast = tok.to_pretrained_tokenizer(model_max_length=32)
    assert len(fast) == tok.vocab_size == 99
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    rng = random.Random(0)
    alphabet = CharTokenizer.CHARS + "  \n"
    texts = ["", " ", "\n\n", "  a  b ", "3+4=7\n#@$.*+ U D L R"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(300)]
    texts = [t for t in texts if "<s>" not in t and "</s>" not in t and "<pad>" not in t]
    for text in texts:
        ids = tok.encode(text)
        assert fast.encode(text, add_special_tokens=False) == ids
        assert fast.encode(text) == tok.encode_prompt(text)  # BOS for a single sequence
        full = [tok.bos_id] + ids + [tok.eos_id, tok.pad_id]
        assert fast.decode(full, skip_special_tokens=True) == tok.decode(full) == text
        assert (
            fast.decode(full, skip_special_tokens=False)
            == tok.decode(full, skip_special=False)
            == f"<s>{text}</s><pad>"
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? <s> not a marker"}]
    assert fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == tok.render_chat(messages)
    assert fast.encode(tok.render_chat(messages), add_special_tokens=False) == tok.encode_chat(messages)

    # Saved beside a Llama config.json, AutoTokenizer must load this pipeline, not the Llama tokenizer
    # (which would drop the spaces): tokenizer_config.json names PreTrainedTokenizerFast.
    LlamaConfig(
        vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path)
    save_pretrained_tokenizer(fast, tmp_path)
    assert '"tokenizer_class": "PreTrainedTokenizerFast"' in (tmp_path / "tokenizer_config.json").read_text()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert "Llama" not in type(loaded).__name__ and loaded.model_max_length == 32
    for text in texts[:50] + ["<s>user: hi</s>"]:
        assert loaded.decode(loaded.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert loaded.chat_template == tok.chat_template


def test_char_tokenizer_decode_types_and_errors():
    import numpy as np

    tok = CharTokenizer()
    ids = tok.encode("12 + 3")
    assert tok.decode(np.array(ids, np.int32)) == tok.decode(torch.tensor(ids)) == tok.decode(tuple(ids)) == "12 + 3"
    assert tok.decode([]) == ""
    with pytest.raises(IndexError, match="outside"):
        tok.decode([5, tok.vocab_size])
    assert tok.encode("<s>") == [tok.encode("<")[0], tok.encode("s")[0], tok.encode(">")[0]]  # encode is literal


def test_bfloat16_model_keeps_rotary_buffers_in_float32_like_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model(TINY.model_copy(update={"dtype": "bfloat16"}), CharTokenizer().vocab_size, seed=1).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    assert {b.dtype for _, b in model.named_buffers()} == {torch.float32}
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1] + list(range(5, 30))])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@given(
    st.lists(st.lists(st.integers(0, 1000), max_size=9), max_size=12),
    st.sampled_from([torch.long, torch.float32]),
)
def test_padding_puts_each_row_in_its_own_columns(seqs, dtype):
    """left_pad / right_pad against the obvious row-by-row construction (empty rows and batches too)."""
    width = max((len(s) for s in seqs), default=0)
    for pad, left in ((left_pad, True), (lambda s, v: right_pad(s, v, dtype=dtype), False)):
        out, mask = pad(seqs, 7)
        assert out.shape == mask.shape == (len(seqs), width)
        for i, s in enumerate(seqs):
            lo = width - len(s) if left else 0
            row = [7] * width
            row[lo : lo + len(s)] = s
            assert out[i].tolist() == row
            assert mask[i].tolist() == [int(lo <= j < lo + len(s)) for j in range(width)]
