"""A tiny Hugging Face model directory made in code (nothing downloaded): Qwen2 architecture, a byte-level
Qwen2Tokenizer with ChatML special tokens and chat template, and a generation_config.json that lists two
stop ids, as Qwen2.5-Instruct's does. Loads with AutoModelForCausalLM / AutoTokenizer like a real one."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_qwen(directory: Path, seed: int = 0, hidden: int = 64, layers: int = 2, bos: bool = False) -> Path:
    """Write the model directory; bos=True gives the tokenizer a BOS token that the template writes itself
    (Llama 3 style), to test that prompts get exactly one."""
    import torch
    from transformers import Qwen2ForCausalLM

    directory = Path(directory)
    tok = _byte_tokenizer(bos=bos)
    config = _qwen_config(
        tok, hidden, layers, max_positions=256, tie_word_embeddings=True, bos_token_id=tok.bos_token_id
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    # Two stop ids, like Qwen2.5-Instruct: <|im_end|> and <|endoftext|>.
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "pad_token_id": stops[1]}))
    return directory


def _byte_tokenizer(first: str | None = None, bos: bool = False):
    """A byte-level Qwen2Tokenizer with ChatML special tokens and template; `first` takes token id 0 (a zeroed LM
    head's every pick); bos: a BOS token that the template writes itself."""
    import tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    if first is not None:
        alphabet = [first] + [c for c in alphabet if c != first]
    vocab = {c: i for i, c in enumerate(alphabet)}
    extra = {"bos_token": "<|begin|>"} if bos else {}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", **extra
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = ("{{ bos_token }}" + CHATML) if bos else CHATML
    return tok


def _qwen_config(tok, hidden: int, layers: int = 2, max_positions: int = 1024, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def make_tiny_reward_classifier(
    directory: Path, seed: int = 0, num_labels: int = 1, hidden: int = 32, layers: int = 2
) -> Path:
    """A sequence-classification reward model (Qwen2ForSequenceClassification, random weights: scores differ by
    input) with the ChatML tokenizer and template."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    directory = Path(directory)
    tok = _byte_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(_qwen_config(tok, hidden, layers, num_labels=num_labels))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def make_tiny_judge(directory: Path, says: str = "7", hidden: int = 32, chat_template: bool = True) -> Path:
    """A causal-LM judge that always replies `says` repeated (one character): its LM head is zero, so greedy
    decoding picks token 0, which is `says`. With pattern '(\\d)' it scores int(says); the default \\boxed{} pattern
    never matches it (a parse failure)."""
    import torch
    from transformers import Qwen2ForCausalLM

    directory = Path(directory)
    tok = _byte_tokenizer(first=says)
    if not chat_template:
        tok.chat_template = None
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_qwen_config(tok, hidden, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
