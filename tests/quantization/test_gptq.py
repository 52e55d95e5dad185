"""GPTQ import: a tiny Llama saved the way AutoGPTQ saves a 4-bit GPTQ model (packed by this
test's own packer) converts into kiln's W4A16 layout exactly, and its engine computes the
dequantized model; act-order layers are re-quantized; unsupported configs are clear errors."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from tests.conftest import convert_and_build
from tests.utils.compare import kiln_prompt_logits
from tests.utils.tiny_models import make_llama

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def _pack_eight(values: torch.Tensor) -> torch.Tensor:
    """int32 rows holding eight 4-bit ``values`` rows each, row ``8r + j`` in bits 4j.. of row r."""
    rows, cols = values.shape
    packed = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for r in range(rows // 8):
        for j in range(8):
            packed[r] += values[8 * r + j].long() << (4 * j)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # two's complement


def make_gptq(root, *, group_size=32, sym=False, act_order=False, desc_act=None, fmt="gptq", bits=4, seed=0):
    """Save a GPTQ Llama under ``root / "hf"``; return the float HF model whose decoder linears hold
    the reference dequantized weights, and those weights by HF name."""
    hf = make_llama(root / "hf", num_heads=4, num_kv_heads=2, hidden=64, layers=2, intermediate=128)
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    reference = {}
    for key in [k for k in tensors if LINEAR.fullmatch(k)]:
        out_f, in_f = tensors.pop(key).shape
        gs = in_f if group_size == -1 else group_size
        codes = torch.randint(0, 16, (in_f, out_f), generator=gen)
        zeros = (torch.full((in_f // gs, out_f), 8) if sym else  # classic format cannot store a zero point of 0
                 torch.randint(1 if fmt == "gptq" else 0, 16, (in_f // gs, out_f), generator=gen))
        scales = (torch.rand(in_f // gs, out_f, generator=gen) * 0.004 + 0.002).half()
        g_idx = torch.arange(in_f) // gs
        if act_order:  # feature perm[i] belongs to group i // gs
            perm = torch.randperm(in_f, generator=gen)
            g_idx = torch.empty_like(g_idx)
            g_idx[perm] = torch.arange(in_f) // gs
        reference[key] = ((codes - zeros[g_idx]).float() * scales.float()[g_idx]).t()
        stem = key[: -len(".weight")]
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros
        tensors[f"{stem}.qweight"] = _pack_eight(codes)
        tensors[f"{stem}.qzeros"] = _pack_eight(stored_zeros.t().contiguous()).t().contiguous()
        tensors[f"{stem}.scales"] = scales
        tensors[f"{stem}.g_idx"] = g_idx.to(torch.int32)
    save_file(tensors, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                     "desc_act": act_order if desc_act is None else desc_act, "sym": sym,
                                     "checkpoint_format": fmt}
    (root / "hf" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in reference:
                p.copy_(reference[name])
    return hf, reference


def kiln_dequantized(checkpoint) -> dict[str, torch.Tensor]:
    """The converted checkpoint's linears, dequantized by kiln, under HF's names."""
    from kiln.models.base import DecoderModelForCausalLM

    model = DecoderModelForCausalLM.from_checkpoint(checkpoint)
    out = {}
    for i in range(model.config.num_hidden_layers):
        layer, hf = model.transformer.layers[str(i)], f"model.layers.{i}."
        q, k, v = layer.attention.qkv.dequantized_weight().split([64, 32, 32])
        out.update({f"{hf}self_attn.q_proj.weight": q, f"{hf}self_attn.k_proj.weight": k,
                    f"{hf}self_attn.v_proj.weight": v,
                    f"{hf}self_attn.o_proj.weight": layer.attention.dense.dequantized_weight(),
                    f"{hf}mlp.gate_proj.weight": layer.mlp.fc.dequantized_weight(),
                    f"{hf}mlp.up_proj.weight": layer.mlp.gate.dequantized_weight(),
                    f"{hf}mlp.down_proj.weight": layer.mlp.proj.dequantized_weight()})
    return out


# (group_size, sym, desc_act flag with an in-order g_idx, checkpoint format)
CASES = [(32, False, False, "gptq"), (64, True, True, "gptq"), (-1, False, False, "gptq_v2")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"g{c[0]}-{'sym' if c[1] else 'asym'}-{c[3]}")
def gptq_engine(request, tmp_path_factory):
    group_size, sym, desc_act, fmt = request.param
    root = tmp_path_factory.mktemp("gptq")
    hf, reference = make_gptq(root, group_size=group_size, sym=sym, desc_act=desc_act, fmt=fmt)
    engine = convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4})
    return request.param, hf, reference, root / "kiln" / "checkpoint", engine


def test_converted_checkpoint_dequantizes_exactly(gptq_engine):
    (group_size, sym, _, _), _, reference, checkpoint, _ = gptq_engine
    quant = json.loads((checkpoint / "config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_GPTQ" and quant["exclude_modules"] == ["lm_head"]
    assert quant["group_size"] == (64 if group_size == -1 else group_size)  # -1: gcd of 64 and 128 inputs
    assert quant["has_zero_point"] == (not sym)
    ours = kiln_dequantized(checkpoint)
    assert ours.keys() == reference.keys()
    for key, w in reference.items():
        assert torch.equal(ours[key], w), key


def test_gptq_engine_computes_the_dequantized_model(gptq_engine):
    _, hf, _, _, engine = gptq_engine
    assert json.loads((engine / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16_GPTQ"
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = kiln_prompt_logits(engine, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 0.03 * ref.abs().max().item()  # bf16 compute, as test_weight_only


def test_act_order_is_requantized_to_within_half_a_step(tmp_path, caplog):
    from kiln.convert import convert_checkpoint
    from kiln.models.base import DecoderModelForCausalLM

    _, reference = make_gptq(tmp_path, group_size=32, act_order=True)
    with caplog.at_level(logging.WARNING, logger="kiln.quantization.gptq"):
        checkpoint = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    assert "act-order" in caplog.text
    ours = kiln_dequantized(checkpoint)
    fc = DecoderModelForCausalLM.from_checkpoint(checkpoint).transformer.layers["0"].mlp.fc
    step = fc.weights_scaling_factor.repeat_interleave(32, dim=1)
    error = (ours["model.layers.0.mlp.gate_proj.weight"] - reference["model.layers.0.mlp.gate_proj.weight"]).abs()
    assert torch.all(error <= step / 2 + 1e-6) and error.max() > 0  # round-to-nearest, not a silent exact copy
    for key, w in reference.items():  # every layer close to its GPTQ weight (steps are ~0.005-0.1 here)
        assert (ours[key] - w).abs().max() <= 0.5 * w.abs().max(), key


@pytest.mark.parametrize("changes,field", [({"bits": 3}, "bits"), ({"bits": 8}, "bits"),
                                           ({"group_size": 48}, "group_size"),
                                           ({"checkpoint_format": "marlin"}, "checkpoint_format")])
def test_unsupported_gptq_configs_are_clear_errors(tmp_path, changes, field):
    from kiln.convert import convert_checkpoint

    make_gptq(tmp_path, group_size=32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"].update(changes)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def test_tp_and_requantization_of_gptq_are_refused(tmp_path):
    from kiln.convert import convert_checkpoint

    make_gptq(tmp_path, group_size=32)
    with pytest.raises(ConfigError, match="tp_size"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "a", tp_size=2, progress=False)
    with pytest.raises(ConfigError, match="already quantized"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "b", progress=False,
                           quantization=QuantConfig(quant_algo="W4A16"))
    from kiln.quantization import quantize_model

    with pytest.raises(ConfigError, match="W4A16_GPTQ.* needs calibration"):
        quantize_model(torch.nn.Module(), QuantConfig(quant_algo="W4A16_GPTQ"))  # not a round-to-nearest algo
