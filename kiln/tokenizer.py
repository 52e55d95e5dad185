"""Tokenizer loading, end-of-sequence ids, chat prompts and incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import ConfigError


def hf_tokenizer(path: str | Path):
    """The Hugging Face tokenizer saved in directory ``path``, or the one in GGUF file ``path``'s
    metadata (transformers' own errors for a missing or broken one)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # seconds to import: only where it is used

    path = Path(path)
    if path.is_file():  # GGUF keeps its tokenizer inside the file
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, TypeError):
            # transformers reads the config of only some GGUF architectures (not smollm3, granite,
            # olmo2...), and fails on gpt-oss's rope.scaling keys (TypeError: it takes a key's length
            # field for its value); the tokenizer it builds from the metadata alone, as it would there.
            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer(path: str | Path):
    """The tokenizer of ``path``: an engine, checkpoint or HF dir, or a GGUF file (a ConfigError
    naming --tokenizer_dir if there is none)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--tokenizer_dir {path}: no such file or directory")
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError(f"--tokenizer_dir {path}: neither a directory nor a GGUF file")
    try:
        return hf_tokenizer(path)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise ConfigError(f"{path}: no usable tokenizer ({type(e).__name__}: {e}); "
                          "pass --tokenizer_dir (a tokenizer directory or a GGUF file)") from None


def end_ids(directory: str | Path, tokenizer) -> list[int]:
    """End-of-sequence ids: ``directory``'s generation_config.json's ``eos_token_id`` (int or
    list), else the tokenizer's (none without a tokenizer)."""
    path = Path(directory) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of ``token_ids``; "" without a tokenizer (``LLM(skip_tokenizer_init=True)``)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ready for the reply
    (or, without ``add_generation_prompt``, ending with the last message); ``tools``: OpenAI tool
    definitions, for a template that renders them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template; use a plain prompt instead of chat")
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Each step decodes from a little before the new tokens (``prefix_offset``) so merges
    such as leading spaces come out right, and holds back text that ends in an
    incomplete multi-byte character until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0  # decode from here...
        self.read_offset = 0  # ...and everything before this has been emitted

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.skip_special_tokens)

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """The text added by the tokens appended since the last call ("" if none is ready)."""
        emitted = self._decode(token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(token_ids[self.prefix_offset:])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return text[len(emitted):]
