"""Real-shape models whose GGUF llama.cpp's own tools write, for ``moe_scale.py``: a random
bfloat16 Hugging Face directory of the shape, converted by ``convert_hf_to_gguf.py`` (the pinned
sdist's, as the tests use it) and quantized by llama.cpp's quantizer (llama-cpp-python's
``llama_model_quantize``). The converter decides every metadata key and tensor layout itself, so
the file is what a user would make from the released checkpoint.

``granite-4.0-h-micro``: Granite-4.0-H-Micro's published shape: hidden 2048, 40 layers of which 4
attention (32 query and 8 KV heads of 64, no positions; here every tenth layer), the others Mamba2
(64 heads of 64, one group, state 128, a 4-wide convolution), a shared SwiGLU MLP of 8192 on every
layer, no experts. GPT-2's tokenizer (the converter knows its pre-tokenizer; 50,257 tokens, padded
to 50,304), random weights (transformers' initialisation).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.utils has the converter
from tests.utils.llama_cpp_gguf import converter_dir, converter_env, save_converter_tokenizer  # noqa: E402


@dataclass(frozen=True)
class ConvertedShape:
    arch: str  # the GGUF architecture the converter writes
    hf_family: str  # transformers' <family>Config / <family>ForCausalLM
    config: dict = field(default_factory=dict)
    released: dict = field(default_factory=dict)  # config.json fields as the released checkpoint writes them

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]


CONVERTED_SHAPES = {
    "granite-4.0-h-micro": ConvertedShape("granitehybrid", "GraniteMoeHybrid", dict(
        vocab_size=50304, hidden_size=2048, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, shared_intermediate_size=8192, num_local_experts=0, num_experts_per_tok=0,
        layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)], position_embedding_type="nope",
        mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        embedding_multiplier=12.0, residual_multiplier=0.246, attention_multiplier=0.0078125, logits_scaling=8.0,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256),
        released=dict(layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)])),
}
QUANT_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def write_converted_gguf(shape: str, quant: str, out: Path) -> None:
    """``out``: the shape's random model through llama.cpp's converter (bf16) and quantizer."""
    import torch
    import transformers

    m = CONVERTED_SHAPES[shape]
    hf_dir, bf16 = out.parent / "hf", out.parent / "model-bf16.gguf"
    if not (hf_dir / "config.json").is_file():
        print(f"  random bfloat16 {m.hf_family} in {hf_dir}", flush=True)
        torch.manual_seed(0)
        config = getattr(transformers, f"{m.hf_family}Config")(**m.config)
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = getattr(transformers, f"{m.hf_family}ForCausalLM")(config)
        finally:
            torch.set_default_dtype(torch.float32)
        model.save_pretrained(hf_dir)
        del model
        # config.json as released: transformers 5 renames the layer types, which the converter reads
        config_file = hf_dir / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **m.released}, indent=2))
        save_converter_tokenizer(hf_dir, m.vocab)
    if not bf16.is_file():
        print("  llama.cpp's convert_hf_to_gguf.py (bf16)", flush=True)
        conv = converter_dir()
        subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(bf16),
                        "--outtype", "bf16"], check=True, env=converter_env(conv), stdout=subprocess.DEVNULL)
    print(f"  llama.cpp's quantizer ({quant})", flush=True)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(bf16).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {bf16}")
