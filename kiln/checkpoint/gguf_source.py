"""Read a GGUF file as if it were a Hugging Face checkpoint.

GGUF (llama.cpp's format) renames tensors, may quantize them, reorders the rows of the
llama query/key projections for its rotary kernel, and keeps the config as metadata.
:class:`GGUFSource` undoes all of that, so the weights loader sees Hugging Face names,
shapes, layouts and a Hugging Face style config.
"""
from __future__ import annotations

import json
import mmap
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from kiln.checkpoint.tensor_source import Index
from kiln.errors import CheckpointError
from kiln.tokenizer import hf_tokenizer

# GGUF architecture -> (HF class, HF model_type). mistral and qwen2 name tensors like llama.
# (llama.cpp itself labels Mistral 7B files "llama"; "mistral" is accepted for other writers.)
_LLAMA_LIKE = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
SUPPORTED_ARCHITECTURES = (*_LLAMA_LIKE, "gpt2")
# llama.cpp's converter reorders q/k rows only for these (its qwen2 path uses NeoX rope as-is).
_PERMUTED_QK = ("llama", "mistral")

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm",
}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_BLOCK = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}
# Tensors llama.cpp adds that have no Hugging Face parameter.
_IGNORED = {"rope_freqs.weight"}
# Types the reader hands over as ready numpy arrays of the right dtype.
_PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64,
          GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
          GGMLQuantizationType.I64}
FLOAT_TYPES = (*_PLAIN, GGMLQuantizationType.BF16)  # types stored as plain numbers, not blocks
# A weight's raw blocks, listed beside it by a source opened with ``blocks=True``:
# ``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.gguf_blocks``.
BLOCKS = "gguf_blocks"


def _hf_name(arch: str, name: str) -> str | None:
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    block, top = (_GPT2_BLOCK, _GPT2_TOP) if arch == "gpt2" else (_LLAMA_BLOCK, _LLAMA_TOP)
    prefix = "transformer.h" if arch == "gpt2" else "model.layers"
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        part = block.get(m[2])
        return f"{prefix}.{m[1]}.{part}.{suffix}" if part else None
    return f"{top[stem]}.{suffix}" if stem in top else None


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k reorder, which interleaves the two rotary halves of each head."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _float(value: Any) -> float:
    # Metadata floats are float32; their shortest repr is the decimal the converter wrote (1e-05).
    return float(str(np.float32(value)))


class GGUFSource:
    """A ``.gguf`` file seen as a Hugging Face checkpoint: HF names, shapes, layouts and config.

    Quantized tensors are dequantized to float32 on read; F32/F16/BF16 keep their dtype.
    Only the most recently read tensor is kept, fully dequantized, for further slices.
    With ``blocks`` each quantized 2-D weight (a llama-like file's) is also listed as its raw
    blocks, ``<stem>.gguf_blocks``: uint8 ``[rows, bytes a row]`` in HF row order, read whole
    (``kiln.quantization.gguf`` imports them without dequantizing).
    """

    def __init__(self, path: Path, blocks: bool = False):
        self.path, self.blocks = Path(path), blocks
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        try:
            self._reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.arch = self._meta("general.architecture")
        if self.arch is None:
            raise CheckpointError(f"{self.path}: metadata key 'general.architecture' is missing")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self._tensors: dict[str, ReaderTensor] = {}
        self._gguf_names: set[str] = set()
        for t in self._reader.tensors:
            self._gguf_names.add(t.name)
            self._check_size(t)
            hf = _hf_name(self.arch, t.name)
            if hf is None:
                if t.name in _IGNORED:
                    continue
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has no Hugging Face counterpart "
                                      f"for architecture {self.arch!r}")
            self._tensors[hf] = t
        self._blocks = {f"{key[:-len('weight')]}{BLOCKS}": key for key, t in self._tensors.items()
                        if blocks and self.arch in _LLAMA_LIKE and key.endswith(".weight") and len(t.shape) == 2
                        and t.tensor_type not in FLOAT_TYPES}
        self._cached: tuple[str, torch.Tensor] | None = None

    def _check_size(self, t: ReaderTensor) -> None:
        # The reader rejects most truncations itself; this catches a short memory map it lets by.
        if t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has {t.data.nbytes} of {t.n_bytes} bytes "
                                  "(file truncated?)")

    def _meta(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def keys(self) -> Iterable[str]:
        return [*self._tensors, *self._blocks]

    def tensor_type(self, key: str) -> GGMLQuantizationType:
        """The GGUF type of tensor ``key`` (an HF name)."""
        return self._tensor(key).tensor_type

    def _tensor(self, key: str) -> ReaderTensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {key!r}") from None

    def _transposed(self, key: str, t: ReaderTensor) -> bool:
        # GGUF keeps gpt2 linears as [out, in]; HF's Conv1D wants [in, out].
        return (self.arch == "gpt2" and len(t.shape) == 2
                and key.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")))

    def _row_heads(self, key: str) -> int | None:
        """Heads to un-permute over for llama q/k weights and biases, else None."""
        if self.arch not in _PERMUTED_QK:
            return None
        if ".self_attn.q_proj." in key:
            return int(self._meta(f"{self.arch}.attention.head_count"))
        if ".self_attn.k_proj." in key:
            heads = self._meta(f"{self.arch}.attention.head_count")
            return int(self._meta(f"{self.arch}.attention.head_count_kv", heads))
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._blocks:
            return tuple(self._tensor(self._blocks[key]).data.shape)
        t = self._tensor(key)
        shape = tuple(int(d) for d in reversed(t.shape))
        return shape[::-1] if self._transposed(key, t) else shape

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """The tensor ``key`` in HF layout, or the part of it that ``index`` selects (a copy)."""
        try:
            return self._read(key, index)
        finally:
            self._release_pages()

    def _release_pages(self) -> None:
        """Drop the file's pages from this process (they stay in the page cache): a conversion
        otherwise counts every page it read in its resident memory until it ends."""
        mapped = getattr(self._reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def _read(self, key: str, index: Index | None) -> torch.Tensor:
        if key in self._blocks:
            if index is not None:
                raise CheckpointError(f"{self.path}: {key!r} (raw blocks) is read whole")
            weight = self._blocks[key]
            return self._rows(weight, torch.from_numpy(np.array(self._tensor(weight).data))).contiguous()
        t = self._tensor(key)
        plain = self._row_heads(key) is None and not self._transposed(key, t)
        if plain and (t.tensor_type in _PLAIN or t.tensor_type == GGMLQuantizationType.BF16):
            # No reordering needed: copy just the selected part out of the memory map.
            data = self._unquantized(t)
            return self._to_torch(t, data if index is None else data[index])
        if self._cached is not None and self._cached[0] == key:
            full = self._cached[1]
        else:
            full = self._decode(key, t)
        if index is None:
            self._cached = None  # the caller takes the whole tensor; no slices will follow
            return full
        self._cached = (key, full)
        return full[index].clone()

    @staticmethod
    def _unquantized(t: ReaderTensor) -> np.ndarray:
        # The reader gives BF16 as raw bytes; reinterpret them in place (no copy) as 16-bit words.
        return t.data.view(np.int16) if t.tensor_type == GGMLQuantizationType.BF16 else t.data

    @staticmethod
    def _to_torch(t: ReaderTensor, data: np.ndarray) -> torch.Tensor:
        w = torch.from_numpy(np.array(data))  # copy: the memory map is read-only
        return w.view(torch.bfloat16) if t.tensor_type == GGMLQuantizationType.BF16 else w

    def _decode(self, key: str, t: ReaderTensor) -> torch.Tensor:
        self._cached = None  # free the previous tensor before building the next
        qtype = t.tensor_type
        shape = tuple(int(d) for d in reversed(t.shape))
        if qtype in _PLAIN or qtype == GGMLQuantizationType.BF16:
            w = self._to_torch(t, self._unquantized(t))
        else:
            try:
                w = torch.from_numpy(dequantize(t.data, qtype))
            except NotImplementedError:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has type {qtype.name}, "
                                      "which the gguf package cannot dequantize") from None
        w = self._rows(key, w.reshape(shape))
        if self._transposed(key, t):
            w = w.t()
        return w.contiguous()

    def _rows(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` (weight ``key``'s values or raw blocks, a row per output) in HF row order: llama
        q/k rows un-permuted (whole rows move, so blocks along a row stay intact)."""
        if (heads := self._row_heads(key)) is not None:
            if w.shape[0] % (2 * heads):
                raise CheckpointError(f"{self.path}: tensor {self._tensor(key).name!r} has {w.shape[0]} rows, "
                                      f"not a multiple of 2 x {heads} heads")
            w = _unpermute_rows(w, heads)
        return w

    def hf_config(self) -> dict:
        """A Hugging Face ``config.json`` dict built from the GGUF metadata."""
        a = self.arch
        m = lambda k, d=None: self._meta(f"{a}.{k}", d)  # noqa: E731
        embed = "transformer.wte.weight" if a == "gpt2" else "model.embed_tokens.weight"
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = m("vocab_size") or (len(tokens.data) if tokens else None) or self.shape(embed)[0]
        tied = "output.weight" not in self._gguf_names
        if a == "gpt2":
            config: dict[str, Any] = {
                "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": int(vocab),
                "n_embd": int(m("embedding_length")), "n_layer": int(m("block_count")),
                "n_head": int(m("attention.head_count")), "n_positions": int(m("context_length")),
                "n_ctx": int(m("context_length")),
                "layer_norm_epsilon": _float(m("attention.layer_norm_epsilon", 1e-5)),
                "activation_function": "gelu_new", "tie_word_embeddings": tied, "torch_dtype": "float32",
            }
            if m("feed_forward_length") is not None:
                config["n_inner"] = int(m("feed_forward_length"))
        else:
            cls, model_type = _LLAMA_LIKE[a]
            hidden, heads = int(m("embedding_length")), int(m("attention.head_count"))
            head_dim = int(m("attention.key_length") or hidden // heads)
            config = {
                "architectures": [cls], "model_type": model_type, "vocab_size": int(vocab),
                "hidden_size": hidden, "intermediate_size": int(m("feed_forward_length")),
                "num_hidden_layers": int(m("block_count")), "num_attention_heads": heads,
                "num_key_value_heads": int(m("attention.head_count_kv", heads)),
                "head_dim": head_dim, "rms_norm_eps": _float(m("attention.layer_norm_rms_epsilon", 1e-5)),
                "rope_theta": _float(m("rope.freq_base", 10000.0)),
                "max_position_embeddings": int(m("context_length")), "tie_word_embeddings": tied,
                "hidden_act": "silu", "torch_dtype": "float32",
                "attention_bias": any(n.endswith(".attn_q.bias") for n in self._gguf_names),
            }
            if (scaling := self._rope_scaling(config)) is not None:
                config["rope_scaling"] = scaling
        for name in ("bos", "eos", "pad"):
            field = "padding" if name == "pad" else name
            if (token := self._meta(f"tokenizer.ggml.{field}_token_id")) is not None:
                config[f"{name}_token_id"] = int(token)
        return config

    def _rope_scaling(self, config: dict) -> dict | None:
        a = self.arch
        kind = self._meta(f"{a}.rope.scaling.type")
        factor = self._meta(f"{a}.rope.scaling.factor")
        original = self._meta(f"{a}.rope.scaling.original_context_length")
        if kind == "linear":
            return {"rope_type": "linear", "factor": _float(factor)}
        if kind == "yarn":
            return {"rope_type": "yarn", "factor": _float(factor),
                    "original_max_position_embeddings": int(original or config["max_position_embeddings"])}
        if kind not in (None, "none"):
            raise CheckpointError(f"{self.path}: rope scaling type {kind!r} is not supported "
                                  "(supported: linear, yarn)")
        if "rope_freqs.weight" in self._gguf_names:
            t = next(t for t in self._reader.tensors if t.name == "rope_freqs.weight")
            dims = int(self._meta(f"{a}.rope.dimension_count", config["head_dim"]))
            if t.n_elements != dims // 2:
                raise CheckpointError(f"{self.path}: rope_freqs has {t.n_elements} values, expected {dims // 2}")
            return _llama3_scaling(np.asarray(t.data, dtype=np.float64), config["rope_theta"], dims,
                                   int(original or 8192))
        return None

    def save_tokenizer(self, output_dir: Path) -> None:
        """Write the HF tokenizer files (chat template included) and ``generation_config.json``."""
        output_dir = Path(output_dir)
        try:
            tokenizer = hf_tokenizer(self.path)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
        tokenizer.save_pretrained(output_dir)
        config = self.hf_config()
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (output_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _llama3_scaling(divisors: np.ndarray, theta: float, dims: int, original: int) -> dict | None:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency divisors (``rope_freqs``).

    llama.cpp divides frequency i by d_i: 1 for short wavelengths, ``factor`` for long ones, and
    1 / ((1 - s) / factor + s) between, with s = (original / wavelength - low) / (high - low).
    Only original/low and original/high matter, so ``original`` can be any fixed value.
    """
    factor = float(divisors.max())
    if factor <= 1.0:
        return None  # all ones: no scaling at all
    wavelen = 2 * np.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    tol = 1e-4 * factor
    band = (divisors > 1 + tol) & (divisors < factor - tol)
    x = original / wavelen[band]
    s = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)  # s = (x - low) / (high - low)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(x, s, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:
        # Too few blend points to fit. Edges anywhere in the gaps around them split the frequencies
        # the same way, so place them there (through the one blend point when there is one).
        ones, full = wavelen[divisors <= 1 + tol], wavelen[divisors >= factor - tol]
        short = ones.max() if ones.size else wavelen.min() / 2
        long = full.min() if full.size else wavelen.max() * 2
        if band.any():
            span = 0.5 * min((x[0] - original / long) / s[0], (original / short - x[0]) / (1 - s[0]))
            low, high = x[0] - s[0] * span, x[0] + (1 - s[0]) * span
        else:
            low = original / (short * (long / short) ** (2 / 3))
            high = original / (short * (long / short) ** (1 / 3))
    return {"rope_type": "llama3", "factor": _float(factor), "low_freq_factor": round(float(low), 6),
            "high_freq_factor": round(float(high), 6), "original_max_position_embeddings": original}

