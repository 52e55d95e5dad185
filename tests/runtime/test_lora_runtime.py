"""LoRA adapters applied by the runtime against Hugging Face PEFT on the same base model."""
from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.checkpoint.lora import pack_lora_tensors, parse_lora_tensors
from kiln.checkpoint.peft import peft_to_lora_modules
from kiln.layers.lora import LoraAdapter
from kiln.runtime.engine import Engine
from kiln.models.lora_targets import lora_module_shapes
from kiln.runtime.engine_core import EngineCore
from tests.conftest import convert_and_build
from tests.utils.tiny_models import make_llama

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 42, 99, 3, 64, 8, 120, 33]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama: its HF directory and a float32 kiln engine of it."""
    root = tmp_path_factory.mktemp("lora")
    make_llama(root / "hf", hidden=64, layers=2, num_heads=4, num_kv_heads=2, intermediate=96)
    engine_dir = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4}, dtype="float32")
    return root, Engine(engine_dir)


def _peft(root, targets: list[str], rank: int, seed: int, **options):
    """The base model with a PEFT adapter of random, non-zero A and B (and, DoRA, magnitudes off
    the base's norms); and the adapter for kiln (converted, DoRA normalized against the base,
    packed into the reference tensors and parsed back, as a request carries it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False, **options))
    # PEFT's random init gives B entries ~0.5: scaled down so the adapter nudges the model
    # (as a trained one does) instead of drowning it.
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
            if "lora_magnitude_vector" in name:  # PEFT starts it at the norms: DoRA would equal LoRA
                p.mul_(1 + 0.2 * torch.randn_like(p))
    adapter_dir = root / f"adapter-{'-'.join(targets)}-{rank}-{seed}{'-dora' if options.get('use_dora') else ''}"
    peft_model.save_pretrained(adapter_dir)
    weights, config = pack_lora_tensors(peft_to_lora_modules(adapter_dir, base_model=root / "hf"))
    return peft_model.eval(), adapter_dir, weights, config


def _adapter(engine: Engine, weights, config) -> LoraAdapter:
    shapes = lora_module_shapes(engine.config)
    return LoraAdapter(parse_lora_tensors(weights, config, shapes, engine.config.num_hidden_layers, max_rank=64))


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's last-position logits, recomputing the whole sequence."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            last = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt):], torch.stack(logits)


def _kiln_greedy(engine: Engine, prompts: list[list[int]], adapters: list, prefix_caching: bool = False):
    core = EngineCore(engine, max_num_seqs=len(prompts), num_blocks=64, enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    requests = [core.add_request(p, params, end_id=None, return_generation_logits=True, lora=a)
                for p, a in zip(prompts, adapters)]
    while core.has_unfinished:
        core.step()
    return [(r.seqs[0].output_token_ids, torch.stack([s[0] for s in r.generation_logits])) for r in requests]


@pytest.mark.parametrize("targets, rank", [([t], 8) for t in ALL] + [(ALL, 1), (ALL, 8), (ALL, 16)],
                         ids=[f"{t}-r8" for t in ALL] + ["all-r1", "all-r8", "all-r16"])
def test_lora_matches_peft(base, targets, rank):
    root, engine = base
    peft_model, _, weights, config = _peft(root, targets, rank, seed=rank)
    expected_tokens, expected_logits = _hf_greedy(peft_model, PROMPT)
    with peft_model.disable_adapter():
        base_tokens, base_logits = _hf_greedy(peft_model, PROMPT)
    assert not torch.allclose(expected_logits, base_logits, atol=1e-3)  # the adapter changes the output
    ((tokens, logits),) = _kiln_greedy(engine, [PROMPT], [_adapter(engine, weights, config)])
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_a_batch_mixing_adapters_gives_each_sequence_its_own_output(base):
    """Three LoRA adapters, a DoRA one and none in one batch."""
    root, engine = base
    adapters = [_adapter(engine, *_peft(root, targets, rank, seed=10 + i, use_dora=dora)[2:])
                for i, (targets, rank, dora) in enumerate([(["q_proj", "v_proj"], 4, False), (ALL, 8, False),
                                                           (["down_proj"], 2, False), (ALL, 4, True)])]
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], PROMPT[1:7], PROMPT[::-1]]
    mixed = _kiln_greedy(engine, prompts, adapters + [None])
    for prompt, adapter, (tokens, logits) in zip(prompts, adapters + [None], mixed):
        ((alone_tokens, alone_logits),) = _kiln_greedy(engine, [prompt], [adapter])
        assert tokens == alone_tokens
        torch.testing.assert_close(logits, alone_logits, atol=1e-5, rtol=1e-5)


DORA_CASES = [(["q_proj", "v_proj"], 8), (["o_proj", "down_proj"], 4), (["gate_proj", "up_proj", "k_proj"], 2),
              (ALL, 16)]


@pytest.mark.parametrize("targets, rank", DORA_CASES, ids=["qv-r8", "o-down-r4", "gate-up-k-r2", "all-r16"])
def test_dora_matches_peft(base, targets, rank):
    root, engine = base
    peft_model, _, weights, config = _peft(root, targets, rank, seed=20 + rank, use_dora=True)
    assert config.shape[1] == 4 and bool(config[:, 3].all())
    expected_tokens, expected_logits = _hf_greedy(peft_model, PROMPT)
    ((tokens, logits),) = _kiln_greedy(engine, [PROMPT], [_adapter(engine, weights, config)])
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_dora_keeps_the_bias_outside_the_magnitude(tmp_path):
    """PEFT scales W x + B A x and adds the bias after; a model with q/k/v/o biases checks it."""
    make_llama(tmp_path / "hf", hidden=64, layers=2, num_heads=4, num_kv_heads=2, intermediate=96, qkv_bias=True)
    engine = Engine(convert_and_build(tmp_path / "hf", tmp_path / "kiln", {"tokens_per_block": 4}, dtype="float32"))
    peft_model, _, weights, config = _peft(tmp_path, ALL, 4, seed=5, use_dora=True)
    expected_tokens, expected_logits = _hf_greedy(peft_model, PROMPT)
    ((tokens, logits),) = _kiln_greedy(engine, [PROMPT], [_adapter(engine, weights, config)])
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_dora_rows_may_not_overlap_in_one_linear(base):
    from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule
    from kiln.errors import CheckpointError

    _, engine = base
    hidden, q = 64, 64
    qkv = LoraModule(LORA_MODULE_IDS["attn_qkv"], 0, torch.randn(2, hidden), torch.randn(q + 2 * 32, 2))
    only_q = LoraModule(LORA_MODULE_IDS["attn_q"], 0, torch.randn(2, hidden), torch.randn(q, 2), torch.ones(q))
    weights, config = pack_lora_tensors([qkv, only_q])
    with pytest.raises(CheckpointError, match="rows 0 and 1: a DoRA row may not overlap .*layer 0: attn_qkv and attn_q"):
        _adapter(engine, weights, config)


def test_prefix_cache_never_shares_blocks_across_adapters(base):
    """One after another through one prefix cache: the base model's prompt blocks are not
    reused under an adapter (its K/V differ), while the same adapter's are."""
    root, engine = base
    adapter = _adapter(engine, *_peft(root, ALL, 4, seed=3)[2:])
    long_prompt = PROMPT * 3  # several full blocks of 4 tokens
    ((adapted_tokens, adapted_logits),) = _kiln_greedy(engine, [long_prompt], [adapter])
    core = EngineCore(engine, max_num_seqs=1, num_blocks=64, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    results = []
    for lora in (None, adapter, adapter):
        request = core.add_request(long_prompt, params, end_id=None, return_generation_logits=True, lora=lora)
        hits = core.pool.num_hit_blocks
        while core.has_unfinished:
            core.step()
        results.append((core.pool.num_hit_blocks - hits, request.seqs[0].output_token_ids,
                        torch.stack([g[0] for g in request.generation_logits])))
    (base_hits, _, _), (first_hits, tokens, logits), (second_hits, again, _) = results
    assert base_hits == 0 and first_hits == 0 and second_hits > 0
    assert tokens == again == adapted_tokens
    torch.testing.assert_close(logits, adapted_logits, atol=1e-5, rtol=1e-5)
