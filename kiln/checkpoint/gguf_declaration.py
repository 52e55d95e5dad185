"""What a GGUF architecture's declaration is made of (``gguf_architectures``, ``gguf_moe``):
:class:`GGUFArchitecture` (the Hugging Face class it becomes, its tensors' Hugging Face names,
the layouts llama.cpp's converter changed), :class:`Meta` (the file's metadata as a config
function reads it, every key recorded), the tensor names most architectures share, and the
config fields every rotary decoder shares.

Metadata means what llama.cpp (``src/llama-model.cpp``, ``src/models/<arch>.cpp``) reads it to
mean, with llama.cpp's defaults where a key is absent. A key of the architecture nobody read
would change llama.cpp's computation in a way kiln does not know, so it is refused with a
``CheckpointError`` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from gguf.gguf_reader import ReaderField, ReaderTensor

from kiln.errors import CheckpointError

_MISSING = object()
# Keys llama.cpp reads that change nothing kiln computes (granite reads finetuned as a switch).
_HARMLESS = frozenset({"rope.scaling.finetuned"})


class Meta:
    """A GGUF file's metadata and its non-weight tensors as an architecture's config function
    reads them; every ``<arch>.<key>`` asked for is recorded (``unread`` lists the others)."""

    def __init__(self, path: Path, arch: str, fields: Mapping[str, ReaderField], tensors: Mapping[str, ReaderTensor]):
        self.path, self.arch, self._fields, self._tensors = path, arch, fields, tensors
        self._read: set[str] = set()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """``<arch>.<key>`` (a list for arrays), or ``default``; without one a missing key is an error."""
        name = f"{self.arch}.{key}"
        self._read.add(name)
        field = self._fields.get(name)
        if field is not None:
            return field.contents()
        if default is _MISSING:
            raise self.error(f"metadata key {name!r} is missing")
        return default

    def int(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if isinstance(value, list):
            raise self.error(f"metadata key '{self.arch}.{key}' has a value per layer, which kiln does not support")
        return value if value is None or value is default else int(value)

    def per_layer(self, key: str, layers: int, default: Any = _MISSING) -> list[int]:
        """``<arch>.<key>`` as one int per layer: llama.cpp's ``get_key_or_arr`` takes an array
        of ``layers`` values or one value for every layer."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(value) != layers:
                raise self.error(f"metadata key '{self.arch}.{key}' has {len(value)} values for {layers} layers")
            return [int(v) for v in value]
        return [int(value)] * layers

    def float(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        # Metadata floats are float32; their shortest repr is the decimal the converter wrote (1e-05).
        return value if value is None or value is default else float(str(np.float32(value)))

    def has(self, tensor: str) -> bool:
        return tensor in self._tensors

    def any_tensor(self, suffix: str) -> bool:
        return any(name.endswith(suffix) for name in self._tensors)

    def values(self, tensor: str) -> np.ndarray:
        return np.asarray(self._tensors[tensor].data, dtype=np.float64).reshape(-1)

    def vocab(self) -> int:
        tokens = self._fields.get("tokenizer.ggml.tokens")
        embedding = self._tensors.get("token_embd.weight")
        return int(self.get("vocab_size", None) or (len(tokens.data) if tokens else None)
                   or (embedding.shape[-1] if embedding is not None else 0))

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def unread(self) -> list[str]:
        prefix = f"{self.arch}."
        return [k for k in self._fields if k.startswith(prefix) and k not in self._read
                and k[len(prefix):] not in _HARMLESS]


@dataclass(frozen=True)
class Joined:
    """A Hugging Face tensor llama.cpp's converter split into several GGUF tensors: their block
    stems (``blk.N.<stem>``) and the function putting their values (GGUF dims reversed, torch's
    order) back together."""

    parts: tuple[str, ...]
    join: Callable[..., torch.Tensor]

@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture's file reads as a Hugging Face checkpoint."""

    hf_architecture: str
    model_type: str
    config: Callable[[Meta], dict]  # the metadata -> config.json fields (may override the two above)
    block: Mapping[str, str]  # blk.N.<gguf stem> -> <layers>.N.<HF name> (weights and biases)
    top: Mapping[str, str] = field(default_factory=lambda: LLAMA_TOP)
    layers: str = "model.layers"
    permuted_qk: bool = False  # llama.cpp's converter interleaved each head's rotary halves
    norm_offset: float = 0.0  # stored norm weights are the HF weights plus this (Gemma 3: 1)
    plain_norms: tuple[str, ...] = ()  # block stems of norms stored as they are all the same (Qwen3.5's ssm_norm)
    transposed: tuple[str, ...] = ()  # HF name suffixes stored [out, in] in GGUF, [in, out] in HF
    unsuffixed: tuple[str, ...] = ()  # HF names under <layers>.N without ".weight" (gpt-oss's sinks)
    # blk.N.<gguf stem>.<suffix> -> <layers>.N.<whole HF name>: tensors whose GGUF suffix is not
    # weight/bias or whose HF name has none (Gemma 4's router scales, layer scalar, fused experts)
    whole: Mapping[str, str] = field(default_factory=dict)
    extra_tensors: tuple[str, ...] = ()  # tensors the config function reads, not weights
    joined: Mapping[str, Joined] = field(default_factory=dict)  # HF block weight name -> its GGUF parts
    # HF name suffix -> the function giving the HF values from the stored ones (Qwen3.5's A_log,
    # stored as -exp(A_log))
    converted: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # blk.N.<stem> -> mtp.<HF name> for the multi-token-prediction blocks a file keeps after the
    # model's own (``nextn_predict_layers``); their other tensors are an MTP decoder layer's
    nextn: Mapping[str, str] = field(default_factory=dict)

    def mtp_name(self, name: str, first_mtp_block: int) -> str | None:
        """The HF name of a tensor of an MTP block (``blk.N`` with N >= ``first_mtp_block``): one of
        the ``nextn`` stems, or the block's decoder layer as ``mtp.layers.{N - first}``; None for
        tensors of the model's own blocks."""
        if not name.startswith("blk.") or name.count(".") < 2 or int(name.split(".")[1]) < first_mtp_block:
            return None
        _, layer, rest = name.split(".", 2)
        stem, _, suffix = rest.rpartition(".")
        if stem in self.nextn:
            return f"mtp.{self.nextn[stem]}.{suffix}"
        hf = self.hf_name(name)
        prefix = f"{self.layers}.{layer}."
        return None if hf is None else f"mtp.layers.{int(layer) - first_mtp_block}.{hf[len(prefix):]}"

    def hf_name(self, name: str) -> str | None:
        """The HF name of GGUF tensor ``name``; None when it has no HF counterpart."""
        if name.startswith("blk.") and name.count(".") >= 2:
            _, layer, rest = name.split(".", 2)
            if (whole := self.whole.get(rest)) is not None:  # (names without a suffix too: ssm_a)
                return f"{self.layers}.{layer}.{whole}"
        stem, dot, suffix = name.rpartition(".")
        if not dot:
            return None
        if stem.startswith("blk.") and stem.count(".") >= 2:
            _, layer, part = stem.split(".", 2)
            hf = self.block.get(part) if suffix in ("weight", "bias") else None
            if hf in self.unsuffixed:
                return f"{self.layers}.{layer}.{hf}" if suffix == "weight" else None
            return None if hf is None else f"{self.layers}.{layer}.{hf}.{suffix}"
        return f"{self.top[stem]}.{suffix}" if stem in self.top and suffix in ("weight", "bias") else None

    def part_of(self, name: str) -> tuple[str, Joined, int] | None:
        """(HF name, its declaration, the part's index) when GGUF tensor ``name`` is a part of a
        joined weight, else None."""
        if not name.startswith("blk.") or not name.endswith(".weight"):
            return None
        _, layer, part = name[:-len(".weight")].split(".", 2)
        for hf, joined in self.joined.items():
            if part in joined.parts:
                return f"{self.layers}.{layer}.{hf}.weight", joined, joined.parts.index(part)
        return None

    def offset_of(self, gguf_name: str) -> float:
        stem = gguf_name.rpartition(".")[0]
        plain = bool(self.plain_norms) and stem.endswith(self.plain_norms)
        return self.norm_offset if stem.endswith("norm") and not plain else 0.0

    def conversion_of(self, hf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The function turning HF tensor ``hf_name``'s stored values into its values, if any."""
        return next((f for suffix, f in self.converted.items() if hf_name.endswith(suffix)), None)


# ----------------------------------------------------------------------------- tensor names

LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj"}
MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Experts, each projection stacked ([experts, out, in]): kiln.layers.moe's ``per_projection`` layout.
EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
OUTPUT_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
LLAMA_BLOCK = {**ATTENTION, **MLP, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


# ----------------------------------------------------------------------------- configs


def decoder(m: Meta, *, partial_rotary: bool = False, ffn: Any = _MISSING) -> dict:
    """The fields every rotary decoder shares (no rotary base or scaling: see ``gguf_rope``)."""
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    head_dim = m.int("attention.key_length", hidden // heads)
    if m.int("attention.value_length", head_dim) != head_dim:
        raise m.error(f"metadata key '{m.arch}.attention.value_length' differs from key_length ({head_dim})")
    config = {
        "vocab_size": m.vocab(), "hidden_size": hidden, "intermediate_size": m.int("feed_forward_length", ffn),
        "num_hidden_layers": m.int("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": m.int("context_length"), "tie_word_embeddings": not m.has("output.weight"),
        "hidden_act": "silu", "attention_bias": m.any_tensor(".attn_q.bias"),
    }
    rotary = m.int("rope.dimension_count", head_dim)
    if rotary != head_dim:
        if not partial_rotary:
            raise m.error(f"metadata key '{m.arch}.rope.dimension_count' ({rotary}) is not the head size "
                          f"({head_dim}): partial rotary is not supported for {m.arch!r}")
        config["partial_rotary_factor"] = rotary / head_dim
    return config


def layer_types(m: Meta, layers: int, period: int) -> list[str]:
    """Sliding or full per layer as llama.cpp's ``load_swa_pattern``: a flag per layer in
    ``attention.sliding_window_pattern``, or a period n (default ``period``) whose last layer
    of every n is full."""
    pattern = m.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise m.error(f"metadata key '{m.arch}.attention.sliding_window_pattern' has {len(pattern)} flags "
                          f"for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]
