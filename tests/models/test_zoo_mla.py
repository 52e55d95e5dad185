"""DeepSeek-V2 (multi-head latent attention over a latent KV cache, DeepSeekMoE) against Hugging
Face on tiny random models: V2-Lite's direct q_proj, V2's low-rank q (q_a_proj -> q_a_layernorm ->
q_b_proj), and YaRN with mscale_all_dim plus group-limited routing. Each has a dense first layer,
8 routed experts top-2 (decisive routers) with scaled weights and a shared expert.

Beside HF parity: the absorbed decode (query folded into latent space, read straight from the
latent cache) equals the unabsorbed computation (latents expanded into per-head K/V), on both
attention backends; chunked prefill reads its context back from the latent cache; n-gram
speculation and prefix caching keep HF's greedy tokens; tp=2 ranks' partial outputs sum to the
whole; the cache holds kv_lora_rank + qk_rope_head_dim values per token and layer.
"""
from __future__ import annotations

import json
import shutil
from typing import Callable

import pytest
import torch

from kiln import distributed
from kiln.build import build_engine, resolve_build_config
from kiln.checkpoint.format import read_config
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.deepseek_v2 import DeepseekV2ForCausalLM
from kiln.models.native_decode import supports_native_decode
from kiln.runtime.engine import Engine
from kiln.runtime.model_runner import ModelRunner
from kiln.step.attention import NativePagedAttention, TorchPagedAttention
from kiln.step.kv_cache import allocate_kv_cache, cache_value_size, kv_bytes_per_token
from kiln.step.metadata import AttentionMetadata
from tests.models.zoo import built_fixture, hf_reference_fixture, parity_tests
from tests.utils.compare import hf_greedy, kiln_greedy
from tests.utils.tiny_moe_models import make_deepseek_v2

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}

# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "deepseek-v2-lite": (make_deepseek_v2, dict(), {}),
    "deepseek-v2-q-lora": (make_deepseek_v2, dict(q_lora_rank=48, layers=3, seed=1), {}),
    "deepseek-v2-yarn-groups": (make_deepseek_v2, dict(layers=3, rope_parameters=YARN, n_group=4, topk_group=2,
                                                       topk_method="group_limited_greedy", seed=2), {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()


test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def test_chunked_prefill_reads_context_from_the_latent_cache(built, hf_reference) -> None:
    """An 8-token step budget cuts the prompts into chunks: each chunk after the first expands its
    context from the latent cache (unabsorbed), then decoding reads it absorbed; HF's greedy tokens."""
    prompts, expected = hf_reference("deepseek-v2-lite")
    steps: list = []
    assert kiln_greedy(built("deepseek-v2-lite").engine_dir, prompts, len(expected[0]), max_num_tokens=8,
                       steps=steps) == expected
    assert any(n < 20 and not completes for step in steps for _, n, completes in step)  # chunked indeed


def test_speculation_and_prefix_caching_keep_hf_greedy(built, tmp_path) -> None:
    """Through LLM (4-token blocks): n-gram proposals verified as one-token rows over the latent
    cache (absorbed, the rows of one sequence read together), and prompts whose blocks come from
    the prefix cache the second time; HF's greedy tokens both times."""
    from kiln import LLM
    from kiln.runtime.sampling_params import SamplingParams

    case = built("deepseek-v2-lite")
    checkpoint = case.work_dir / "checkpoint"
    engine = build_engine(checkpoint, tmp_path / "engine", resolve_build_config(read_config(checkpoint),
                                                                                tokens_per_block=4), progress=False)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23, 20, 21, 22, 23, 20], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
    expected = hf_greedy(case.hf, prompts, 20)
    llm = LLM(engine, skip_tokenizer_init=True, enable_prefix_caching=True, progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.core.stats.spec.num_accepted_tokens > 0 and llm.core.pool.num_hit_blocks > 0


def _attention_rows(attn, hidden, lens, steps, backend, block_size=4) -> list[torch.Tensor]:
    """Latent attention ``attn`` over sequences of ``lens`` tokens (inputs ``hidden`` packed), run as
    ``steps`` (each a list of how many tokens of each sequence it computes); the outputs by sequence."""
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // block_size))))
        first += len(tables[-1])
    cache = allocate_kv_cache(1, first, block_size, 1, attn.head_size, hidden.dtype, value_size=0)[0]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    done, outs = [0] * len(lens), [[] for _ in lens]
    for step in steps:
        rows = [torch.arange(starts[i] + done[i], starts[i] + done[i] + q) for i, q in enumerate(step)]
        md = AttentionMetadata.build(backend, list(step), [d + q for d, q in zip(done, step)], tables, block_size)
        out = attn(hidden[torch.cat(rows)], torch.cat([r - s for r, s in zip(rows, starts)]), md, cache)
        for i, part in enumerate(out.split(list(step))):
            outs[i].append(part)
        done = [d + q for d, q in zip(done, step)]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("backend", [TorchPagedAttention, NativePagedAttention])
@torch.inference_mode()
def test_absorbed_decode_equals_unabsorbed(built, backend) -> None:
    """Three sequences (14, 5, 9 tokens, 4-token blocks): their last token decoded through the
    absorbed path (latent-space query over the cache rows, W_UV after) equals the same token in
    one whole-prompt step (latents expanded into per-head K/V); so does a prompt computed in two
    chunks, the second reading its context back from the latent cache."""
    attn = Engine(built("deepseek-v2-q-lora").engine_dir).model.transformer.layers["1"].attention
    lens = [14, 5, 9]
    hidden = torch.randn(sum(lens), attn.dense.out_features, generator=torch.Generator().manual_seed(0))
    whole = _attention_rows(attn, hidden, lens, [lens], backend())
    decoded = _attention_rows(attn, hidden, lens, [[n - 1 for n in lens], [1, 1, 1]], backend())
    chunked = _attention_rows(attn, hidden, lens, [[6, 3, 2], [8, 2, 7]], backend())
    for w, d, c in zip(whole, decoded, chunked):
        torch.testing.assert_close(d[-1], w[-1], rtol=1e-5, atol=1e-6)  # absorbed == unabsorbed
        torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-6)
    # The query folded into latent space scores the cache rows as the expanded keys score.
    q_nope, q_pe, latent = attn.project(hidden[:3], torch.arange(3), AttentionMetadata.build(
        backend(), [3], [3], [[0]], 4))
    k, _ = attn.expand(latent)
    scores = torch.einsum("thd,shd->ths", torch.cat([q_nope, q_pe], -1), k)
    torch.testing.assert_close(torch.einsum("thd,sd->ths", attn.absorb_query(q_nope, q_pe), latent), scores,
                               rtol=1e-5, atol=1e-5)


def test_latent_cache_bytes_per_token(built) -> None:
    """The runner's cache holds (kv_lora_rank + qk_rope_head_dim) values per token and layer, K only
    (V is empty); at DeepSeek-V2-Lite's shape that is under 1/8 of the K/V a GQA cache of its
    heads would hold (num_heads * (qk_nope + qk_rope + v_head)). The native decode step refuses it."""
    engine = Engine(built("deepseek-v2-lite").engine_dir)
    runner = ModelRunner(engine, num_blocks=3)
    tokens = 3 * runner.block_size
    for k, v in runner.kv_caches:
        assert v.numel() == 0 and (k.nbytes + v.nbytes) // tokens == (32 + 8) * 4
    attn = engine.model.transformer.layers["0"].attention
    assert kv_bytes_per_token(2, attn.num_kv_heads, attn.head_size, torch.float32, cache_value_size(attn)) == 2 * 40 * 4
    assert not supports_native_decode(engine.model)

    lite = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
            "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1, "torch_dtype": "bfloat16",
            "max_position_embeddings": 163840, "rope_scaling": {
                "type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                "beta_slow": 1, "original_max_position_embeddings": 4096}}
    config = DeepseekV2ForCausalLM.config_from_hf(lite, None, Mapping())
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(config)
    attn = model.transformer.layers["3"].attention
    per_token = kv_bytes_per_token(27, attn.num_kv_heads, attn.head_size, torch.bfloat16, cache_value_size(attn))
    assert per_token == 27 * (512 + 64) * 2  # 31,104 bytes
    gqa = 27 * 16 * (128 + 64 + 128) * 2  # 276,480 bytes
    assert per_token * 8 <= gqa
    k, v = allocate_kv_cache(27, 1, 16, attn.num_kv_heads, attn.head_size, torch.bfloat16,
                             value_size=cache_value_size(attn))[0]
    assert k.shape == (1, 1, 16, 576) and v.numel() == 0
    assert attn.scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)


def test_tp2_attention_partials_sum_to_the_whole(built, tmp_path, monkeypatch) -> None:
    """tp=2: each rank holds half the heads (q_proj, kv_b_proj rows; o_proj columns) and the whole
    latent projection; the ranks' partial attention outputs summed are the single-rank output."""
    case = built("deepseek-v2-lite")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, dtype="float32", progress=False)
    monkeypatch.setattr(distributed, "all_reduce", lambda x, tp_size: x)
    whole = DecoderModelForCausalLM.from_checkpoint(case.work_dir / "checkpoint").transformer.layers["1"].attention
    ranks = [DecoderModelForCausalLM.from_checkpoint(checkpoint, r).transformer.layers["1"].attention for r in (0, 1)]
    assert ranks[0].kv_b_proj.weight.shape == (2 * (16 + 16), 32) and ranks[0].num_heads == 2
    hidden = torch.randn(11, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        parts = [_attention_rows(a, hidden, [11], [[7], [4]], TorchPagedAttention())[0] for a in ranks]
        torch.testing.assert_close(parts[0] + parts[1], _attention_rows(whole, hidden, [11], [[11]],
                                                                         TorchPagedAttention())[0],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field, value, match", [
    ("norm_topk_prob", True, "norm_topk_prob true is not supported"),
    ("topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported"),
    ("moe_layer_freq", 2, "moe_layer_freq 2 is not supported"),
    ("n_group", 3, "n_group must divide n_routed_experts"),
])
def test_unsupported_configs_name_the_field(built, tmp_path, field: str, value, match: str) -> None:
    hf_dir = tmp_path / "hf"
    shutil.copytree(built("deepseek-v2-yarn-groups").hf_dir, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        convert_checkpoint(hf_dir, tmp_path / "out", progress=False)
