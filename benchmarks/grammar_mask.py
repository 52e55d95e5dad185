"""The grammar engines made for LLM decoding, side by side on this CPU: xgrammar and llguidance.

    python benchmarks/grammar_mask.py [--repeats 5]

Constrained decoding computes, before every sampled token, the mask of tokens the grammar allows
next, on the host, between two decode steps: its cost adds to every constrained token. This
measures each library on the bundled model's real tokenizer (SmolLM2, 49,152 tokens) walking a
valid output token by token (mask, check the token is allowed, advance): per-token mask time
(median, 95th percentile and worst, over ``--repeats`` walks), the grammar's compile time, and the
one-off tokenizer setup. Constraints: a JSON Schema (an object with strings, a number, an enum,
an array and a nested object), any JSON value (JSON mode), a regex, and a choice among strings.
Both libraries are optional benchmark dependencies (``pip install xgrammar llguidance``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from kiln.examples import smollm2_gguf_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string"},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "city", "role", "skills", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "city": "London", "role": "engineer",
            "skills": ["mathematics", "analytical engines", "poetry"],
            "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"}}
REGEX = r"\d{3}-\d{3}-\d{4} \(([A-Z][a-z]+ ?)+\)"
REGEX_TEXT = "555-123-4567 (Grace Brewster Hopper)"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
CASES = {  # name: (constraint kind, constraint, a valid output)
    "json schema": ("schema", SCHEMA, json.dumps(DOCUMENT)),
    "any json": ("json", None, json.dumps({"items": [1, 2.5, True, None], "note": "any value", "nested": {"a": []}})),
    "regex": ("regex", REGEX, REGEX_TEXT),
    "choice": ("regex", "|".join(c.replace(" ", r"\ ") for c in CHOICES), "mixed feelings"),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr  # optional benchmark dependency

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, constraint):
        if kind == "schema":
            return self.compiler.compile_json_schema(json.dumps(constraint))
        if kind == "json":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_regex(constraint)

    def walker(self, compiled) -> tuple[Callable[[torch.Tensor], None], Callable[[int], bool]]:
        matcher = self.xgr.GrammarMatcher(compiled)
        return (lambda bitmask: matcher.fill_next_token_bitmask(bitmask)), matcher.accept_token


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance  # optional benchmark dependency
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, constraint):
        if kind == "schema":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(constraint))
        elif kind == "json":
            grammar = self.llg.LLMatcher.grammar_from_json_schema("{}")
        else:
            grammar = self.llg.LLMatcher.grammar_from_regex(constraint)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def walker(self, grammar) -> tuple[Callable[[torch.Tensor], None], Callable[[int], bool]]:
        import llguidance.torch  # optional benchmark dependency

        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # builds the parser: part of compiling
        return (lambda bitmask: llguidance.torch.fill_next_token_bitmask(matcher, bitmask)), matcher.consume_token


def walk(engine, compiled, ids: list[int]) -> list[float]:
    """Seconds of each mask along ``ids`` (each token checked allowed, then consumed)."""
    fill, accept = engine.walker(compiled)
    bitmask = torch.full((1, (engine.vocab_size + 31) // 32), -1, dtype=torch.int32)
    seconds = []
    for token in ids:
        start = time.perf_counter()
        fill(bitmask)
        seconds.append(time.perf_counter() - start)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            raise AssertionError(f"{engine.name}: token {token} of a valid output is masked out")
        if not accept(token):
            raise AssertionError(f"{engine.name}: token {token} of a valid output was refused")
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="walks of each output per library (default 5)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer  # takes seconds to import: after --help

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    vocab_size = len(tokenizer)
    print(f"tokenizer: SmolLM2 ({vocab_size} tokens); {torch.get_num_threads()} threads")
    print(f"{'library':12} {'constraint':12} {'tokens':>6} {'compile ms':>10} {'mask us p50':>11} {'p95':>7} {'max':>7}")
    for make in (XGrammar, LLGuidance):
        start = time.perf_counter()
        engine = make(tokenizer, vocab_size)
        print(f"{engine.name:12} tokenizer setup {time.perf_counter() - start:.2f} s")
        for case, (kind, constraint, text) in CASES.items():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            start = time.perf_counter()
            compiled = engine.compile(kind, constraint)
            compile_ms = (time.perf_counter() - start) * 1e3
            times = sorted(t for _ in range(args.repeats) for t in walk(engine, compiled, ids))
            p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
            print(f"{engine.name:12} {case:12} {len(ids):6d} {compile_ms:10.1f} {statistics.median(times) * 1e6:11.1f} "
                  f"{p95 * 1e6:7.1f} {times[-1] * 1e6:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
