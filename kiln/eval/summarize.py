"""``kiln eval summarize``: summaries of articles by kiln and, beside it, by Hugging Face
transformers, scored with ROUGE against reference summaries.

Each prompt is an instruction and the article, the article cut to a token budget so that the
prompt and ``--max_output_len`` new tokens fit the engine: for a tokenizer with a chat template
the two go in one user message of that template, otherwise they form a plain text prompt that
ends in "Summary:". Both sides get the very same prompt token ids and decode greedily up to
``--max_output_len`` tokens or the end token; kiln runs each batch of ``--batch_size`` prompts
through ``LLM.generate`` (continuous batching over the paged cache), HF through one left-padded
static ``generate`` per batch. Both outputs are decoded by the same tokenizer.

Throughput (tok/s) is each side's generated tokens (end token included) over the seconds of its
timed generate calls, prompt processing included, after an untimed warm-up of a few tokens.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.bench.peer import left_padded
from kiln.data.sharegpt import summarization_requests
from kiln.data.texts import jsonl_records
from kiln.errors import ConfigError, KilnError
from kiln.eval.common import format_table, load_hf_model, write_json
from kiln.eval.rouge import ROUGE_KEYS, mean_scores, rouge_scores
from kiln.llm import LLM
from kiln.runtime.sampling_params import SamplingParams

DEFAULT_MAX_SAMPLES = 50
DEFAULT_INSTRUCTION = "Summarize the following article."
_ARTICLE = "\x00ARTICLE\x00"  # where the article's tokens go in the rendered template


# -- datasets -------------------------------------------------------------------------------------

def read_jsonl(path: str | Path, limit: int) -> list[dict]:
    """The first ``limit`` records of a JSONL file of ``{"article", "highlights"}`` (optional
    ``"id"``, ``"instruction"``); blank lines are skipped. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--dataset {path}: {'not a file' if path.exists() else 'no such file'}")
    records = []
    for number, record in jsonl_records(path, "--dataset"):
        fields = ("article", "highlights")
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) and record[k].strip()
                                                   for k in fields):
            raise ConfigError(f"--dataset {path} line {number}: a record needs non-empty string fields "
                              f"\"article\" and \"highlights\"")
        instruction = record.get("instruction")
        if instruction is not None and not isinstance(instruction, str):
            raise ConfigError(f"--dataset {path} line {number}: \"instruction\" must be a string")
        records.append({"id": str(record.get("id", f"line {number}")), "article": record["article"],
                        "highlights": record["highlights"], "instruction": instruction or DEFAULT_INSTRUCTION})
        if len(records) == limit:  # lines past the limit are not read
            break
    if not records:
        raise ConfigError(f"--dataset {path}: no records")
    return records


def load_dataset(spec: str, limit: int) -> list[dict]:
    """Records ``{"id", "article", "highlights", "instruction"}`` of ``--dataset``: a JSONL
    file, or ``sharegpt`` (summarization requests mined from ShareGPT)."""
    if spec == "sharegpt":

        records = summarization_requests(limit)
        if not records:
            raise KilnError("--dataset sharegpt: no summarization requests found")
        return records
    if not Path(spec).exists() and not spec.endswith(".jsonl"):
        raise ConfigError(f"--dataset {spec}: neither 'sharegpt' nor an existing JSONL file")
    return read_jsonl(spec, limit)


# -- prompts --------------------------------------------------------------------------------------

def _with_special_tokens(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (BOS, sometimes EOS)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


class PromptBuilder:
    """Token ids of instruction + article prompts, the article inserted as its own tokens so
    that cutting it to a budget is exact."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def _parts(self, instruction: str) -> tuple[list[int], list[int]]:
        """(ids before the article, ids after it) for ``instruction``."""
        tok = self.tokenizer
        if self.chat:
            messages = [{"role": "user", "content": f"{instruction}\n\n{_ARTICLE}"}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            before, after = [], []  # a chat template writes its own BOS
        else:
            text = f"{instruction}\n\n{_ARTICLE}\n\nSummary:"
            before, after = _with_special_tokens(tok, "x")
        if text.count(_ARTICLE) != 1:
            raise KilnError("the tokenizer's chat template does not keep the user message whole")
        head, tail = text.split(_ARTICLE)
        return (before + tok(head, add_special_tokens=False)["input_ids"],
                tok(tail, add_special_tokens=False)["input_ids"] + after)

    def overhead(self, instruction: str) -> int:
        """Prompt tokens besides the article's."""
        head, tail = self._parts(instruction)
        return len(head) + len(tail)

    def build(self, instruction: str, article: str, article_tokens: int) -> list[int]:
        """The prompt ids with the article cut to its first ``article_tokens`` tokens."""
        head, tail = self._parts(instruction)
        ids = self.tokenizer(article.strip(), add_special_tokens=False)["input_ids"][:article_tokens]
        return head + ids + tail


def article_budget(overhead: int, build, max_output_len: int, requested: int | None) -> int:
    """Article tokens per prompt: ``requested`` (--max_input_len) if it fits the engine, else
    all that the engine's max_input_len and max_seq_len leave besides ``overhead`` tokens of
    instruction/template and ``max_output_len`` new tokens."""
    prompt_limit = min(build.max_input_len, build.max_seq_len - max_output_len)
    room = prompt_limit - overhead
    limits = (f"the engine's max_input_len {build.max_input_len} and max_seq_len {build.max_seq_len} "
              f"(less --max_output_len {max_output_len}) with {overhead} tokens of instruction and template")
    if requested is not None:
        if requested > room:
            raise ConfigError(f"--max_input_len {requested}: {limits} leave room for {max(room, 0)} article tokens")
        return requested
    if room < 1:
        raise ConfigError(f"{limits} leave no room for the article; lower --max_output_len")
    return room


# -- generation -----------------------------------------------------------------------------------

def _until_end(tokens: list[int], end_ids: list[int]) -> list[int]:
    """``tokens`` up to and including the first end id (HF pads finished rows after it)."""
    for i, t in enumerate(tokens):
        if t in end_ids:
            return tokens[:i + 1]
    return tokens


_WARM_UP_TOKENS = 4


def _warm_up_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Two short prompts (the first 16 tokens of the first two) for an untimed warm-up."""
    return [p[:16] for p in prompts[:2]]


def generate_kiln(llm, prompts: list[list[int]], max_output_len: int, batch_size: int,
                  progress: bool = True) -> tuple[list[list[int]], float]:
    """kiln's greedy outputs (token ids, the end token included when reached) and the seconds
    spent generating them (after an untimed warm-up; prompt processing included)."""
    params = SamplingParams(max_tokens=max_output_len, temperature=0)
    # Warm-up: the first call pays one-off costs (weight packing, allocator) that are no throughput
    llm.generate(_warm_up_prompts(prompts), SamplingParams(max_tokens=_WARM_UP_TOKENS, temperature=0))
    outputs, seconds = [], 0.0
    with tqdm(total=len(prompts), desc="kiln", unit="sample", disable=not progress) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            started = time.perf_counter()
            results = llm.generate(batch, params)
            seconds += time.perf_counter() - started
            outputs += [list(r.outputs[0].token_ids) for r in results]
            bar.update(len(batch))
    return outputs, seconds


def generate_hf(model, prompts: list[list[int]], max_output_len: int, batch_size: int, end_ids: list[int],
                pad_id: int, progress: bool = True) -> tuple[list[list[int]], float]:
    """HF's greedy outputs for left-padded batches (each row cut after its first end id) and the
    seconds spent in ``generate`` (after an untimed warm-up; prompt processing included)."""
    from transformers import GenerationConfig  # transformers takes seconds to import: only where it is used

    # A bare generation config: the model's own defaults (repetition penalty, sampling) would
    # make HF decode differently from kiln's plain greedy.
    model.generation_config = GenerationConfig(eos_token_id=end_ids or None, pad_token_id=pad_id)
    with torch.inference_mode():  # warm-up, as for kiln
        ids, mask = left_padded(_warm_up_prompts(prompts), pad_id)
        model.generate(ids, attention_mask=mask, max_new_tokens=_WARM_UP_TOKENS, do_sample=False, num_beams=1)
    outputs, seconds = [], 0.0
    with tqdm(total=len(prompts), desc="HF", unit="sample", disable=not progress) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            ids, mask = left_padded(batch, pad_id)
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_output_len, do_sample=False,
                                     num_beams=1)
            seconds += time.perf_counter() - started
            outputs += [_until_end(row.tolist(), end_ids) for row in out[:, ids.shape[1]:]]
            bar.update(len(batch))
    return outputs, seconds


# -- the command ------------------------------------------------------------------------------------

def _check_args(args) -> None:
    for flag in ("max_samples", "batch_size", "max_output_len", "max_input_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {value}")


def _side(tokens: list[list[int]], seconds: float, tokenizer, references: list[str]) -> dict:
    """Texts, per-sample ROUGE, their means and throughput of one side's outputs."""
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    per_sample = rouge_scores(texts, references)
    count = sum(len(t) for t in tokens)
    return {"rouge": mean_scores(per_sample), "samples": len(tokens), "output_tokens": count,
            "seconds": seconds, "output_tok_s": count / seconds if seconds > 0 else None,
            "texts": texts, "tokens": tokens, "per_sample": per_sample}


def summarize(args) -> dict:
    """Run the evaluation described by the CLI ``args``; returns the full record."""
    _check_args(args)
    limit = args.max_samples or DEFAULT_MAX_SAMPLES
    records = load_dataset(args.dataset, limit)
    llm = LLM(args.engine_dir, tokenizer=args.tokenizer, progress=False)
    tokenizer = llm.tokenizer
    build = llm.engine.build_config
    builder = PromptBuilder(tokenizer)
    overhead = max(builder.overhead(r["instruction"]) for r in records)
    budget = article_budget(overhead, build, args.max_output_len, args.max_input_len)
    prompts = [builder.build(r["instruction"], r["article"], budget) for r in records]
    references = [r["highlights"] for r in records]

    kiln_tokens, kiln_seconds = generate_kiln(llm, prompts, args.max_output_len, args.batch_size)
    sides = {"kiln": _side(kiln_tokens, kiln_seconds, tokenizer, references)}
    if args.hf_model_dir:
        model, _ = load_hf_model(args.hf_model_dir, llm.engine.config.dtype)
        ends = [llm.processor.end_id, *llm.processor.extra_stop_ids] if llm.processor.end_id is not None else []
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (ends[0] if ends else 0)
        hf_tokens, hf_seconds = generate_hf(model, prompts, args.max_output_len, args.batch_size, ends, pad_id)
        sides["hf"] = _side(hf_tokens, hf_seconds, tokenizer, references)
        del model

    samples = []
    for i, record in enumerate(records):
        sample = {"id": record["id"], "instruction": record["instruction"], "prompt_tokens": len(prompts[i]),
                  "reference": record["highlights"]}
        for name, side in sides.items():
            sample[name] = {"text": side["texts"][i], "tokens": side["tokens"][i], "rouge": side["per_sample"][i]}
        samples.append(sample)
    summary = {name: {k: v for k, v in side.items() if k not in ("texts", "tokens", "per_sample")}
               for name, side in sides.items()}
    record = {"kind": "summarize", "engine": str(args.engine_dir), "hf_model": args.hf_model_dir,
              "dataset": args.dataset, "dtype": llm.engine.config.dtype, "chat_template": builder.chat,
              "article_tokens": budget, "max_output_len": args.max_output_len, "batch_size": args.batch_size,
              **summary, "samples": samples}
    if "hf" in sides:
        record["identical_outputs"] = sum(k == h for k, h in zip(kiln_tokens, sides["hf"]["tokens"]))
    return record


def format_summary(record: dict) -> str:
    """The results table (one row per side) and, with HF, how many outputs agree."""
    header = ["", "ROUGE-1", "ROUGE-2", "ROUGE-L", "ROUGE-Lsum", "samples", "output tokens", "seconds", "tok/s"]
    rows = []
    for name, label in (("kiln", "kiln"), ("hf", "HF")):
        side = record.get(name)
        if side is not None:
            rows.append([label, *(side["rouge"][k] for k in ROUGE_KEYS), side["samples"], side["output_tokens"],
                         side["seconds"], side["output_tok_s"]])
    lines = [f"summarize: {record['dataset']}, {record['dtype']}, articles cut to {record['article_tokens']} tokens, "
             f"at most {record['max_output_len']} new tokens, batches of {record['batch_size']}",
             format_table(header, rows)]
    if "identical_outputs" in record:
        lines.append(f"kiln and HF outputs identical on {record['identical_outputs']}/{record['kiln']['samples']} "
                     "samples")
    return "\n".join(lines)


def run(args) -> int:
    """``kiln eval summarize``: print the table, write --output_json, and with --check_accuracy
    return 1 when kiln's ROUGE-1 is below --rouge1_threshold (HF's is reported, not checked)."""
    record = summarize(args)
    code = 0
    if args.check_accuracy:
        rouge1 = record["kiln"]["rouge"]["rouge1"]
        passed = rouge1 >= args.rouge1_threshold
        record["check_accuracy"] = {"rouge1_threshold": args.rouge1_threshold, "passed": passed}
        code = 0 if passed else 1
    print(format_summary(record))
    if args.check_accuracy:
        verdict = "PASS" if code == 0 else "FAIL"
        print(f"check_accuracy: kiln ROUGE-1 {record['kiln']['rouge']['rouge1']:.2f} vs threshold "
              f"{args.rouge1_threshold:g}: {verdict}")
    if args.output_json:
        write_json(args.output_json, record)
    return code
