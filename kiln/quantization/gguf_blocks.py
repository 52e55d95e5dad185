"""GGUF quantized blocks decoded into integer codes, scales and offsets, without rounding.

Every GGUF block type used by llama.cpp's Q4/Q5/Q6/Q8 and K-quant files stores groups of 32 weights
(K-quants: 256-weight super-blocks of 32-weight sub-blocks, Q6_K's of 16) as ``w = code * scale +
offset``:

=======  ============================  ==============================  ===============
type     codes                         scale                           offset
=======  ============================  ==============================  ===============
Q8_0     int8 q                        d (fp16)                        none
Q4_0     u - 8 (u 0..15)               d                               none
Q4_1     u (0..15)                     d                               m (fp16)
Q5_0     u - 16 (u 0..31)              d                               none
Q5_1     u (0..31)                     d                               m
Q4_K     u (0..15)                     d * sc (6-bit sc)               -dmin * mn (6-bit mn)
Q5_K     u (0..31)                     d * sc                          -dmin * mn
Q6_K     u - 32 (u 0..63)              d * sc (int8 sc, per 16)        none
MXFP4    2 * E2M1 value (-12..12)      2 ** (e - 128) (E8M0 byte e)    none
=======  ============================  ==============================  ===============

MXFP4 keeps its 4-bit nibbles in kiln's ``e2m1`` codebook (the kernels map each nibble to twice
its E2M1 value), so its blocks take 4.5 bits a weight (float16 scales), not 8.5 as int8 codes.

These decode exactly: ``code * scale + offset`` in float32 is, bit for bit, what
``gguf.quants.dequantize`` computes (its own products in its own order). Any other type (Q2_K,
Q3_K, the IQ types; Q6_K beside another type in one fused linear, since its groups of 16 fit no
other format) is dequantized by the gguf package and rounded to nearest into int8 codes with a
float16-exact scale per 32 weights (absmax / 127): the added error is at most half that step.

``Decoded`` parts then go into one kiln format (``to_format``): 8-bit codes hold every 4-bit or
5-bit group exactly, so the parts of a fused linear take the finest of their formats. K-quants
keep their scales and minimums as the file does, 6- or 8-bit codes under a float16 per
super-block (kiln's ``super_scales``: 4.625 bits a Q4_K weight, against the file's 4.5 and 5 with
float16 scale and offset pairs; Q6_K 6.5625, as the file); a fused linear mixing them with other
types expands them to floats.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from kiln.layers.quantized_matmul import E2M1_DOUBLED, e8m0_half
from kiln.quantization.weight_only import fp16_exact, pack_4bit

T = GGMLQuantizationType
GROUP = 32  # weights per scale in every format imported here


@dataclass(frozen=True)
class Native:
    """The kiln format a GGUF type maps onto: code bits, a float offset per group, and whether
    the mapping keeps the file's values exactly."""

    bits: int
    offset: bool
    exact: bool = True
    codebook: str | None = None  # "e2m1": 4-bit codes are E2M1 nibbles (MXFP4)
    super_scales: bool = False  # scales and offsets as codes under super-block multipliers (K-quants)
    group: int = 32  # weights per scale


NATIVE = {T.Q8_0: Native(8, False), T.Q4_0: Native(4, False), T.Q4_1: Native(4, True), T.Q5_0: Native(8, False),
          T.Q5_1: Native(8, True), T.Q4_K: Native(4, True, super_scales=True),
          T.Q5_K: Native(8, True, super_scales=True), T.Q6_K: Native(6, False, super_scales=True, group=16),
          T.MXFP4: Native(4, False, codebook="e2m1")}
ROUNDED = Native(8, False, exact=False)  # any other quantized type: int8 codes rounded to nearest


def native(qtype: GGMLQuantizationType) -> Native:
    """The kiln format blocks of ``qtype`` import into."""
    return NATIVE.get(qtype, ROUNDED)


@dataclass
class Decoded:
    """One GGUF tensor as ``w = codes * scale + offset``: integer codes ``[rows, in]`` (int16),
    float32 ``scale`` and ``offset`` (None: zero) ``[rows, in / 32]`` (Q6_K: ``in / 16``);
    K-quants also as ``supers``: the int8 codes of ``scale`` and its float32 multipliers
    ``[rows, in / 256]`` (d), then, with offsets, those of ``offset`` (-dmin)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    supers: tuple[torch.Tensor, ...] | None = None


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 ``[blocks, 1]``."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles, then high nibbles, of ``qs`` ``[..., n]``: ``[..., 2n]`` (llama.cpp's order
    within a 32-weight block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: bit j of the block's little-endian 32-bit ``qh`` as weight j's fifth bit."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [blocks, 32]: byte 0's bits first
    return bits.astype(np.int16) << 4


def _decode_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, ...]:
    """Codes ``[blocks, 32 or 256]``, scales and offsets (or None) ``[blocks, 1 or 8]`` of one
    exact type's blocks ``[blocks, bytes]``."""
    if qtype == T.Q8_0:
        return blocks[:, 2:].view(np.int8).astype(np.int16), _half(blocks, 0), None
    if qtype == T.Q4_0:
        return _nibbles(blocks[:, 2:]) - 8, _half(blocks, 0), None
    if qtype == T.Q4_1:
        return _nibbles(blocks[:, 4:]), _half(blocks, 0), _half(blocks, 2)
    if qtype == T.Q5_0:
        return _nibbles(blocks[:, 6:]) + _fifth_bits(blocks[:, 2:6]) - 16, _half(blocks, 0), None
    if qtype == T.Q5_1:
        return _nibbles(blocks[:, 8:]) + _fifth_bits(blocks[:, 4:8]), _half(blocks, 0), _half(blocks, 2)
    if qtype == T.Q6_K:  # low nibbles, high bit pairs, int8 scales of 16 weights, d (ggml's order)
        low = (blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
        high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        codes = (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(np.int16) - 32
        sc, d = blocks[:, 192:208].view(np.int8), _half(blocks, 208)
        return codes, d * sc.astype(np.float32), None, (sc, d)
    if qtype == T.MXFP4:  # an E8M0 exponent, then 16 bytes of E2M1 nibbles (low: 0..15, high: 16..31)
        codes = np.asarray(E2M1_DOUBLED, dtype=np.int16)[_nibbles(blocks[:, 1:])]
        return codes, e8m0_half(torch.from_numpy(blocks[:, :1].copy())).numpy(), None
    # K-quants: d, dmin, 12 bytes of 6-bit sub-block scales and minimums, then the codes; each
    # 32 bytes of low nibbles hold two sub-blocks (low nibbles, then high nibbles).
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale, offset = _half(blocks, 0) * sc.astype(np.float32), -_half(blocks, 2) * mn.astype(np.float32)
    low = blocks[:, 16:144] if qtype == T.Q4_K else blocks[:, 48:176]
    codes = _nibbles(low.reshape(-1, 4, 32)).reshape(-1, 8, 32)
    if qtype == T.Q5_K:  # bit j of byte i of qh: the fifth bit of sub-block j's weight i
        qh = blocks[:, 16:48]
        codes = codes + (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int16) << 4)
    return codes.reshape(len(blocks), -1), scale, offset, (sc, _half(blocks, 0), mn, -_half(blocks, 2))


def decode(raw: torch.Tensor, qtype: GGMLQuantizationType, group: int = GROUP) -> Decoded:
    """A 2-D GGUF tensor's raw blocks (uint8 ``[rows, bytes a row]``) as codes, scales and offsets
    in groups of ``group``: rounded (int8 codes per 32) where its type's own groups differ."""
    rows = raw.shape[0]
    data = raw.numpy()
    if native(qtype).group != group or qtype not in NATIVE:  # rounded to nearest: int8 codes of the values
        w = torch.from_numpy(dequantize(data, qtype)).reshape(rows, -1, GROUP)
        scale = fp16_exact(w.abs().amax(dim=-1) / 127)
        codes = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int16)
        return Decoded(codes.reshape(rows, -1), scale, None)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    codes, scale, offset, *supers = _decode_blocks(data.reshape(-1, block_bytes), qtype)
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)  # noqa: E731
    return Decoded(as_rows(codes), as_rows(scale), None if offset is None else as_rows(offset),
                   tuple(as_rows(a) for a in supers[0]) if supers else None)


def finest(formats: list[Native]) -> Native:
    """The format holding every one of ``formats`` exactly: the most bits, an offset if any has
    one; 8 bits where 4-bit formats read their codes differently (E2M1 beside integers). Q6_K's
    groups of 16 beside others: rounded into int8 groups of 32."""
    if len({f.group for f in formats}) > 1:
        formats = [f if f.group == GROUP else ROUNDED for f in formats]
    bits, codebooks = max(f.bits for f in formats), {f.codebook for f in formats}
    if len(codebooks) > 1:
        bits, codebooks = 8, {None}
    return Native(bits, any(f.offset for f in formats), all(f.exact for f in formats),
                  codebooks.pop() if bits == 4 else None, all(f.super_scales for f in formats), formats[0].group)


# twice an E2M1 value (-12..12) + 12 -> its nibble (-1: not an E2M1 value): nibbles 0..7 hold 0 and
# the positive values, 9..15 the negative ones (8, -0, is never needed: 0 reads as nibble 0)
_E2M1_NIBBLE = np.full(25, -1, dtype=np.int16)
_E2M1_NIBBLE[np.asarray(E2M1_DOUBLED) + 12] = np.arange(16)
_E2M1_NIBBLE[12] = 0


def to_format(parts: list[Decoded], bits: int, offset: bool, codebook: str | None = None,
              super_scales: bool = False) -> dict[str, torch.Tensor]:
    """kiln's checkpoint tensors (``weight``, ``weights_scaling_factor``, ``weights_offset`` when
    ``offset``) of ``parts`` stacked along the rows, in ``bits``-bit codes; exact for parts whose
    formats ``finest`` gives this one. A 4-bit layout without offsets centres codes on 8; the
    ``e2m1`` codebook takes MXFP4 parts' doubled E2M1 values back to their nibbles;
    ``super_scales`` (K-quant parts) keeps the scales and offsets as codes, with
    ``weights_super_scale`` and ``weights_super_offset``."""
    if codebook == "e2m1":
        codes_t = torch.cat([p.codes for p in parts])
        nibbles = torch.from_numpy(_E2M1_NIBBLE)[(codes_t + 12).clamp(0, 24).long()]
        if (codes_t.abs() > 12).any() or (nibbles < 0).any():
            raise ValueError("GGUF codes are not doubled E2M1 values: they do not fit the e2m1 codebook")
        return pack_4bit(nibbles, torch.cat([p.scale for p in parts]).float().contiguous(), None, has_zero_point=False)
    codes, scales, offsets = [], [], []
    for part in parts:
        c, o = part.codes, part.offset
        if bits == 4 and o is None:  # signed codes -8..7 (Q4_0): kiln's unsigned ones
            c = c + 8
            o = -8.0 * part.scale if offset else None
        if offset and o is None:
            o = torch.zeros_like(part.scale)
        codes.append(c)
        scales.append(part.scale)
        offsets.append(o)
    codes_t, scale = torch.cat(codes), torch.cat(scales).float().contiguous()
    low, high = {4: (0, 15), 6: (-32, 31), 8: (-128, 127)}[bits]
    if codes_t.min() < low or codes_t.max() > high:
        raise ValueError(f"GGUF codes {int(codes_t.min())}..{int(codes_t.max())} do not fit {bits}-bit codes")
    if bits == 4:
        out = pack_4bit(codes_t, scale, None, has_zero_point=False)
    else:
        out = {"weight": codes_t.to(torch.int8).contiguous(), "weights_scaling_factor": scale}
    if offset:
        out["weights_offset"] = torch.cat(offsets).float().contiguous()
    if super_scales:
        for i, name in enumerate(("weights_scaling_factor", "weights_super_scale", "weights_offset",
                                  "weights_super_offset")[:4 if offset else 2]):
            out[name] = torch.cat([p.supers[i] for p in parts]).to(torch.int8 if i % 2 == 0 else torch.float32)
    return out
