"""The Hugging Face transformers peer that every kiln benchmark measures beside kiln."""
from __future__ import annotations

import time
from pathlib import Path

import torch


def load_hf_peer(dtype: str, *, gguf: str | None = None, model_dir: str | None = None):
    """The peer model in ``dtype`` (a kiln dtype name), quiet and in eval mode, and its load time."""
    from transformers import AutoModelForCausalLM  # transformers takes seconds to import: only where it is used
    from transformers.utils import logging as hf_logging  # transformers takes seconds to import: only where it is used

    if not (gguf or model_dir):
        raise ValueError("the HF peer needs a GGUF file or a model directory")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = getattr(torch, dtype)
    started = time.perf_counter()
    if gguf:
        path = Path(gguf)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.eval(), time.perf_counter() - started


class _FirstTokenClock:
    """A logits processor noting when generation first asks for a token (the prompt is done)."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of a static batch, left-padded as ``generate`` expects."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int = 0) -> tuple[float, float]:
    """Greedy ``generate`` of exactly ``new_tokens`` for a static, left-padded batch.

    Returns (seconds to the first generated token, total seconds).
    """
    ids, mask = left_padded(prompts, pad_id)
    from transformers import LogitsProcessorList  # transformers takes seconds to import: only where it is used

    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        # No end token, so every row generates exactly new_tokens.
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                       pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
    return clock.first - started, time.perf_counter() - started
