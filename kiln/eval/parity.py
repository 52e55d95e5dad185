"""``kiln eval parity``: kiln beside Hugging Face on the same prompts, down to the first layer that drifts.

Three checks per prompt, each cheaper to read than the next:

1. greedy tokens of both, and the first-divergence rule at the first differing position: is
   each side's token in the other's top-k there, and how far apart are the two candidates'
   log-probs on each side (a near-tie swap is numerics; a token outside the top-k is a bug);
2. the largest prompt-logit difference, relative to the largest HF logit, against --tolerance;
3. when either check fails, every layer in isolation on the prompt plus the tokens both sides
   agreed on: kiln's layer ``i`` is fed HF's input to layer ``i`` (``output_hidden_states``)
   and its output is compared with HF's, relative to the size of the layer's own update
   (``HF output - HF input``). Errors do not accumulate from layer to layer and the residual
   stream's outlier channels do not hide them, so the first layer beyond --tolerance is the
   one that computes differently.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.data.sharegpt import first_turns
from kiln.data.texts import jsonl_records
from kiln.errors import ConfigError
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import chat_prompt_ids

DEFAULT_SAMPLES = 8
MAX_TOP_K = 20  # SamplingParams.logprobs' limit
# --tolerance by engine dtype: float32 agrees with HF to ~1e-5; bf16 / fp16 rounding alone moves
# logits by a few 1e-2 (tests/models/test_bf16.py bounds it at 3e-2 of the logit scale).
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


@dataclass
class Prompt:
    """A prompt as given: plain text, or a user message rendered with the chat template."""

    text: str
    chat: bool = False


# -- inputs ------------------------------------------------------------------------------------

def load_prompts(spec: str, max_samples: int | None) -> list[Prompt]:
    """The prompts of ``--prompts``: a ``.jsonl`` of {"prompt"}, a text file (one per line), or
    'sharegpt' (first human turns, as chat messages), the first ``max_samples`` of them."""
    limit = DEFAULT_SAMPLES if max_samples is None else max_samples
    if limit < 1:
        raise ConfigError(f"--max_samples must be >= 1, got {max_samples}")
    if spec == "sharegpt":

        return [Prompt(human, chat=True) for human, _ in first_turns(limit)]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file (give a text or .jsonl file, or 'sharegpt')")
    prompts = []
    if path.suffix == ".jsonl":
        for number, record in jsonl_records(path, "--prompts"):
            text = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f"--prompts {path} line {number}: expected an object with a non-empty "
                                  "string \"prompt\"")
            prompts.append(Prompt(text))
    else:
        with open(path, encoding="utf-8") as f:
            prompts = [Prompt(line.rstrip("\r\n")) for line in f if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts")
    return prompts[:limit]


def encode_prompts(tokenizer, prompts: list[Prompt], limit: int) -> list[list[int]]:
    """Token ids of each prompt (chat ones through the template when the tokenizer has one), cut
    to ``limit`` tokens."""
    encoded = []
    for p in prompts:
        if p.chat and getattr(tokenizer, "chat_template", None):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": p.text}])
        else:
            ids = tokenizer(p.text)["input_ids"]
        encoded.append(ids[:limit])
    return encoded


# -- kiln ----------------------------------------------------------------------------------------

def kiln_greedy(llm, prompts: list[list[int]], max_tokens: int, top_k: int) -> list[tuple[list[int], list[dict]]]:
    """(tokens, per-token {id: logprob} of the top-k and the chosen token) of greedy generation."""
    # ignore_eos: both sides generate exactly max_tokens (HF is run without an end id too)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=top_k)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in llm.generate(prompts, params)]


@torch.inference_mode()
def kiln_prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of the prompt from the runtime's context logits
    (one packed prefill step, or its chunks)."""
    request = llm.core.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), None,
                                   return_context_logits=True)
    while not request.is_finished:
        llm.core.step()
    return torch.cat(request.context_logits).float()


@torch.inference_mode()
def kiln_layer_outputs(llm, ids: list[int], inputs: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """kiln's own embeddings of ``ids``, then the output of each layer ``i`` given ``inputs[i]``
    (HF's input to that layer) instead of kiln's, and the last of them through the final norm
    (None without one); float32 ``[len(ids), hidden]``."""
    transformer = llm.engine.model.transformer
    layers = [transformer.layers[key] for key in sorted(transformer.layers, key=int)]
    embeddings: list[torch.Tensor] = []
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]
    consumed = [0] * len(layers)  # tokens each layer has taken so far (a long prompt runs in chunks)

    def substitute(i: int, args: tuple) -> tuple:
        hidden = args[0]
        if i == 0:
            embeddings.append(hidden.detach().float().clone())
        n = hidden.shape[0]
        fed = inputs[i][consumed[i]:consumed[i] + n].to(hidden.dtype)
        consumed[i] += n
        return (fed, *args[1:])

    def keep(i: int, out) -> None:
        out = out[0] if isinstance(out, tuple) else out
        outputs[i].append(out.detach().float().clone())

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda module, args, i=i: substitute(i, args)))
        handles.append(layer.register_forward_hook(lambda module, args, out, i=i: keep(i, out)))
    try:
        kiln_prompt_logits(llm, ids)  # one request on an idle engine: its prefill chunks are all that runs
    finally:
        for handle in handles:
            handle.remove()
    states = [torch.cat(chunks) for chunks in outputs]
    normed = transformer.ln_f(states[-1].to(transformer.ln_f.weight.dtype)).float() \
        if hasattr(transformer, "ln_f") else None
    return torch.cat(embeddings), states, normed


# -- Hugging Face --------------------------------------------------------------------------------

@torch.inference_mode()
def hf_greedy(hf, ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """(greedy tokens, full log-prob rows per generated token, float32 prompt logits) from
    step-by-step forward passes with HF's KV cache; no generation config (penalties...) applies."""
    out = hf(input_ids=torch.tensor([ids]), use_cache=True)
    prompt_logits = out.logits[0].float()
    logits, past = prompt_logits[-1], out.past_key_values
    tokens, rows = [], []
    for step in range(max_tokens):
        logprobs = logits.log_softmax(-1)
        token = int(logprobs.argmax())
        tokens.append(token)
        rows.append(logprobs)
        if step + 1 < max_tokens:
            out = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1].float(), out.past_key_values
    return tokens, rows, prompt_logits


@torch.inference_mode()
def hf_hidden_states(hf, ids: list[int]) -> tuple[list[torch.Tensor], bool]:
    """(HF's hidden states: the embeddings, then after each layer, float32 ``[len(ids), hidden]``;
    whether its last entry is after the final norm, as transformers 5 records it for LMs)."""
    out = hf.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    states = [h[0].float() for h in out.hidden_states]
    return states, bool(torch.equal(out.hidden_states[-1], out.last_hidden_state))


# -- comparison ----------------------------------------------------------------------------------

def relative_max_diff(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max |ours - ref|, max |ref|, their ratio)."""
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    return diff, scale, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def first_divergence(kiln_tokens: list[int], kiln_logprobs: list[dict], hf_tokens: list[int],
                     hf_rows: list[torch.Tensor], top_k: int) -> dict | None:
    """None when the tokens are identical; else the first differing position, both tokens,
    whether each is in the other side's top-k there, and the log-prob gap of the two candidates
    on each side (kiln's only when HF's token is among kiln's reported top-k)."""
    p = next((i for i, (a, b) in enumerate(zip(kiln_tokens, hf_tokens)) if a != b), None)
    if p is None:
        return None
    ours, theirs = kiln_tokens[p], hf_tokens[p]
    kiln_top = kiln_logprobs[p]
    kiln_top_ids = sorted(kiln_top, key=kiln_top.get, reverse=True)[:top_k]
    hf_row = hf_rows[p]
    hf_top_ids = hf_row.topk(top_k).indices.tolist()
    return {"position": p, "kiln_token": ours, "hf_token": theirs,
            "kiln_token_in_hf_top_k": ours in hf_top_ids, "hf_token_in_kiln_top_k": theirs in kiln_top_ids,
            "kiln_gap": abs(kiln_top[ours] - kiln_top[theirs]) if theirs in kiln_top else None,
            "hf_gap": abs(hf_row[ours] - hf_row[theirs]).item(),
            "kiln_top_k": {str(t): kiln_top[t] for t in kiln_top_ids},
            "hf_top_k": {str(t): hf_row[t].item() for t in hf_top_ids}}


def compare_layers(kiln_embeddings: torch.Tensor, kiln_outputs: list[torch.Tensor], kiln_normed: torch.Tensor | None,
                   hf_states: list[torch.Tensor], hf_last_normed: bool, tolerance: float) -> dict:
    """One row for the embeddings and one per layer fed HF's input: max |kiln - HF| and the
    relative difference ``||kiln - HF|| / ||HF update||`` that decides (for the embeddings and
    a row after the final norm, relative to ``||HF||``); the first row beyond ``tolerance``."""
    if len(kiln_outputs) + 1 != len(hf_states):
        raise ConfigError(f"kiln has {len(kiln_outputs)} layers, the HF model {len(hf_states) - 1}: "
                          "--hf_model_dir is not the engine's model")
    num_layers = len(kiln_outputs)
    rows = [_layer_row(-1, "embeddings", kiln_embeddings, hf_states[0], hf_states[0].norm().item(), tolerance)]
    for i, ours in enumerate(kiln_outputs):
        ref, label = hf_states[i + 1], str(i)
        scale = (ref - hf_states[i]).norm().item()  # the size of this layer's own update
        if i == num_layers - 1 and hf_last_normed and kiln_normed is not None:
            ours, label = kiln_normed, f"{i} + final norm"  # HF's last entry is after its final norm
            scale = ref.norm().item()
        rows.append(_layer_row(i, label, ours, ref, scale, tolerance))
    first = next((r for r in rows if r["drifts"]), None)
    return {"num_layers": num_layers, "hf_last_entry_after_final_norm": hf_last_normed, "rows": rows,
            "first_drifting_layer": None if first is None else first["layer"],
            "first_drifting_label": None if first is None else first["label"]}


def _layer_row(layer: int, label: str, ours: torch.Tensor, ref: torch.Tensor, scale: float, tolerance: float) -> dict:
    diff = (ours - ref).norm().item()
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return {"layer": layer, "label": label, "max_abs_diff": (ours - ref).abs().max().item(),
            "relative_diff": rel, "drifts": rel > tolerance}


def prompt_verdict(divergence: dict | None, logits_equal: bool) -> str:
    """'identical', 'top-k swap' (a divergence both sides rank in their top-k) or 'mismatch'."""
    if not logits_equal:
        return "mismatch"
    if divergence is None:
        return "identical"
    both = divergence["kiln_token_in_hf_top_k"] and divergence["hf_token_in_kiln_top_k"]
    return "top-k swap" if both else "mismatch"


# -- the command ---------------------------------------------------------------------------------
