"""AWQ (W4A16_AWQ): the per-channel scale search against plain round-to-nearest, the
clipping search against no clipping, the checkpoint's ``prequant_scaling_factor`` tensors, and the engine against Hugging Face (float,
and running exactly the checkpoint's dequantized, pre-scaled weights)."""
from __future__ import annotations

import json

import pytest
import torch

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.quantization import dequantize, quantize_weight
from kiln.quantization.awq import awq_scale, search_clip, search_scale
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import save_tiny_tokenizer

GROUP = 64
OUTLIER_CHANNELS = (3, 17, 40)  # hidden channels whose activations are made large, as in real LLMs
CALIB_TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "A language model predicts the next token; perplexity measures how well it does on text.",
    "Summarize the following article about engines that convert checkpoints and run them fast.",
    "The engine builds, the runtime pages its cache, and the scheduler batches the requests.",
] * 4


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _outlier_rows(n: int, features: int, seed: int) -> torch.Tensor:
    x = _randn(n, features, seed=seed)
    x[:, list(OUTLIER_CHANNELS)] *= 30.0
    return x


def test_scale_search_is_never_worse_than_round_to_nearest():
    for seed in range(3):
        w, x = _randn(96, 128, seed=seed), _randn(200, 128, seed=seed + 10).abs() + 0.1 * seed
        s, alpha, error, rtn_error = search_scale([w], x, x.abs().mean(0), GROUP, has_zero_point=seed == 1)
        assert error <= rtn_error
        rtn = ((x @ dequantize(quantize_weight(w, 4, GROUP), 4, GROUP).t() - x @ w.t()) ** 2).sum().item()
        if seed != 1:  # alpha 0 is plain W4A16 round-to-nearest, exactly
            assert rtn_error == pytest.approx(rtn, rel=1e-5)
    assert torch.equal(awq_scale(torch.rand(8) + 0.5, 0.0), torch.ones(8))


def test_large_activation_channels_lose_much_less_than_round_to_nearest():
    w, x = _randn(128, 128, seed=1), _outlier_rows(256, 128, seed=2)
    s, alpha, error, rtn_error = search_scale([w], x, x.abs().mean(0), GROUP, has_zero_point=False)
    assert alpha > 0 and error < 0.5 * rtn_error  # measured: about 0.3x
    # The stored tensors reproduce the searched error: Q(W diag(s)) applied to x * (1/s).
    q = dequantize(quantize_weight(w * s, 4, GROUP), 4, GROUP)
    held_out = _outlier_rows(256, 128, seed=3)
    awq = ((held_out * (1 / s)) @ q.t() - held_out @ w.t()).pow(2).sum()
    rtn = (held_out @ dequantize(quantize_weight(w, 4, GROUP), 4, GROUP).t() - held_out @ w.t()).pow(2).sum()
    assert awq < 0.5 * rtn


def _channel_errors(x: torch.Tensor, w: torch.Tensor, clip: torch.Tensor | None, has_zero_point: bool) -> torch.Tensor:
    """Squared output error per output channel ``[out]`` of 4-bit ``w`` (clipped by ``clip``) on rows ``x``."""
    q = dequantize(quantize_weight(w, 4, GROUP, has_zero_point, clip), 4, GROUP)
    return (x.double() @ (w - q).double().t()).pow(2).sum(0)


@pytest.mark.parametrize("has_zero_point", [False, True])
def test_clipping_is_never_worse_on_the_calibration_rows(has_zero_point):
    for seed in range(3):
        w, x = _randn(64, 256, seed=seed) * (1 + seed), _outlier_rows(300, 256, seed=seed + 20)
        clip = search_clip(w, x.t() @ x, GROUP, has_zero_point)
        assert clip.shape == (64, 4) and clip.min() >= 0.5 and clip.max() <= 1.0
        clipped, plain = _channel_errors(x, w, clip, has_zero_point), _channel_errors(x, w, None, has_zero_point)
        assert torch.all(clipped <= plain * (1 + 1e-6))  # every output channel, not only the sum
        assert clipped.sum() < 0.6 * plain.sum()  # and it does help here: measured 0.24-0.38x


@pytest.mark.parametrize("has_zero_point", [False, True])
def test_clipping_gives_up_a_lone_weight_outlier_for_its_groups_other_weights(has_zero_point):
    """One large weight on a quiet input stretches its group's step for the 63 others; clipping
    it costs less output error than the coarse step does."""
    w, x = _randn(32, 128, seed=4) * 0.02, _randn(400, 128, seed=5)
    w[7, 70] = 0.5  # group 1 of output channel 7 (~8x the group's other weights)
    x[:, 70] *= 0.05  # its input is quiet
    clip = search_clip(w, x.t() @ x, GROUP, has_zero_point)
    assert clip[7, 1] < 0.6  # measured 0.5 with and without zero points
    assert torch.all(clip[:, 0] >= 0.8)  # plain Gaussian groups keep most of their range
    clipped, plain = _channel_errors(x, w, clip, has_zero_point), _channel_errors(x, w, None, has_zero_point)
    assert clipped[7] < 0.5 * plain[7]  # measured 0.34-0.35x
    rtn = quantize_weight(w, 4, GROUP, has_zero_point)
    kept = quantize_weight(w, 4, GROUP, has_zero_point, clip)
    assert kept["weights_scaling_factor"][7, 1] < 0.7 * rtn["weights_scaling_factor"][7, 1]


def _hf_with_outliers(path):
    """A tiny Llama (hidden 64, intermediate 128: the 4-bit kernels tile it) with the tiny
    tokenizer, and a few hidden channels amplified by its RMSNorm weights."""
    hf = make_llama(path, num_heads=4, num_kv_heads=2, hidden=64, layers=2, intermediate=128, vocab=300)
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[list(OUTLIER_CHANNELS)] *= 20.0
    hf.save_pretrained(path)
    save_tiny_tokenizer(path)
    return hf


@pytest.fixture(scope="module")
def awq_and_rtn(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    hf = _hf_with_outliers(root / "hf")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB_TEXTS))
    awq = convert_and_build(root / "hf", root / "awq", {"tokens_per_block": 4}, calib_dataset=str(calib),
                            calib_size=16, quantization=QuantConfig(quant_algo="W4A16_AWQ", group_size=GROUP))
    rtn = convert_and_build(root / "hf", root / "rtn", {"tokens_per_block": 4},
                            quantization=QuantConfig(quant_algo="W4A16", group_size=GROUP))
    return hf, root / "awq", awq, rtn


def _held_out_prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (12, 20, 31)]


def test_checkpoint_holds_prequant_factors_and_the_engine_fuses_one(awq_and_rtn):
    from safetensors import safe_open

    _, work, engine, _ = awq_and_rtn
    config = json.loads((work / "checkpoint" / "config.json").read_text())["quantization"]
    assert config["quant_algo"] == "W4A16_AWQ" and config["pre_quant_scale"] and config["group_size"] == GROUP
    with safe_open(str(work / "checkpoint" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("transformer.layers.0.mlp.fc.prequant_scaling_factor")
        gate = f.get_tensor("transformer.layers.0.mlp.gate.prequant_scaling_factor")
        proj = f.get_tensor("transformer.layers.0.mlp.proj.prequant_scaling_factor")
    for layer in range(2):
        for linear in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            assert f"transformer.layers.{layer}.{linear}.prequant_scaling_factor" in names
    assert "lm_head.prequant_scaling_factor" not in names
    assert fc.dtype == torch.float32 and fc.shape == (64,) and proj.shape == (128,)
    assert torch.equal(fc, gate)  # one input, one scale
    # The outlier channels are scaled up before rounding (so their input is divided down).
    assert fc[list(OUTLIER_CHANNELS)].max() < fc.median()
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        engine_names = set(f.keys())
        fused = f.get_tensor("transformer.layers.0.mlp.fused_fc.prequant_scaling_factor")
    assert torch.equal(fused, fc) and "transformer.layers.0.mlp.fc.prequant_scaling_factor" not in engine_names
    assert json.loads((engine / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16_AWQ"


def test_awq_engine_is_closer_to_float_than_round_to_nearest(awq_and_rtn):
    hf, _, awq, rtn = awq_and_rtn
    errors = {"awq": 0.0, "rtn": 0.0}
    for ids in _held_out_prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        for name, engine in (("awq", awq), ("rtn", rtn)):
            errors[name] += (kiln_prompt_logits(engine, ids) - ref).pow(2).mean().item()
    assert errors["awq"] < 0.7 * errors["rtn"], errors  # measured: about 0.5x (mean squared logit error)


def test_engine_computes_the_checkpoints_prescaled_dequantized_model(awq_and_rtn):
    """HF with each linear set to dequant(codes) diag(prequant), from the checkpoint's tensors."""
    from safetensors.torch import load_file

    hf, work, engine, _ = awq_and_rtn
    tensors = load_file(str(work / "checkpoint" / "rank0.safetensors"))
    reference = make_llama(work / "hf_dequant", num_heads=4, num_kv_heads=2, hidden=64, layers=2, intermediate=128,
                           vocab=300)
    reference.load_state_dict(hf.state_dict())

    def effective(prefix: str) -> torch.Tensor:
        parts = {k: tensors[f"{prefix}.{k}"] for k in ("weight", "weights_scaling_factor")}
        return dequantize(parts, 4, GROUP) * tensors[f"{prefix}.prequant_scaling_factor"][None, :]

    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            p = f"transformer.layers.{i}"
            q, k, v = effective(f"{p}.attention.qkv").split([64, 32, 32])
            for linear, w in ((layer.self_attn.q_proj, q), (layer.self_attn.k_proj, k), (layer.self_attn.v_proj, v),
                              (layer.self_attn.o_proj, effective(f"{p}.attention.dense")),
                              (layer.mlp.gate_proj, effective(f"{p}.mlp.fc")),
                              (layer.mlp.up_proj, effective(f"{p}.mlp.gate")),
                              (layer.mlp.down_proj, effective(f"{p}.mlp.proj"))):
                linear.weight.copy_(w)
    for ids in _held_out_prompts()[:2]:
        ours = kiln_prompt_logits(engine, ids)
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0].float()
        # bf16 compute, and (prompts of 1-32 tokens: the integer GEMV and AMX int8 tiles) x in int8
        # blocks of 32, as llama.cpp's Q8 activations
        assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_bad_awq_requests_are_clear_errors(tmp_path):
    from kiln.convert import convert_checkpoint

    make_llama(tmp_path / "hf", hidden=64, layers=1, intermediate=128, vocab=300)
    awq = QuantConfig(quant_algo="W4A16_AWQ")
    with pytest.raises(ConfigError, match="group_size 48 for W4A16_AWQ: must be a multiple of 32"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "a", progress=False,
                           quantization=QuantConfig(quant_algo="W4A16_AWQ", group_size=48))
    with pytest.raises(ConfigError, match="tokenizer"):  # no tokenizer saved next to the weights
        convert_checkpoint(tmp_path / "hf", tmp_path / "b", progress=False, quantization=awq,
                           calib_dataset=str(tmp_path / "hf" / "config.json"))
    save_tiny_tokenizer(tmp_path / "hf")
    with pytest.raises(ConfigError, match="calib_dataset"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "c", progress=False, quantization=awq,
                           calib_dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="tp_size 1"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "d", progress=False, quantization=awq, tp_size=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()
