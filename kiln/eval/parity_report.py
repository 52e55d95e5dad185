"""``kiln eval parity``: run kiln and Hugging Face on the same prompts (``kiln.eval.parity`` holds
the comparisons), print the one-screen report and write --output_json."""
from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from kiln.errors import ConfigError
from kiln.eval.common import format_table, load_hf_model, write_json
from kiln.eval.parity import (DEFAULT_TOLERANCE, MAX_TOP_K, compare_layers, encode_prompts, first_divergence,
                              hf_greedy, hf_hidden_states, kiln_greedy, kiln_layer_outputs,
                              kiln_prompt_logits, load_prompts, prompt_verdict, relative_max_diff)
from kiln.eval.perplexity import engine_build_config, open_engine


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _token(tokenizer, token_id: int) -> str:
    text = repr(tokenizer.decode([token_id]))
    return text if len(text) <= 14 else text[:11] + "...'"


def _checked_limits(args, build) -> tuple:
    """(the engine's build limits, the longest prompt that leaves room for --max_tokens); every
    flag is checked before either model loads."""
    if args.max_tokens < 1:
        raise ConfigError(f"--max_tokens must be >= 1, got {args.max_tokens}")
    if not 1 <= args.top_k <= MAX_TOP_K:
        raise ConfigError(f"--top_k must be in [1, {MAX_TOP_K}], got {args.top_k}")
    if args.tolerance is not None and not args.tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {args.tolerance}")
    limit = min(build.max_input_len, build.max_seq_len - args.max_tokens)
    if limit < 1:
        raise ConfigError(f"--max_tokens {args.max_tokens} leaves no room for a prompt under the engine's "
                          f"max_seq_len {build.max_seq_len}")
    if not Path(args.hf_model_dir).exists():
        raise ConfigError(f"--hf_model_dir {args.hf_model_dir}: no such directory or file")
    return build, limit


def run(args) -> int:
    """``kiln eval parity``: print the report, write --output_json; exit code 0 for a completed
    comparison (it is a report, whatever it finds)."""
    build, limit = _checked_limits(args, engine_build_config(args.engine_dir, args.tokenizer))
    prompts = load_prompts(args.prompts, args.max_samples)

    llm = open_engine(args.engine_dir, args.tokenizer)
    dtype = llm.engine.config.dtype
    if args.tolerance is None:
        args.tolerance = DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE["bfloat16"])
    hf, hf_load_seconds = load_hf_model(args.hf_model_dir, dtype)
    if hf.config.vocab_size < llm.engine.config.vocab_size:
        raise ConfigError(f"--hf_model_dir {args.hf_model_dir}: vocabulary {hf.config.vocab_size} is smaller "
                          f"than the engine's {llm.engine.config.vocab_size}; not the engine's model")
    encoded = encode_prompts(llm.tokenizer, prompts, limit)

    started = time.perf_counter()
    kiln_outputs = kiln_greedy(llm, encoded, args.max_tokens, args.top_k)
    kiln_logits = [kiln_prompt_logits(llm, ids) for ids in tqdm(encoded, desc="kiln prompt logits", unit="prompt")]
    kiln_seconds = time.perf_counter() - started
    started = time.perf_counter()
    hf_outputs = [hf_greedy(hf, ids, args.max_tokens) for ids in tqdm(encoded, desc="HF", unit="prompt")]
    hf_seconds = time.perf_counter() - started

    results = []
    for index, (ids, (k_tokens, k_logprobs), (h_tokens, h_rows, h_logits), k_logits) in enumerate(
            zip(encoded, kiln_outputs, hf_outputs, kiln_logits)):
        vocab = min(k_logits.shape[-1], h_logits.shape[-1])  # HF may pad its vocabulary
        diff, scale, rel = relative_max_diff(k_logits[:, :vocab], h_logits[:, :vocab])
        divergence = first_divergence(k_tokens, k_logprobs, h_tokens, h_rows, args.top_k)
        results.append({
            "index": index, "prompt": prompts[index].text, "chat_template": prompts[index].chat,
            "prompt_token_ids": ids, "kiln_tokens": k_tokens, "hf_tokens": h_tokens,
            "identical": divergence is None, "divergence": divergence,
            "max_abs_logit_diff": diff, "max_abs_hf_logit": scale, "relative_logit_diff": rel,
            "logits_equal": rel <= args.tolerance, "verdict": prompt_verdict(divergence, rel <= args.tolerance)})

    layers = None
    suspects = [r for r in results if r["verdict"] == "mismatch"]
    if suspects:
        # The worst prompt, with the tokens both sides agreed on: the context where they part.
        worst = max(suspects, key=lambda r: r["relative_logit_diff"])
        agreed = worst["kiln_tokens"][: worst["divergence"]["position"]] if worst["divergence"] else []
        ids = (worst["prompt_token_ids"] + agreed)[: build.max_input_len]
        hf_states, hf_last_normed = hf_hidden_states(hf, ids)
        kiln_embeddings, kiln_outputs, kiln_normed = kiln_layer_outputs(llm, ids, hf_states[:-1])
        layers = {"prompt_index": worst["index"], "num_tokens": len(ids),
                  **compare_layers(kiln_embeddings, kiln_outputs, kiln_normed, hf_states, hf_last_normed,
                                   args.tolerance)}

    if all(r["verdict"] == "identical" for r in results):
        verdict = "identical"
    elif not suspects:
        verdict = "top-k swaps only"
    else:
        verdict = "mismatch"
    summary = {"verdict": verdict, "prompts": len(results),
               "identical": sum(r["verdict"] == "identical" for r in results),
               "top_k_swaps": sum(r["verdict"] == "top-k swap" for r in results),
               "mismatches": len(suspects),
               "max_relative_logit_diff": max(r["relative_logit_diff"] for r in results),
               "first_drifting_layer": None if layers is None else layers["first_drifting_layer"],
               "kiln_seconds": kiln_seconds, "hf_seconds": hf_seconds, "hf_load_seconds": hf_load_seconds}
    print(_report(results, layers, summary, llm.tokenizer, args))
    if args.output_json:
        write_json(args.output_json, {
            "command": "parity", "engine_dir": str(args.engine_dir), "hf_model_dir": str(args.hf_model_dir),
            "dtype": dtype, "prompts_source": args.prompts, "max_tokens": args.max_tokens, "top_k": args.top_k,
            "tolerance": args.tolerance, "summary": summary, "prompts": results, "layers": layers})
    return 0


def _report(results: list[dict], layers: dict | None, summary: dict, tokenizer, args) -> str:
    """The one-screen report: a row per prompt, the verdict, the layer table when computed."""
    rows = []
    for r in results:
        d = r["divergence"]
        row = [r["index"], len(r["prompt_token_ids"])]
        if d is None:
            row += ["identical", "-", "-", "-", "-", "-"]
        else:
            both = "yes" if d["kiln_token_in_hf_top_k"] and d["hf_token_in_kiln_top_k"] else "no"
            row += [f"diverged at {d['position']}", _token(tokenizer, d["kiln_token"]), _token(tokenizer, d["hf_token"]),
                    both, _sci(d["kiln_gap"]), _sci(d["hf_gap"])]
        rows.append(row + [_sci(r["relative_logit_diff"]), r["verdict"]])
    lines = [format_table(["prompt", "tokens", "greedy tokens", "kiln token", "HF token", f"both in top-{args.top_k}",
                           "kiln gap", "HF gap", "logit diff (rel)", "verdict"], rows)]
    lines.append(f"verdict: {summary['verdict']} ({summary['identical']} identical, {summary['top_k_swaps']} "
                 f"top-k swaps, {summary['mismatches']} mismatches of {summary['prompts']} prompts; "
                 f"{args.max_tokens} greedy tokens each; largest relative logit diff "
                 f"{summary['max_relative_logit_diff']:.2e}, tolerance {args.tolerance:g})")
    if layers is not None:
        lines.append("")
        lines.append(f"each layer fed HF's input on prompt {layers['prompt_index']} ({layers['num_tokens']} tokens); "
                     "relative = ||kiln - HF|| / ||HF layer update||:")
        shown = _layer_rows_to_show(layers["rows"])
        table = [[row["label"], _sci(row["max_abs_diff"]), _sci(row["relative_diff"]), "yes" if row["drifts"] else ""]
                 if row is not None else ["...", "", "", ""] for row in shown]
        lines.append(format_table(["layer", "max |diff|", "relative", "drifts"], table))
        if layers["first_drifting_label"] is None:
            lines.append("no layer drifts beyond the tolerance on this prompt: the difference arises in the "
                         "logits or in decoding")
        else:
            lines.append(f"first drifting layer: {layers['first_drifting_label']} "
                         f"(of {layers['num_layers']} layers, counted from 0)")
    return "\n".join(lines)


def _layer_rows_to_show(rows: list[dict], most: int = 12) -> list[dict | None]:
    """The rows of the layer table that fit one screen: all of a small model's; otherwise the
    first two, two either side of the first drifting layer and the last (None marks a gap)."""
    if len(rows) <= most:
        return rows
    first = next((i for i, r in enumerate(rows) if r["drifts"]), None)
    keep = {0, 1, len(rows) - 1}
    if first is not None:
        keep |= set(range(max(first - 2, 0), min(first + 3, len(rows))))
    shown: list[dict | None] = []
    for i in sorted(keep):
        if shown and i - 1 not in keep:
            shown.append(None)
        shown.append(rows[i])
    return shown
