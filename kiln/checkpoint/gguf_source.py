"""Read a GGUF file as if it were a Hugging Face checkpoint.

GGUF (llama.cpp's format) renames tensors, may quantize them, reorders the rows of some query/key
projections for its rotary kernel, shifts Gemma 3's norms, splits DeepSeek-V2's ``kv_b_proj`` in
two and keeps the config as metadata. :class:`GGUFSource` undoes all of that, so the weights
loader sees Hugging Face names, shapes, layouts and a Hugging Face style config; what differs per
architecture is a declaration in ``kiln.checkpoint.gguf_architectures`` / ``gguf_moe`` /
``gguf_gemma4``.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from kiln.checkpoint.gguf_architectures import ARCHITECTURES
from kiln.checkpoint.gguf_declaration import Joined, Meta
from kiln.checkpoint.tensor_source import Index
from kiln.errors import CheckpointError
from kiln.tokenizer import hf_tokenizer

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Types the reader hands over as ready numpy arrays of the right dtype.
_PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64,
          GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
          GGMLQuantizationType.I64}
FLOAT_TYPES = (*_PLAIN, GGMLQuantizationType.BF16)  # types stored as plain numbers, not blocks
# A weight's raw blocks, listed beside it by a source opened with ``blocks=True``:
# ``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.gguf_blocks``.
BLOCKS = "gguf_blocks"


class _Reader(GGUFReader):
    """The gguf package's reader, slicing a plain array view of its memory map: numpy's memmap
    slices cost more than the reading itself, and a GGUF's tokenizer is 100k+ strings (GPT-2's
    vocabulary: ~4x faster). Tensor data stays in the mapped file."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _dims(t: ReaderTensor) -> tuple[int, ...]:
    """GGUF tensor ``t``'s shape in torch's order (GGUF lists the fastest-moving dim first)."""
    return tuple(int(d) for d in reversed(t.shape))


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k reorder, which interleaves the two rotary halves of each head."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource:
    """A ``.gguf`` file seen as a Hugging Face checkpoint: HF names, shapes, layouts and config.

    Quantized tensors are dequantized to float32 on read; F32/F16/BF16 keep their dtype (norms
    stored with an offset come back float32, the offset taken off). Only the most recently read
    tensor is kept, fully decoded, for further slices. With ``blocks`` each quantized weight is
    also listed as its raw blocks, ``<stem>.gguf_blocks``: uint8 ``[rows, bytes a row]`` in HF row
    order (stacked experts: ``[experts, rows, bytes a row]``), read whole (``kiln.quantization.gguf``
    imports them without dequantizing).
    """

    def __init__(self, path: Path, blocks: bool = False):
        self.path, self.blocks = Path(path), blocks
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        try:
            self._reader = _Reader(self.path)
        except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.arch = self._meta("general.architecture")
        if self.arch is None:
            raise CheckpointError(f"{self.path}: metadata key 'general.architecture' is missing")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.spec = ARCHITECTURES[self.arch]
        # Blocks from here on are multi-token-prediction layers (Qwen3.5 files that keep them).
        nextn = int(self._meta(f"{self.arch}.nextn_predict_layers", 0) or 0) if self.spec.nextn else 0
        first_mtp = int(self._meta(f"{self.arch}.block_count", 0)) - nextn if nextn else None
        self._gguf: dict[str, ReaderTensor] = {}
        self._tensors: dict[str, ReaderTensor] = {}  # HF name -> its GGUF tensor
        self._joined: dict[str, tuple[Joined, list[ReaderTensor | None]]] = {}  # HF name -> its GGUF parts
        for t in self._reader.tensors:
            self._check_size(t)
            self._gguf[t.name] = t
            if t.name in self.spec.extra_tensors:
                continue  # read by the architecture's config function
            if (part := self.spec.part_of(t.name)) is not None:
                hf, joined, i = part
                self._joined.setdefault(hf, (joined, [None] * len(joined.parts)))[1][i] = t
                continue
            hf = (first_mtp is not None and self.spec.mtp_name(t.name, first_mtp)) or self.spec.hf_name(t.name)
            if hf is None:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has no Hugging Face counterpart "
                                      f"for architecture {self.arch!r}")
            self._tensors[hf] = t
        self._check_joined()
        self._blocks = {f"{key[:-len('weight')]}{BLOCKS}": key for key, t in self._tensors.items()
                        if blocks and not self.spec.transposed and key.endswith(".weight")
                        and len(t.shape) in (2, 3) and t.tensor_type not in FLOAT_TYPES}
        self._cached: tuple[str, torch.Tensor] | None = None

    def _check_joined(self) -> None:
        """Every joined weight has all its parts, and no whole tensor beside them."""
        for key, (joined, parts) in self._joined.items():
            if None in parts or key in self._tensors:
                have = [t.name for t in parts if t is not None] + ([self._tensors[key].name] if key in self._tensors
                                                                    else [])
                raise CheckpointError(f"{self.path}: {key!r} is read from GGUF tensors {' and '.join(joined.parts)} "
                                      f"of its layer; the file has {', '.join(have)}")

    def _check_size(self, t: ReaderTensor) -> None:
        # The reader rejects most truncations itself; this catches a short memory map it lets by.
        if t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has {t.data.nbytes} of {t.n_bytes} bytes "
                                  "(file truncated?)")

    def _meta(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def keys(self) -> Iterable[str]:
        return [*self._tensors, *self._joined, *self._blocks]

    def tensor_type(self, key: str) -> GGMLQuantizationType:
        """The GGUF type of tensor ``key`` (an HF name; a joined one's parts must share it)."""
        if key in self._joined:
            types = {t.tensor_type for t in self._joined[key][1]}
            if len(types) > 1:
                raise CheckpointError(f"{self.path}: the parts of {key!r} have different types")
            return types.pop()
        return self._tensor(key).tensor_type

    def _tensor(self, key: str) -> ReaderTensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {key!r}") from None

    def _transposed(self, key: str, t: ReaderTensor) -> bool:
        # GGUF keeps gpt2 linears as [out, in]; HF's Conv1D wants [in, out].
        return bool(self.spec.transposed) and len(t.shape) == 2 and key.endswith(self.spec.transposed)

    def _offset(self, key: str) -> float:
        return self.spec.offset_of(self._tensor(key).name)

    def _row_heads(self, key: str) -> int | None:
        """Heads to un-permute over for permuted q/k weights and biases, else None."""
        if not self.spec.permuted_qk:
            return None
        if ".q_proj." in key:  # (self_attn's; Nemotron-H's mixer's)
            return int(self._meta(f"{self.arch}.attention.head_count"))
        if ".k_proj." in key:
            heads = self._meta(f"{self.arch}.attention.head_count")
            kv_heads = self._meta(f"{self.arch}.attention.head_count_kv", heads)
            if isinstance(kv_heads, list):  # one count per layer (hybrids: 0 on the recurrent layers)
                kv_heads = kv_heads[int(key[len(self.spec.layers) + 1:].split(".", 1)[0])]
            return int(kv_heads)
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._blocks:
            return tuple(self._tensor(self._blocks[key]).data.shape)
        if key in self._joined:  # joined on the meta device: shapes only
            joined, parts = self._joined[key]
            return tuple(joined.join(*(torch.empty(_dims(t), device="meta") for t in parts)).shape)
        t = self._tensor(key)
        shape = _dims(t)
        shape = shape[::-1] if self._transposed(key, t) else shape
        if (convert := self.spec.conversion_of(key)) is not None:  # on the meta device: the shape only
            shape = tuple(convert(torch.empty(shape, device="meta")).shape)
        return shape

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
        t = self._tensors.get(key)
        plain = (t is not None and self._row_heads(key) is None and not self._transposed(key, t)
                 and self.spec.conversion_of(key) is None)
        if plain and not self._offset(key) and t.tensor_type in FLOAT_TYPES:
            # No reordering needed: copy just the selected part out of the memory map.
            data = self._unquantized(t)
            return self._to_torch(t, data if index is None else data[index])
        if self._cached is not None and self._cached[0] == key:
            full = self._cached[1]
        else:
            full = self._decode(key)
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

    def _values(self, t: ReaderTensor) -> torch.Tensor:
        """GGUF tensor ``t``'s values, dequantized when it is quantized, in [out, in] order."""
        if t.tensor_type in FLOAT_TYPES:
            w = self._to_torch(t, self._unquantized(t))
        else:
            try:
                w = torch.from_numpy(dequantize(t.data, t.tensor_type))
            except NotImplementedError:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                                      "which the gguf package cannot dequantize") from None
        return w.reshape(_dims(t))

    def _decode(self, key: str) -> torch.Tensor:
        self._cached = None  # free the previous tensor before building the next
        if key in self._joined:
            joined, parts = self._joined[key]
            return joined.join(*(self._values(part) for part in parts)).contiguous()
        t = self._tensor(key)
        w = self._rows(key, self._values(t))
        if self._transposed(key, t):
            w = w.t()
        if offset := self._offset(key):
            w = w.float() - offset
        if (convert := self.spec.conversion_of(key)) is not None:
            w = convert(w.float())
        return w.contiguous()

    def _rows(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` (weight ``key``'s values or raw blocks, a row per output) in HF row order: permuted
        q/k rows un-permuted (whole rows move, so blocks along a row stay intact)."""
        if (heads := self._row_heads(key)) is not None:
            if w.shape[0] % (2 * heads):
                raise CheckpointError(f"{self.path}: tensor {self._tensor(key).name!r} has {w.shape[0]} rows, "
                                      f"not a multiple of 2 x {heads} heads")
            w = _unpermute_rows(w, heads)
        return w

    def hf_config(self) -> dict:
        """A Hugging Face ``config.json`` dict built from the GGUF metadata, as llama.cpp reads it."""
        meta = Meta(self.path, self.arch, self._reader.fields, self._gguf)
        config = {"architectures": [self.spec.hf_architecture], "model_type": self.spec.model_type,
                  **self.spec.config(meta), "torch_dtype": "float32"}
        if unread := meta.unread():
            raise CheckpointError(f"{self.path}: metadata {', '.join(map(repr, unread))} of a {self.arch!r} file is "
                                  "not supported (llama.cpp would compute differently with it)")
        for name in ("bos", "eos", "pad"):
            field = "padding" if name == "pad" else name
            if (token := self._meta(f"tokenizer.ggml.{field}_token_id")) is not None:
                config[f"{name}_token_id"] = int(token)
        return config

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
