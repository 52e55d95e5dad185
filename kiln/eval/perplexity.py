"""``kiln eval perplexity``: token-level perplexity from the runtime's prompt log-probabilities.

Perplexity is ``exp(total NLL / tokens scored)`` over every scored token of every text. A
text longer than the window is scored in sliding windows (the usual strided scheme): window
``j`` covers tokens ``[j * stride, j * stride + window)``, its leading tokens already scored
by an earlier window are context only, and it scores the rest. The first token of a text has
no context and is never scored, so a text of ``n`` tokens scores ``n - 1``.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kiln.checkpoint.format import read_config_dict
from kiln.config import BuildConfig
from kiln.data.sharegpt import long_replies
from kiln.data.texts import read_texts
from kiln.engine_cache import classify
from kiln.errors import ConfigError
from kiln.eval.common import format_table, write_json
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams

DEFAULT_SHAREGPT_SAMPLES = 50
LOGITS_BUDGET = 1 << 26  # context-logit floats held at once (256 MB): windows are batched under it


@dataclass(frozen=True)
class Window:
    """One request: tokens ``[start, end)`` of a text, of which ``[score_from, end)`` are scored."""

    start: int
    end: int
    score_from: int


@dataclass
class TextScore:
    """What one text contributed."""

    index: int
    num_tokens: int
    windows: int = 0
    scored: int = 0
    nll: float = 0.0

    def as_dict(self) -> dict:
        return {"index": self.index, "tokens": self.num_tokens, "tokens_scored": self.scored,
                "windows": self.windows, "nll": self.nll,
                "mean_nll": self.nll / self.scored if self.scored else None,
                "perplexity": math.exp(self.nll / self.scored) if self.scored else None}


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows scoring a text of ``num_tokens`` tokens: every token but the first is scored
    exactly once, by the first window that holds it with context before it (``1 <= stride < window``)."""
    if not 1 <= stride < window:
        raise ValueError(f"need 1 <= stride < window, got stride {stride}, window {window}")
    windows: list[Window] = []
    scored_until = 1  # the first token is context only
    start = 0
    while scored_until < num_tokens:
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, scored_until))
        scored_until = end
        start += stride
    return windows


# -- inputs ------------------------------------------------------------------------------------

def load_texts(dataset: str, max_samples: int | None) -> list[str]:
    """The texts of ``--dataset``: a ``.jsonl`` file of {"text"}, any other file as one text, or
    'sharegpt' (model answers of at least 200 characters, in file order: ``long_replies``)."""
    if max_samples is not None and max_samples < 1:
        raise ConfigError(f"--max_samples must be >= 1, got {max_samples}")
    if dataset == "sharegpt":

        return list(itertools.islice(long_replies(), max_samples or DEFAULT_SHAREGPT_SAMPLES))
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"--dataset {path}: no such file (give a .jsonl or text file, or 'sharegpt')")
    return read_texts(path, "--dataset", max_samples)


def resolve_window(window: int | None, stride: int | None, max_input_len: int, max_seq_len: int) -> tuple[int, int]:
    """(window, stride) from the flags and the engine's limits, or a ConfigError naming the flag."""
    # A prompt must leave room for the one token every request generates.
    limit = min(max_input_len, max_seq_len - 1)
    window = limit if window is None else window
    if not 2 <= window <= limit:
        raise ConfigError(f"--window must be in [2, {limit}] (the engine's max_input_len {max_input_len}, "
                          f"max_seq_len {max_seq_len}), got {window}")
    stride = window // 2 if stride is None else stride
    if not 1 <= stride < window:
        raise ConfigError(f"--stride must be in [1, {window - 1}] (below --window {window}, so windows overlap "
                          f"and every token but a text's first is scored), got {stride}")
    return window, stride


def engine_build_config(engine_dir: str, tokenizer_dir: str | None = None):
    """The build config of the engine at ``--engine_dir``, read without loading it, after checking
    both directories (a ConfigError names the flag at fault)."""
    path = Path(engine_dir)
    if not path.is_dir():
        raise ConfigError(f"--engine_dir {path}: no such directory")
    if classify(path) != "engine":
        raise ConfigError(f"--engine_dir {path}: not a kiln engine (no config.json with a build_config)")
    if tokenizer_dir is not None and not Path(tokenizer_dir).exists():  # a directory or a GGUF file
        raise ConfigError(f"--tokenizer_dir {tokenizer_dir}: no such file or directory")
    return BuildConfig.from_dict(read_config_dict(path)["build_config"])


def open_engine(engine_dir: str, tokenizer_dir: str | None):
    """kiln's LLM on an existing engine (never a conversion into the cache)."""
    engine_build_config(engine_dir, tokenizer_dir)
    return LLM(Path(engine_dir), tokenizer=tokenizer_dir, progress=False)


# -- scoring -----------------------------------------------------------------------------------

def score_texts(llm, token_lists: list[list[int]], window: int, stride: int, progress: bool = True
                ) -> tuple[list[TextScore], dict]:
    """Score every text with the runtime's prompt log-probs; returns per-text scores and totals
    (tokens run through the engine, windows, seconds)."""
    jobs = [(i, w) for i, ids in enumerate(token_lists) for w in sliding_windows(len(ids), window, stride)]
    scores = [TextScore(i, len(ids)) for i, ids in enumerate(token_lists)]
    # One generated token is the least a request asks for; its log-probs are not needed.
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    budget = max(window, LOGITS_BUDGET // llm.engine.config.vocab_size)
    batch_limit = llm.core.max_num_seqs
    processed = 0
    started = time.perf_counter()
    with tqdm(total=sum(w.end - w.score_from for _, w in jobs), desc="scoring", unit="tok",
              disable=not progress) as bar:
        at = 0
        while at < len(jobs):
            batch, tokens = [], 0
            while at < len(jobs) and len(batch) < batch_limit and (not batch or tokens + window <= budget):
                batch.append(jobs[at])
                tokens += jobs[at][1].end - jobs[at][1].start
                at += 1
            outputs = llm.generate([token_lists[i][w.start:w.end] for i, w in batch], params)
            for (i, w), out in zip(batch, outputs):
                ids, logprobs = token_lists[i], out.prompt_logprobs
                score = scores[i]
                for pos in range(w.score_from, w.end):
                    # prompt_logprobs[k] is the log-prob of the window's token k given those before it
                    score.nll -= logprobs[pos - w.start][ids[pos]]
                score.scored += w.end - w.score_from
                score.windows += 1
                processed += w.end - w.start
                bar.update(w.end - w.score_from)
    return scores, {"tokens_processed": processed, "windows": len(jobs), "seconds": time.perf_counter() - started}


def summarize(scores: list[TextScore], totals: dict) -> dict:
    """Corpus-level numbers: perplexity is exp of the mean NLL over all scored tokens."""
    scored = sum(s.scored for s in scores)
    nll = sum(s.nll for s in scores)
    seconds = totals["seconds"]
    return {"texts": len(scores), "tokens_scored": scored, "windows": totals["windows"],
            "tokens_processed": totals["tokens_processed"], "nll": nll, "mean_nll": nll / scored,
            "perplexity": math.exp(nll / scored), "seconds": seconds,
            "tokens_per_second": totals["tokens_processed"] / seconds if seconds > 0 else None}


def run(args) -> int:
    """``kiln eval perplexity``: print the summary table; write --output_json; exit code 0."""
    # Every flag and input is checked before the engine loads.
    build = engine_build_config(args.engine_dir, args.tokenizer)
    window, stride = resolve_window(args.window, args.stride, build.max_input_len, build.max_seq_len)
    texts = load_texts(args.dataset, args.max_samples)
    if not texts:
        raise ConfigError(f"--dataset {args.dataset}: no texts to score")
    llm = open_engine(args.engine_dir, args.tokenizer)
    token_lists = [llm.tokenizer(t)["input_ids"] for t in texts]
    if all(len(ids) < 2 for ids in token_lists):
        raise ConfigError(f"--dataset {args.dataset}: every text is shorter than 2 tokens; nothing to score")
    scores, totals = score_texts(llm, token_lists, window, stride)
    summary = summarize(scores, totals)
    print(format_table(
        ["dataset", "texts", "tokens scored", "windows", "NLL/token", "perplexity", "tok/s"],
        [[args.dataset, summary["texts"], summary["tokens_scored"], summary["windows"], f"{summary['mean_nll']:.4f}",
          f"{summary['perplexity']:.4f}", summary["tokens_per_second"]]]))
    print(f"window {window}, stride {stride}; tok/s counts every token run through the engine "
          f"({summary['tokens_processed']} in {summary['seconds']:.1f} s)")
    if args.output_json:
        write_json(args.output_json, {
            "command": "perplexity", "engine_dir": str(args.engine_dir), "dataset": args.dataset,
            "window": window, "stride": stride, "summary": summary, "texts": [s.as_dict() for s in scores]})
    return 0
