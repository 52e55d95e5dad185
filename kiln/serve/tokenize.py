"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served model's tokenizer, as the
endpoints use it, for clients that count or build prompts in tokens."""
from __future__ import annotations

from kiln.serve.chat import chat_ids
from kiln.serve.engine import ServingEngine
from kiln.serve.protocol import ApiError, DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def tokenize(engine: ServingEngine, body: TokenizeRequest) -> TokenizeResponse:
    """A prompt's token ids (with the tokenizer's special tokens unless ``add_special_tokens`` is
    false), or those of chat messages (and tools) as ``/v1/chat/completions`` renders them."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", "prompt")
    if body.prompt is not None:
        ids = engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = chat_ids(engine, body.messages, body.add_generation_prompt, tools)
    return TokenizeResponse(count=len(ids), max_model_len=engine.build.max_seq_len, tokens=ids)


def detokenize(engine: ServingEngine, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids (special tokens included, as the ids say)."""
    bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {engine.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))
