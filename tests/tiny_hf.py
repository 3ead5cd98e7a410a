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
    import tokenizers
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    directory = Path(directory)
    vocab = {c: i for i, c in enumerate(sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()))}
    extra = {"bos_token": "<|begin|>"} if bos else {}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", **extra
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = ("{{ bos_token }}" + CHATML) if bos else CHATML
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    # Two stop ids, like Qwen2.5-Instruct: <|im_end|> and <|endoftext|>.
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "pad_token_id": stops[1]}))
    return directory
