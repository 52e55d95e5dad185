"""The native mixture-of-experts call (kernels.moe_experts): a decode step's routed experts in
one call, against the same codes dequantized to float32 token by token, and a batch against
its tokens one at a time."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln import kernels
from kiln.layers.activation import ClampedSwiGLU
from kiln.layers.moe import MixtureOfExperts
from kiln.layers.quantized_matmul import dequantize
from kiln.quantization.weight_only import quantize_weight

pytestmark = pytest.mark.skipif(not kernels.moe_experts_supported(), reason="needs the integer GEMV (AVX512-VNNI)")

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 3


def quantized_block(fmt: str, *, biased: bool, seed: int = 0,
                    shared: int = 0) -> tuple[MixtureOfExperts, dict[str, torch.Tensor]]:
    """An engine-layout block (fused experts, codes packed for the kernels) in format ``fmt`` and
    its experts' float32 weights as those codes stand for them; ``shared``: the intermediate size
    of a gated shared expert, quantized the same way (its weights under ``shared_*``)."""
    g = torch.Generator().manual_seed(seed)
    block = MixtureOfExperts(HIDDEN, INTER, EXPERTS, TOP_K, "silu", normalize_top_k=True, dtype=torch.bfloat16,
                             fused=True, expert_bias=biased, router_bias=biased,
                             gated_act=ClampedSwiGLU(1.702, 7.0) if fmt == "e2m1" else None,
                             shared_intermediate_size=shared, shared_expert_gate=bool(shared))
    for name, p in block.named_parameters():
        module, _, attr = name.rpartition(".")
        setattr(block.get_submodule(module), attr,
                nn.Parameter((torch.randn(p.shape, generator=g) * 0.3).to(p.dtype), requires_grad=False))
    dense = {}
    for name in ("fused_fc", "proj"):
        linear = getattr(block, name)
        experts, n, k = linear.weight.shape
        bits, group = (8, None) if fmt == "int8" else (4, 32)
        if fmt == "e2m1":
            rows = {"weight": torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8),
                    "weights_scaling_factor": 2.0 ** torch.randint(-8, -3, (experts, n, k // 32), generator=g).float()}
        else:
            rows = quantize_weight(linear.weight.float(), bits, 32, has_zero_point=fmt == "int4_zero")
        dense[name] = torch.stack([dequantize({key: t[e] for key, t in rows.items()}, bits, group,
                                              codebook="e2m1" if fmt == "e2m1" else None) for e in range(experts)])
        packed = []
        for e in range(experts):
            scales, offsets = kernels.quant_pack_scales(rows["weights_scaling_factor"][e],
                                                        rows["zero"][e] if "zero" in rows else None)
            packed.append((kernels.quant_pack(rows["weight"][e], bits), scales, offsets))
        tensors = {"weight": torch.stack([p[0] for p in packed]),
                   "weights_scaling_factor": torch.stack([p[1] for p in packed])}
        if packed[0][2] is not None:
            tensors["weights_offset"] = torch.stack([p[2] for p in packed])
        linear.use_weight_only(bits, group, fmt == "int4_zero", tensors, tile_order=True,
                               codebook="e2m1" if fmt == "e2m1" else None)
    for name in ("fused_fc", "proj") if shared else ():
        linear = getattr(block.shared_expert, name)
        bits, group = (8, None) if fmt == "int8" else (4, 32)
        rows = quantize_weight(linear.weight.float(), bits, 32, has_zero_point=fmt == "int4_zero")
        dense[f"shared_{name}"] = dequantize(rows, bits, group)
        scales, offsets = kernels.quant_pack_scales(rows["weights_scaling_factor"], rows.get("zero"))
        tensors = {"weight": kernels.quant_pack(rows["weight"], bits), "weights_scaling_factor": scales}
        if offsets is not None:
            tensors["weights_offset"] = offsets
        linear.use_weight_only(bits, group, fmt == "int4_zero", tensors, tile_order=True)
    return block, dense


def reference(block: MixtureOfExperts, dense: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Each token's experts one by one in float32 from the dequantized codes."""
    weights, experts = block.route(block.router(x))
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist()):
            both = dense["fused_fc"][e] @ x[t].float()
            if block.fused_fc.bias is not None:
                both = both + block.fused_fc.bias[e].float()
            fc, up = both.chunk(2)
            h = block.gated_act(fc, up) if block.gated_act is not None else torch.nn.functional.silu(fc) * up
            y = dense["proj"][e] @ h
            out[t] += w * (y + block.proj.bias[e].float() if block.proj.bias is not None else y)
    if block.shared_expert is not None:
        fc, up = (x.float() @ dense["shared_fused_fc"].T).chunk(2, dim=-1)
        gate = torch.sigmoid(x.float() @ block.shared_expert_gate.weight.float().T)
        out += gate * ((torch.nn.functional.silu(fc) * up) @ dense["shared_proj"].T)
    return out


@pytest.mark.parametrize("fmt, biased", [("int8", False), ("int4", False), ("int4_zero", True), ("e2m1", True)])
def test_native_experts_compute_the_dequantized_codes(fmt: str, biased: bool) -> None:
    """W8A16 (scales per channel), W4A16 (groups of 32, with and without zero points) and MXFP4's
    E2M1 codes with gpt-oss's biases and clamped SwiGLU: the native call equals the float32
    computation of the same codes within the integer GEMV's activation rounding, and so do its
    tiles for experts of many tokens and the grouped PyTorch path past the call's tokens."""
    block, dense = quantized_block(fmt, biased=biased)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = reference(block, dense, x)
    # 5 tokens: every expert on the GEMV; 40: most take more than 12 rows (tiles, in the same
    # call); 260: past the call's tokens, the layer groups them in PyTorch
    for copies, native in ((1, True), (8, True), (52, False)):
        rows = x.repeat(copies, 1)
        assert (block._native_experts(rows) is not None) == native
        out = block(rows).float().view(copies, 5, HIDDEN)
        assert (out - expected).abs().max() <= 2e-2 * expected.abs().max(), copies


@pytest.mark.parametrize("fmt", ["int8", "int4_zero"])
def test_a_shared_expert_joins_the_native_call(fmt: str) -> None:
    """A gated shared expert (Qwen2-MoE's; DeepSeek's without the gate) computed inside the
    routed experts' call equals the float32 computation of the same codes, and each token of a
    batch gets exactly what it gets alone; past SHARED_MAX_ROWS tokens it runs beside the call."""
    block, dense = quantized_block(fmt, biased=False, seed=5, shared=96)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert block._native_shared(x) is not None
    expected = reference(block, dense, x)
    out = block(x).float()
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()
    for t in range(5):
        assert torch.equal(block(x[t:t + 1]).float(), out[t:t + 1])
    rows = x.repeat(3, 1)  # 15 tokens: the shared expert as its own linears
    assert block._native_shared(rows) is None
    out = block(rows).float().view(3, 5, HIDDEN)
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_a_batch_equals_its_tokens_one_at_a_time() -> None:
    """Tokens grouped by expert in one call give each token exactly what it gets alone."""
    block, _ = quantized_block("int4", biased=True, seed=2)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, experts = block.route(block.router(x))
    assert len(set(experts.flatten().tolist())) == EXPERTS  # every expert takes several tokens
    together = block.routed(x, weights, experts)
    for t in range(12):
        assert torch.equal(block.routed(x[t:t + 1], weights[t:t + 1], experts[t:t + 1]), together[t:t + 1])


def test_an_expert_index_out_of_range_is_refused() -> None:
    block, _ = quantized_block("int8", biased=False)
    native = block._native_experts(torch.zeros(1, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expert index"):
        kernels.moe_experts(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.tensor([[0, 1, EXPERTS]]),
                            torch.ones(1, 3), *native, num_experts=EXPERTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_native_routing_is_the_softmax_top_k(dtype: torch.dtype, normalize: bool) -> None:
    """kernels.moe_route: the softmax over every expert in float32, the top k, renormalised or not."""
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = kernels.moe_route(logits, 6, normalize)
    probs = torch.softmax(logits.float(), dim=-1)
    expected, expected_ids = probs.topk(6, dim=-1)
    if normalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    # bf16 logits tie: the same experts, in either order among equals
    assert torch.equal(ids.sort(dim=-1).values, expected_ids.sort(dim=-1).values)
    assert torch.allclose(weights, expected, rtol=1e-5, atol=0)
