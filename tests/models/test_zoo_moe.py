"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) against Hugging Face on tiny random models.

Routers are given decisive weights (tests/utils/tiny_moe_models.py) so tokens really spread
over the experts; kiln must pick the same experts per token, weight them the same way and
match HF's float32 logits and greedy tokens. Both external expert layouts (one tensor per
expert, transformers' stacked ``gate_up_proj``) load, and tp=2 shards reassemble into HF's experts.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from safetensors import safe_open

from kiln.build import build_engine
from kiln.config import QuantConfig
from kiln.convert import convert_checkpoint
from kiln.errors import ConfigError
from kiln.layers.mlp import GatedMLP
from kiln.layers.moe import MixtureOfExperts
from kiln.models.base import DecoderModelForCausalLM
from kiln.models.native_decode import supports_native_decode
from kiln.runtime.engine import Engine
from tests.models.zoo import LOGIT_PROMPT_LENS, built_fixture, hf_reference_fixture, parity_tests, random_prompt
from tests.utils.compare import kiln_batch_prompt_logits, kiln_greedy
from tests.utils.tiny_moe_models import make_gpt_oss, make_mixtral, make_qwen2_moe, make_qwen3_moe

# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "mixtral": (make_mixtral, dict(experts=4, top_k=2, num_heads=4, num_kv_heads=2), {}),
    "mixtral-stacked": (make_mixtral, dict(experts=4, top_k=2, stacked=True, seed=1), {}),
    "qwen2-moe": (make_qwen2_moe, dict(experts=8, top_k=2, norm_topk_prob=False), {}),
    # layers 1 and 3 are sparse by the step, 3 is dense by mlp_only_layers: only layer 1 has experts
    "qwen2-moe-sparse-step": (make_qwen2_moe, dict(experts=4, top_k=2, layers=4, decoder_sparse_step=2,
                                                   mlp_only_layers=[3], norm_topk_prob=True, seed=2), {}),
    # no shared expert, q/k norms, top-3 of 8 renormalised; layer 1 dense by mlp_only_layers
    "qwen3-moe": (make_qwen3_moe, dict(seed=3), {}),
    # sinks, YaRN, alternating 8-token windows, biased router and experts, clamped SwiGLU, top-3 of 8
    "gpt-oss": (make_gpt_oss, dict(seed=4), {}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()


test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def _hf_moe_blocks(hf) -> dict[int, torch.nn.Module]:
    return {i: layer.mlp for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen2-moe-sparse-step", "qwen3-moe"])
def test_tokens_spread_over_experts_and_kiln_routes_like_hf(built, monkeypatch, name: str) -> None:
    """Across the prompts' tokens every MoE layer uses most of its experts, and kiln picks the
    same experts for each token (in the same order) as HF's router."""
    case = built(name)
    prompts = [random_prompt(n, case.hf.config.vocab_size, seed=i + 1) for i, n in enumerate(LOGIT_PROMPT_LENS)]
    hf_picks: dict[int, list[torch.Tensor]] = {i: [] for i in _hf_moe_blocks(case.hf)}
    hooks = [block.gate.register_forward_hook(lambda m, args, out, i=i: hf_picks[i].append(out[2]))
             for i, block in _hf_moe_blocks(case.hf).items()]
    try:
        with torch.no_grad():
            for prompt in prompts:
                case.hf(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()

    ours: list[torch.Tensor] = []
    route = MixtureOfExperts.route

    def recording_route(self, logits):
        weights, experts = route(self, logits)
        ours.append(experts.clone())
        return weights, experts

    monkeypatch.setattr(MixtureOfExperts, "route", recording_route)
    kiln_batch_prompt_logits(case.engine_dir, prompts)
    assert len(ours) == len(hf_picks) >= 1
    for ours_layer, (layer, picks) in zip(ours, sorted(hf_picks.items())):
        theirs = torch.cat(picks)
        num_experts = len(_hf_moe_blocks(case.hf)[layer].experts.down_proj)
        used = torch.bincount(theirs.flatten(), minlength=num_experts)
        assert (used > 0).sum() >= min(num_experts, 4), f"layer {layer}: experts used {used.tolist()}"
        assert used.max() < theirs.numel() // 2, f"layer {layer}: one expert takes most slots {used.tolist()}"
        assert torch.equal(ours_layer, theirs), f"layer {layer}: kiln's experts differ from HF's"


def test_layer_kinds_and_native_decode_refusal(built) -> None:
    """Qwen2-MoE's decoder_sparse_step and mlp_only_layers decide which layers have experts; the
    one-call native decode step refuses float experts and shared experts (its experts block
    takes weight-only quantized experts without a shared one: tests/models/test_native_decode.py)."""
    sparse = Engine(built("qwen2-moe-sparse-step").engine_dir).model
    kinds = [type(layer.mlp) for layer in sparse.transformer.layers.values()]
    assert kinds == [GatedMLP, MixtureOfExperts, GatedMLP, GatedMLP]
    moe = sparse.transformer.layers["1"].mlp
    assert moe.fused and moe.fused_fc.weight.shape == (4, 2 * 32, 64) and moe.proj.weight.shape == (4, 64, 32)
    assert moe.shared_expert is not None and moe.shared_expert_gate.weight.shape == (1, 64)
    assert not supports_native_decode(sparse)
    assert not supports_native_decode(Engine(built("mixtral").engine_dir).model)


def _rank_tensors(checkpoint, rank: int, prefix: str) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / f"rank{rank}.safetensors"), "pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


@pytest.mark.parametrize("name", ["mixtral", "mixtral-stacked", "qwen2-moe"])
def test_tp2_shards_reassemble_into_hf_experts(built, tmp_path, monkeypatch, name: str) -> None:
    """tp=2: each rank holds half of every expert's intermediate dim (fc/gate rows, proj
    columns), the router whole; the halves put back together are HF's experts, and the ranks'
    partial outputs summed by the block's one all-reduce are the single-rank output."""
    case = built(name)
    with safe_open(str(case.hf_dir / "model.safetensors"), "pt") as f:  # the layout the case stands for
        expected = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                    "mixtral-stacked": "model.layers.0.mlp.experts.gate_up_proj",
                    "qwen2-moe": "model.layers.0.mlp.experts.7.gate_proj.weight"}[name]
        stacked = any(k.endswith(".experts.gate_up_proj") for k in f.keys())
        assert expected in f.keys() and stacked == (name == "mixtral-stacked")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "tp2", tp_size=2, progress=False)
    block = case.hf.model.layers[0].mlp
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    inter = down.shape[2]
    ranks = [_rank_tensors(checkpoint, r, "transformer.layers.0.mlp.") for r in (0, 1)]
    for rank in ranks:
        assert rank["fc.weight"].shape == (down.shape[0], inter // 2, down.shape[1])
        assert torch.equal(rank["router.weight"], block.gate.weight.detach())
    assert torch.equal(torch.cat([r["fc.weight"] for r in ranks], dim=1), gate_up[:, :inter])
    assert torch.equal(torch.cat([r["gate.weight"] for r in ranks], dim=1), gate_up[:, inter:])
    assert torch.equal(torch.cat([r["proj.weight"] for r in ranks], dim=2), down)
    if name.startswith("qwen2"):
        shared = block.shared_expert
        assert torch.equal(torch.cat([r["shared_expert.fc.weight"] for r in ranks]), shared.gate_proj.weight.detach())
        assert torch.equal(torch.cat([r["shared_expert.proj.weight"] for r in ranks], dim=1),
                           shared.down_proj.weight.detach())
        assert torch.equal(ranks[1]["shared_expert_gate.weight"], block.shared_expert_gate.weight.detach())

    # Each rank's block output is a partial sum; one all-reduce (here: the sum) gives tp=1's output.
    import kiln.layers.moe as moe

    reduces: list[int] = []
    monkeypatch.setattr(moe.distributed, "all_reduce", lambda x, tp_size: reduces.append(tp_size) or x)
    whole = DecoderModelForCausalLM.from_checkpoint(case.work_dir / "checkpoint").transformer.layers["0"].mlp
    x = torch.randn(7, whole.hidden_size, generator=torch.Generator().manual_seed(0))
    partials = [DecoderModelForCausalLM.from_checkpoint(checkpoint, r).transformer.layers["0"].mlp(x) for r in (0, 1)]
    assert reduces == [2, 2]
    torch.testing.assert_close(partials[0] + partials[1], whole(x), rtol=1e-5, atol=1e-6)


def test_bf16_engine_stays_close_to_float32(built, tmp_path) -> None:
    """A bfloat16 Mixtral engine (experts through the bf16 kernels) gives logits within bf16
    noise of the float32 engine, and generates through the paged runtime."""
    case = built("mixtral")
    engine = build_engine(case.work_dir / "checkpoint", tmp_path / "bf16", progress=False, dtype="bfloat16")
    model = Engine(engine).model
    assert model.transformer.layers["0"].mlp.fused_fc.weight.dtype == torch.bfloat16
    prompts = [random_prompt(n, case.hf.config.vocab_size, seed=i + 1) for i, n in enumerate(LOGIT_PROMPT_LENS)]
    for ours, ref in zip(kiln_batch_prompt_logits(engine, prompts), kiln_batch_prompt_logits(case.engine_dir, prompts)):
        assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
    outputs = kiln_greedy(engine, prompts, 6)
    assert [len(o) for o in outputs] == [6, 6, 6]


def test_weight_only_quantization_quantizes_experts_and_keeps_routers_float(built, tmp_path) -> None:
    """W8A16 quantizes attention, the shared expert's linears and the experts (int8 codes and
    scales stacked expert by expert); routers and the shared-expert gate stay float; the
    quantized (bf16) engine still follows HF."""
    case = built("qwen2-moe")
    checkpoint = convert_checkpoint(case.hf_dir, tmp_path / "w8", quantization=QuantConfig(quant_algo="W8A16"),
                                    progress=False)
    with safe_open(str(checkpoint / "rank0.safetensors"), "pt") as f:
        tensors = {k: f.get_slice(k) for k in f.keys()}
    prefix = "transformer.layers.0."
    assert tensors[prefix + "attention.qkv.weight"].get_dtype() == "I8"
    assert tensors[prefix + "mlp.shared_expert.fc.weight"].get_dtype() == "I8"
    for name in ("fc", "gate", "proj"):
        assert tensors[f"{prefix}mlp.{name}.weight"].get_dtype() == "I8", name
        assert tensors[f"{prefix}mlp.{name}.weights_scaling_factor"].get_shape()[0] == 8, name  # one row per expert
    for name in ("router", "shared_expert_gate"):
        assert tensors[f"{prefix}mlp.{name}.weight"].get_dtype() == "F32", name
    engine = build_engine(checkpoint, tmp_path / "w8-engine", progress=False)
    prompt = random_prompt(20, case.hf.config.vocab_size, seed=3)
    ours = kiln_batch_prompt_logits(engine, [prompt])[0]
    with torch.no_grad():
        ref = case.hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max() <= 0.1 * ref.abs().max()


@pytest.mark.parametrize("algo, group_size", [("W8A16", None), ("W4A16", 32)])
def test_quantized_experts_compute_their_dequantized_weights(tmp_path, algo: str, group_size: int | None) -> None:
    """An engine's quantized experts (codes packed for the kernels, expert by expert) give the
    block output that the same codes dequantized to float32 give, expert by expert and token by
    token: the grouped quantized path reads each expert's own codes, scales and offsets."""
    from kiln.layers.quantized_matmul import dequantize
    from tests.conftest import convert_and_build

    make_qwen3_moe(tmp_path / "hf", moe_intermediate=64, seed=5)
    quant = QuantConfig(quant_algo=algo, **({"group_size": group_size} if group_size else {}))
    checkpoint_model = DecoderModelForCausalLM.from_checkpoint(
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", dtype="bfloat16", quantization=quant, progress=False))
    engine = convert_and_build(tmp_path / "hf", tmp_path / "kiln", {}, dtype="bfloat16", quantization=quant)
    block = Engine(engine).model.transformer.layers["0"].mlp
    ref = checkpoint_model.transformer.layers["0"].mlp
    assert block.fused_fc.quant_bits == (8 if algo == "W8A16" else 4) and block.fused_fc.quant_format["tile_order"]

    def dequantized(linear) -> torch.Tensor:  # [E, out, in] float32 from the checkpoint's row-major codes
        names = ("weight", "weights_scaling_factor", "zero", "weights_offset")
        return torch.stack([dequantize({n: getattr(linear, n)[e] for n in names if getattr(linear, n, None) is not None},
                                       linear.quant_bits, group_size) for e in range(linear.num_experts)])

    fc, gate, proj = dequantized(ref.fc), dequantized(ref.gate), dequantized(ref.proj)
    x = torch.randn(24, block.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weights, experts = block.route(block.router(x))
    expected = torch.zeros(24, block.hidden_size)
    for t in range(24):
        xt = x[t].float()
        for w, e in zip(weights[t], experts[t].tolist()):
            expected[t] += w * (proj[e] @ (torch.nn.functional.silu(fc[e] @ xt) * (gate[e] @ xt)))
    assert len(set(experts.flatten().tolist())) >= 6  # most experts take part
    out = block(x).float()
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("field, value, match", [
    ("num_experts_per_tok", 5, "num_experts_per_tok must be between 1 and num_local_experts"),
    ("num_local_experts", 0, "num_local_experts must be a positive integer"),
    ("intermediate_size", 63, r"intermediate_size \(63\) is not divisible by tp_size"),
    ("hidden_act", "mish", "hidden_act 'mish'"),
])
def test_unsupported_mixtral_configs_name_the_field(built, tmp_path, field: str, value, match: str) -> None:
    import json
    import shutil

    case = built("mixtral")
    hf_dir = tmp_path / "hf"
    shutil.copytree(case.hf_dir, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        convert_checkpoint(hf_dir, tmp_path / "out", tp_size=2, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_grouped_experts_equal_a_per_token_loop(dtype: torch.dtype, fused: bool) -> None:
    """The block's grouped execution (tokens sorted by expert, one matmul per active expert,
    index_add back) equals computing each token's experts one by one; 40 tokens over 8 experts
    give groups of several rows (bf16: the AMX / oneDNN kernels) and top_k 3 of 8 leaves some
    experts with few tokens; the shared expert is gated per token."""
    from torch import nn

    hidden, inter, experts, top_k, tokens = 64, 32, 8, 3, 40
    block = MixtureOfExperts(hidden, inter, experts, top_k, "silu", normalize_top_k=False, shared_intermediate_size=32,
                             shared_expert_gate=True, dtype=dtype, fused=fused)
    g = torch.Generator().manual_seed(0)
    for name, p in block.named_parameters():
        module, _, attr = name.rpartition(".")
        setattr(block.get_submodule(module), attr,
                nn.Parameter((torch.randn(p.shape, generator=g) * 0.3).to(dtype), requires_grad=False))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    out = block(x).float()

    f32 = {name: p.float() for name, p in block.named_parameters()}
    if fused:
        fc, gate = f32["fused_fc.weight"].chunk(2, dim=1)
        sfc, sgate = f32["shared_expert.fused_fc.weight"].chunk(2, dim=0)
    else:
        fc, gate, sfc, sgate = (f32["fc.weight"], f32["gate.weight"], f32["shared_expert.fc.weight"],
                                f32["shared_expert.gate.weight"])
    xf = x.float()
    probs = torch.softmax(xf @ f32["router.weight"].T, dim=-1)
    expected = torch.empty(tokens, hidden)
    for t in range(tokens):
        weights, chosen = probs[t].topk(top_k)
        acc = torch.zeros(hidden)
        for w, e in zip(weights, chosen.tolist()):
            acc += w * (f32["proj.weight"][e] @ (torch.nn.functional.silu(fc[e] @ xf[t]) * (gate[e] @ xf[t])))
        shared = f32["shared_expert.proj.weight"] @ (torch.nn.functional.silu(sfc @ xf[t]) * (sgate @ xf[t]))
        expected[t] = acc + torch.sigmoid(f32["shared_expert_gate.weight"] @ xf[t]) * shared
    assert torch.bincount(probs.topk(top_k).indices.flatten(), minlength=experts).min() > 0
    rel = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out - expected).abs().max() <= rel * expected.abs().max()


def test_bench_counts_only_the_experts_a_token_reads(built) -> None:
    """kiln bench's bytes per decode step: every weight once, but of the experts only top_k of
    num_experts (2 of 4 here), and no untied input embedding."""
    from kiln.bench.common import weight_bytes_per_token

    case = built("mixtral")
    hf, model = case.hf, Engine(case.engine_dir).model
    expert = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    embedding = hf.model.embed_tokens.weight.numel()
    total = sum(p.numel() for p in hf.parameters())
    assert weight_bytes_per_token(model) == 4 * (total - embedding - expert // 2)
