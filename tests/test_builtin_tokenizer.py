"""The built-in tokenizer as a Hugging Face tokenizer, and the built-in model and tokenizer as a Hugging Face model
directory (models.build.save_builtin_model): the ranks' tokenizer (load_tokenizer: a PreTrainedTokenizerFast) and
the saved directory loaded back through the Hugging Face path (model.path: AutoTokenizer, AutoModelForCausalLM),
in this process and in a fresh one with transformers only, give CharTokenizer's ids and the built-in model's
logits."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rollout_hpc.config import ModelSection
from rollout_hpc.errors import UserError
from rollout_hpc.models import CharTokenizer, HFTokenizer, build_model, load_tokenizer
from rollout_hpc.models.build import save_builtin_model

torch.set_num_threads(1)
TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32}
TEXTS = [
    "",
    " ",
    "  two  spaces ",
    "a\nb\n\n c\n",
    "0123456789 23+45=68 -7*3",
    "#@$.*+ U D L R",
    "".join(chr(c) for c in range(32, 127)),  # every printable ASCII character
    "<s>user: hi</s>\nassistant: <pad>",  # the chat markers: special tokens in text given to the HF tokenizer
]
UNICODE = ["café", "naïve 2×3", "emoji 🙂", "tab\there"]  # outside the built-in vocabulary (ASCII + newline)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\nAnd 3+3?"}]

# A fresh interpreter with transformers only: what any other tool sees in the directory. Prints one JSON object.
FRESH = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, texts, unicode, messages = sys.argv[1], *map(json.loads, sys.argv[2:5])
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d).eval()
ids = [tok.encode(t, add_special_tokens=False) for t in texts]
refused = []
for text in unicode:
    try:
        tok.encode(text, add_special_tokens=False)
    except Exception as exc:
        refused.append(str(exc))
with torch.no_grad():
    logits = model(torch.tensor([tok.encode(texts[4])])).logits[0]
print(json.dumps({
    "rollout_hpc_imported": any(m.startswith("rollout_hpc") for m in sys.modules),
    "tokenizer_class": type(tok).__name__, "model_class": type(model).__name__,
    "ids": ids, "with_bos": [tok.encode(t) for t in texts],
    "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids],
    "chat": tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
    "chat_ids": list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]),
    "refused": refused, "logits": logits.tolist(),
}))
"""


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("builtin-model")
    written = save_builtin_model(ModelSection(**TINY), directory, seed=3)
    assert sorted(p.name for p in directory.iterdir()) == written
    return directory


@pytest.mark.parametrize("source", ["the ranks' built-in tokenizer", "the saved directory as model.path"])
def test_the_hf_tokenizer_has_the_builtin_ids(builtin_dir, source):
    # The ranks' tokenizer (load_tokenizer) is a PreTrainedTokenizerFast for the built-in model as for model.path
    char = CharTokenizer()
    path = None if source.startswith("the ranks") else str(builtin_dir)
    hf = load_tokenizer(ModelSection(**TINY, path=path))
    assert isinstance(hf, HFTokenizer)
    assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id, hf.stop_ids) == (99, 0, 1, 2, (2,))
    assert hf.chat_template == char.chat_template
    for text in TEXTS:
        if "<" not in text:  # CharTokenizer.encode spells "<s>" out; the HF tokenizer reads it as the BOS token
            assert hf.encode(text) == char.encode(text)
            assert hf.encode_prompt(text) == char.encode_prompt(text) == [1, *char.encode(text)]
        ids = hf.encode(text)
        assert hf.decode(ids, skip_special=False) == char.decode(ids, skip_special=False) == text
    assert hf.render_chat(MESSAGES) == char.render_chat(MESSAGES)
    assert hf.encode_chat(MESSAGES) == char.encode_chat(MESSAGES)
    rng = random.Random(0)
    alphabet = CharTokenizer.CHARS + "  \n\n"
    for text in ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(200)]:
        if "<s>" not in text and "</s>" not in text and "<pad>" not in text:
            assert hf.encode_prompt(text) == char.encode_prompt(text)
            assert hf.decode([*hf.encode_prompt(text), 2, 0]) == char.decode([*char.encode_prompt(text), 2, 0]) == text
    for text in UNICODE:  # both refuse (a user error naming the vocabulary) rather than drop or replace characters
        with pytest.raises(UserError, match="vocabulary"):
            char.encode(text)
        with pytest.raises(UserError, match="vocabulary"):
            hf.encode_prompt(text)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_saved_directory_is_the_builtin_model(tmp_path, dtype):
    # bit for bit: loaded as model.path (from_pretrained) it computes what the built-in model computes
    section = ModelSection(**TINY, dtype=dtype)
    save_builtin_model(section, tmp_path, seed=5)
    builtin = build_model(section, 99, seed=5).eval()
    loaded = build_model(ModelSection(**TINY, dtype=dtype, path=str(tmp_path)), 99).eval()
    ids = torch.tensor([CharTokenizer().encode_prompt("12+34=46\nand more text")])
    with torch.no_grad():
        assert torch.equal(builtin(ids).logits, loaded(ids).logits)
    other_seed = build_model(section, 99, seed=6).eval()
    with torch.no_grad():
        assert not torch.equal(other_seed(ids).logits, loaded(ids).logits)


def test_a_fresh_process_with_transformers_only_reads_the_same_tokenizer_and_model(builtin_dir):
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(builtin_dir), *map(json.dumps, (TEXTS, UNICODE, MESSAGES))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["rollout_hpc_imported"]
    # transformers 5 builds the tokenizer class of config.json's model type unless tokenizer_config.json names
    # one: a Llama tokenizer here would drop the spaces
    assert report["tokenizer_class"] == PreTrainedTokenizerFast.__name__  # in transformers 5: TokenizersBackend
    assert report["model_class"] == "LlamaForCausalLM"
    char = CharTokenizer()
    assert report["decoded"] == TEXTS
    for text, ids, with_bos in zip(TEXTS, report["ids"], report["with_bos"]):
        assert with_bos == [char.bos_id, *ids]
        if "<" not in text:
            assert ids == char.encode(text)
    assert report["ids"][-1][0] == char.bos_id and report["ids"][-1][-1] == char.pad_id  # markers are one token
    assert report["chat"] == char.render_chat(MESSAGES)
    assert report["chat_ids"] == char.encode_chat(MESSAGES)
    assert len(report["refused"]) == len(UNICODE)
    builtin = build_model(ModelSection(**TINY), 99, seed=3).eval()
    with torch.no_grad():
        expected = builtin(torch.tensor([char.encode_prompt(TEXTS[4])])).logits[0]
    assert torch.equal(torch.tensor(report["logits"]), expected)
