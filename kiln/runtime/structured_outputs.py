"""Structured outputs: a request's output held, token by token, to a JSON Schema, any JSON
object, a regex, a choice among strings or a context-free grammar.

The grammar engine is llguidance, chosen by measuring both engines made for this on this CPU
(``benchmarks/grammar_mask.py``, docs/benchmark-log.md 2026-11-26): its per-token mask stays
under a third of a millisecond where xgrammar's reached 6-7 ms on a regex, and it installs alone.

``StructuredOutputsParams`` is what a request asks for (vLLM's spelling); its ``grammar_text``
is an llguidance grammar, checked against the model's tokenizer when the request arrives
(``RequestProcessor``), so a schema, regex or grammar that cannot compile fails that request
with its reason before any step runs. ``kiln.runtime.grammar_masks`` applies it while sampling.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from kiln.errors import RequestError

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` a JSON Schema (a dict, its JSON text, or a pydantic model
    class, whose schema is taken), ``json_object`` any JSON object, ``regex`` a regular
    expression the whole output matches, ``choice`` one of these strings, ``grammar`` a
    context-free grammar in Lark syntax (llguidance's dialect) or GBNF (llama.cpp's)."""

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    grammar_text: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        asked = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise RequestError(f"structured_outputs: give exactly one of {', '.join(_KINDS)}, got "
                               f"{', '.join(asked) if asked else 'none'}")
        object.__setattr__(self, "grammar_text", _grammar_text(asked[0], getattr(self, asked[0])))


def _grammar_text(kind: str, value: Any) -> str:
    if kind == "json":
        schema = value
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(f"structured_outputs.json: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("structured_outputs.json: a JSON Schema (an object), its JSON text or a pydantic "
                               f"model class, got {type(value).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as e:
            raise RequestError(f"structured_outputs.json: {e}") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    if kind == "regex":
        if not isinstance(value, str):
            raise RequestError(f"structured_outputs.regex: a string, got {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not (isinstance(value, (list, tuple)) and value and all(isinstance(c, str) and c for c in value)):
            raise RequestError("structured_outputs.choice: a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
    if not isinstance(value, str):
        raise RequestError(f"structured_outputs.grammar: a string, got {type(value).__name__}")
    if "::=" in value:  # GBNF (llama.cpp's grammar format) has ::= rules; Lark has ":"
        try:
            value = gbnf_to_lark(value)
        except Exception as e:  # the converter raises plain exceptions for malformed input
            raise RequestError(f"structured_outputs.grammar: not a GBNF grammar llguidance reads ({e})") from None
    return llguidance.LLMatcher.grammar_from_lark(value)


def grammar_tokenizer(tokenizer, vocab_size: int, end_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, over the model's ``vocab_size``
    logits, ending on ``end_ids`` (~0.4 s: build once per tokenizer). A RequestError if
    llguidance cannot read it (a slow tokenizer, or a decoder it does not know)."""
    import llguidance.hf  # imports transformers, which the tokenizer's owner has loaded already

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_ids or None)
    except Exception as e:  # llguidance raises ValueError (and Rust panics as others) for what it cannot read
        raise RequestError(f"structured_outputs: the grammar engine cannot read this model's tokenizer ({e})") from None


def check_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> None:
    """A RequestError naming the problem if llguidance cannot build ``params``' grammar."""
    error = llguidance.LLMatcher.validate_grammar(params.grammar_text, tokenizer)
    if error:
        raise RequestError(f"structured_outputs: {error}")
