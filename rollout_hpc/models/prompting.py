"""Prompt items -> the token ids a model sees: chat templates for chat prompts, raw text otherwise.

One function for every backend and tokenizer (the built-in one has a small template of its own):
a prompt with chat `messages` is formatted by the chat template (the tokenizer's, or a .jinja file
given in task.params.chat_template) with the assistant turn opened; `none` feeds raw text.
"""

from __future__ import annotations

from typing import Any

from rollout_hpc.envs.base import prompt_text


def raw_text(item: Any) -> str:
    """The plain-text form of a prompt: chat turns' contents one per line, or the prompt text."""
    messages = getattr(item, "messages", None)
    if messages:
        return "\n".join(str(m["content"]) for m in messages)
    return prompt_text(item)


def encode_prompt_item(tokenizer, item: Any, chat_template: str | None = "auto") -> list[int]:
    """Token ids for a prompt item. chat_template: 'auto' (the tokenizer's template for chat prompts),
    'none' (raw text), or template text (a .jinja file's content, read by load_chat_template)."""
    messages = getattr(item, "messages", None)
    if not messages or chat_template == "none":
        return tokenizer.encode_prompt(raw_text(item) if messages else prompt_text(item))
    template = None if chat_template in (None, "auto") else chat_template
    if template is None and tokenizer.chat_template is None:
        return tokenizer.encode_prompt(raw_text(item))  # auto on a tokenizer without a template: raw text
    return tokenizer.encode_chat(messages, template)
