"""MXFP4 (gpt-oss's expert format): kiln's decoding of Hugging Face's blocks and scales and of a
GGUF's MXFP4 blocks, bit for bit against transformers' and the gguf package's own dequantization;
a gpt-oss checkpoint whose experts are MXFP4 computes what HF computes with those weights."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kiln.layers.quantized_matmul import dequantize_mxfp4, mxfp4_from_gguf


def _random_blocks(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # every E8M0 byte, subnormals too
    return blocks, scales


def test_hf_blocks_decode_as_transformers_decodes_them() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_blocks((3, 8, 4), seed=0)  # [experts, rows, groups]
    ours = dequantize_mxfp4(blocks, scales)  # [E, rows, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)


def test_gguf_blocks_decode_as_the_gguf_package_decodes_them() -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(6, 3 * 17), dtype=np.uint8)
    with np.errstate(over="ignore"):  # the largest E8M0 bytes overflow float32 to inf, in both decoders
        theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType.MXFP4).reshape(6, 96))
    ours = dequantize_mxfp4(*mxfp4_from_gguf(torch.from_numpy(raw)))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # bit for bit (signed zeros too)
    # and weights the gguf package quantizes come back as it dequantizes them
    w = rng.standard_normal((4, 64)).astype(np.float32)
    packed = quantize(w, GGMLQuantizationType.MXFP4)
    assert torch.equal(dequantize_mxfp4(*mxfp4_from_gguf(torch.from_numpy(packed))),
                       torch.from_numpy(dequantize(packed, GGMLQuantizationType.MXFP4)))


def _to_hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face MXFP4 blocks and scales of float ``w`` ``[E, rows, in]`` (through the gguf
    package's quantizer, then its block layout turned into HF's)."""
    e, rows, cols = w.shape
    raw = quantize(w.reshape(e * rows, cols).numpy(), GGMLQuantizationType.MXFP4)
    blocks, scales = mxfp4_from_gguf(torch.from_numpy(raw))
    return blocks.reshape(e, rows, cols // 32, 16), scales.reshape(e, rows, cols // 32)


def test_gpt_oss_mxfp4_checkpoint_matches_hf(tmp_path, build_from_hf) -> None:
    """A gpt-oss directory whose experts are MXFP4 blocks (as released) converts, and kiln's
    float32 logits equal HF's model holding the same weights decoded."""
    from safetensors.torch import load_file, save_file

    from tests.models.zoo import check_prompt_logits
    from tests.utils.tiny_moe_models import make_gpt_oss

    hf = make_gpt_oss(tmp_path / "hf", hidden=64, intermediate=64, seed=6)
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_hf_mxfp4(state.pop(key).transpose(1, 2).contiguous())  # HF params are [E, in, out]
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        param = hf.get_parameter(key)
        with torch.no_grad():  # the reference holds exactly the decoded weights
            param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    engine = build_from_hf(tmp_path / "hf", tmp_path / "kiln", {})
    case = type("Case", (), {"hf": hf, "engine_dir": engine})
    check_prompt_logits(case)
