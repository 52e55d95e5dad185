"""Run kiln engines and Hugging Face models side by side on the same token ids."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from kiln.runtime.block_pool import BlockPool
from kiln.runtime.engine import Engine
from kiln.step.metadata import AttentionMetadata
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence
from kiln.runtime.state_slots import StateSlots


def fresh_state_slots(runner: ModelRunner, num_seqs: int) -> list[tuple[int, int]] | None:
    """State slots (read, write) for ``num_seqs`` sequences' first step on ``runner`` (a hybrid
    model's), or None for a model without recurrent layers."""
    return [(2 * i, 2 * i + 1) for i in range(num_seqs)] if runner.num_state_slots else None


@torch.inference_mode()
def kiln_prompt_logits(engine_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len, vocab]`` of one prompt run as a single packed step."""
    engine = Engine(engine_dir)
    n = len(token_ids)
    runner = ModelRunner(engine, num_blocks=math.ceil(n / engine.build_config.tokens_per_block))
    md = AttentionMetadata.build(runner.backend, [n], [n], [list(range(runner.num_blocks))], runner.block_size,
                                 state_slots=fresh_state_slots(runner, 1))
    hidden = engine.model(torch.tensor(token_ids), torch.arange(n), md, runner.kv_caches)
    return engine.model.compute_logits(hidden)


@torch.inference_mode()
def kiln_batch_prompt_logits(engine_dir: str | Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits ``[len, vocab]`` of each prompt, all packed into one step."""
    engine = Engine(engine_dir)
    block_size = engine.build_config.tokens_per_block
    tables, next_block = [], 0
    for prompt in prompts:
        blocks = math.ceil(len(prompt) / block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    runner = ModelRunner(engine, num_blocks=next_block, max_num_seqs=len(prompts))
    lens = [len(p) for p in prompts]
    md = AttentionMetadata.build(runner.backend, lens, lens, tables, runner.block_size,
                                 state_slots=fresh_state_slots(runner, len(prompts)))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    logits = engine.model.compute_logits(engine.model(ids, positions, md, runner.kv_caches))
    return list(logits.split(lens))


def kiln_greedy(engine_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
                max_num_tokens: int | None = None, steps: list | None = None) -> list[list[int]]:
    """Greedy tokens for all ``prompts`` generated together by one Scheduler.

    ``max_num_tokens`` is the scheduler's per-step token budget (default: the engine's).
    When ``steps`` is a list, each step's ``[(seq_id, num_tokens, completes), ...]`` is appended.
    """
    engine = Engine(engine_dir)
    bc = engine.build_config
    block_size = bc.tokens_per_block
    num_blocks = sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts)
    runner = ModelRunner(engine, num_blocks, max_num_seqs=len(prompts))
    scheduler = Scheduler(BlockPool(num_blocks), block_size, max_num_seqs=len(prompts),
                          max_num_tokens=max_num_tokens or bc.max_num_tokens,
                          states=StateSlots(runner.num_state_slots) if runner.num_state_slots else None)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    seqs = [Sequence(i, list(p), params, end_id=None, max_seq_len=bc.max_seq_len) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(sum(len(p) for p in prompts) + max_new_tokens * len(prompts) + 1):
        if not scheduler.has_unfinished:
            break
        out = scheduler.schedule()
        if steps is not None:
            steps.append([(c.seq.seq_id, c.num_tokens, c.completes) for c in out.chunks])
        scheduler.update(out, runner.execute(out))
    assert not scheduler.has_unfinished, "generation did not finish within the expected number of steps"
    return [seq.output_token_ids for seq in seqs]


@torch.inference_mode()
def hf_greedy(hf_model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Exactly ``n`` greedy new tokens per prompt from HF ``generate``, one prompt at a time.

    ``eos_token_id=None`` matches kiln's ``ignore_eos``: with an eos id set, ``min_new_tokens``
    would forbid eos (mask its logit) instead of letting greedy pick it.
    """
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
                                max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """``max |ours - ref| <= rel * max |ref|`` (and equal shapes)."""
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3e} > {rel} * max|ref| ({scale:.3e})"


def resave_as_torch_bin(hf_dir: str | Path, name: str = "pytorch_model.bin") -> Path:
    """Replace the single ``model.safetensors`` of ``hf_dir`` by a pickled state dict ``name``.

    transformers 5 always writes safetensors (``safe_serialization=False`` is silently
    ignored), so tests make their ``.bin`` / ``.pth`` checkpoints with this.
    """
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    st = hf_dir / "model.safetensors"
    torch.save(load_file(st), hf_dir / name)
    st.unlink()
    return hf_dir / name


# -- the real model: vLLM's first-divergence rule --------------------------------------------

NEAR_TIE = 1e-3


@torch.inference_mode()
def llm_next_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """kiln's next-token log-probs after ``token_ids`` (one packed step on blocks 0..n of an idle LLM)."""
    from kiln.step.metadata import AttentionMetadata

    runner = llm.core.runner
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    md = AttentionMetadata.build(runner.backend, [len(token_ids)], [len(token_ids)], [blocks], runner.block_size,
                                 state_slots=fresh_state_slots(runner, 1))
    hidden = llm.engine.model(torch.tensor(token_ids), torch.arange(len(token_ids)), md, runner.kv_caches)
    return llm.engine.model.compute_logits(hidden[-1:])[0].float().log_softmax(-1)


@torch.inference_mode()
def hf_next_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids])).logits[0, -1].float().log_softmax(-1)


def assert_near_tie_divergence(llm, hf, prompt: list[int], ours: list[int], theirs: list[int]) -> int:
    """Assert the first difference of two generations is a genuine near-tie; return its position.

    At the first differing position each side's token must be in the other's top-2 and the
    two tokens' log-probs must differ by less than ``NEAR_TIE`` on both sides.
    """
    p = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert p < min(len(ours), len(theirs)), f"one output is a prefix of the other: {ours} vs {theirs}"
    prefix = prompt + ours[:p]
    ours_lp, hf_lp = llm_next_logprobs(llm, prefix), hf_next_logprobs(hf, prefix)
    a, b = ours[p], theirs[p]
    assert a in hf_lp.topk(2).indices.tolist() and b in ours_lp.topk(2).indices.tolist(), \
        f"outputs part at token {p} ({a} vs HF {b}), not a top-2 swap"
    assert abs(ours_lp[a] - ours_lp[b]) < NEAR_TIE and abs(hf_lp[a] - hf_lp[b]) < NEAR_TIE, \
        f"outputs part at token {p}, not a near-tie (kiln gap {ours_lp[a] - ours_lp[b]:.2e}, " \
        f"HF gap {hf_lp[a] - hf_lp[b]:.2e})"
    return p
