"""Policy models and tokenizers (built-in tiny model or a local Hugging Face directory)."""

from .build import ModelLoadError, build_model, tiny_config
from .logprobs import response_logprobs
from .tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer, load_tokenizer_for_run
from .value_head import ValueModel, build_critic

__all__ = [
    "CharTokenizer",
    "HFTokenizer",
    "ValueModel",
    "build_critic",
    "ModelLoadError",
    "Tokenizer",
    "build_model",
    "load_tokenizer",
    "load_tokenizer_for_run",
    "response_logprobs",
    "tiny_config",
]
