"""A float model to measure 4-bit quantizers on: the bundled GGUF with its Q4_1 lattice dithered away.

    python benchmarks/dithered_gguf.py --output smollm2-dithered.gguf [--seed 0]

The bundled SmolLM2-135M-Instruct is itself Q4_1: every linear's weights sit on a grid of 16
levels per block of 32 (``w = d * q + m``). A quantizer measured on it is flattered when its format
can hold that grid (32-wide groups with a float minimum hold it exactly). This writes the same
model with each Q4_1 weight moved by ``d * u``, ``u`` uniform in [-1/2, 1/2): inside a block the
values are then spread evenly over the block's range instead of 16 points, so no format holds them
exactly, while the model stays SmolLM2 (the added error is one 4-bit rounding's, its perplexity a
little higher). Every other tensor (the Q8_0 embedding, float norms) and all metadata are copied
as they are. Both kiln (``kiln convert`` with any quantization) and llama.cpp (its own quantizer,
benchmarks/quality.py ``--llamacpp``) start from this file.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from kiln.examples import smollm2_gguf_path

Q4_1_BLOCK, Q4_1_BYTES = 32, 20  # weights and bytes a block: fp16 d, fp16 m, 16 bytes of nibbles


def dithered_q4_1(raw: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Float32 weights of Q4_1 blocks ``raw`` (uint8 ``[rows, blocks * 20]``), each moved by ``d * u``."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)  # low nibbles first
    u = rng.uniform(-0.5, 0.5, size=codes.shape).astype(np.float32)
    return ((codes + u) * d + m).reshape(rows, -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="the GGUF file to write")
    p.add_argument("--source", default=None, help="a Q4_1 GGUF (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the dither (default 0)")
    args = p.parse_args(argv)

    import gguf

    reader = gguf.GGUFReader(str(args.source or smollm2_gguf_path()))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.output, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer puts these itself
        value = 0 if key == "general.file_type" else field.contents()  # 0: all F32
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub)
    rng = np.random.default_rng(args.seed)
    dithered = 0
    for t in reader.tensors:
        shape = list(reversed([int(n) for n in t.shape]))  # numpy order: rows first
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            writer.add_tensor(t.name, dithered_q4_1(np.asarray(t.data).reshape(shape[0], -1), rng))
            dithered += 1
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape,
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.output}: {dithered} Q4_1 tensors dithered to float32, the rest copied")
    return 0


if __name__ == "__main__":
    sys.exit(main())
