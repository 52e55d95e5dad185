"""``kiln lora convert``: a Hugging Face PEFT LoRA adapter -> reference 004's tensors; ``kiln lora
normalize-dora``: the same for a DoRA adapter, its magnitudes normalized against the base weights;
``kiln lora convert-prompt``: a PEFT prompt-tuning adapter -> its virtual-token table."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from kiln.checkpoint.peft import (CONFIG_FILE, STORAGE_TYPES, WEIGHTS_FILE, convert_peft_adapter,
                                  load_lora_dir, peft_prompt_table)


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapter tools",
                       description="Tools for LoRA adapters in the reference tensor format "
                                   "(weights [rows, D x Hi + Ho x D], config [rows, 3] = [module_id, layer_idx, D]).")
    tools = p.add_subparsers(dest="tool", required=True)
    c = tools.add_parser("convert", help="convert a PEFT LoRA adapter into model.lora_weights.npy / "
                                         "model.lora_config.npy",
                         description="Read a Hugging Face PEFT LoRA adapter (adapter_config.json and "
                                     "adapter_model.safetensors or .bin; targets q/k/v/o_proj, gate/up/down_proj "
                                     "and the fused qkv_proj, query_key_value, gate_up_proj) and write the "
                                     "reference's weights and config tensors as NumPy files, with PEFT's scaling "
                                     "(lora_alpha / r, or / sqrt(r) with rsLoRA) folded into the out weights.")
    _in_out(c, "the PEFT adapter directory", "--output_dir", "where to write the two .npy files (replaced atomically)",
            "float16", "dtype of the weights tensor (default float16; the config tensor is int32)")
    c.set_defaults(handler=run_convert)
    d = tools.add_parser("normalize-dora", help="convert a PEFT DoRA adapter, normalizing its magnitudes against "
                                                "the base weights",
                         description="Convert a Hugging Face PEFT DoRA adapter (use_dora) as kiln lora convert does, "
                                     "with config rows [module_id, layer_idx, D, is_dora] and each row's magnitude "
                                     "vector divided by the row norms of W + B A, where W is the base model's weight "
                                     "(what PEFT computes at every call; the engine takes it precomputed). Engines "
                                     "take DoRA adapters when built with --dora_plugin enable.")
    _in_out(d, "the PEFT DoRA adapter directory", "--output_dir", "where to write the two .npy files (replaced "
            "atomically)", "float16", "dtype of the weights tensor (default float16; the config tensor is int32)")
    d.add_argument("--base_model", required=True,
                   help="the model the adapter was trained on: a Hugging Face directory or a GGUF file (not a "
                        "kiln checkpoint or engine, whose weights may be quantized or fused)")
    d.set_defaults(handler=run_convert)
    t = tools.add_parser("convert-prompt", help="convert a PEFT prompt-tuning adapter into a table (.npy)",
                         description="Write the virtual-token table [num_virtual_tokens, hidden] of a Hugging Face "
                                     "PEFT prompt-tuning adapter (its prompt_embeddings) as a NumPy file, for "
                                     "requests that name its rows as token ids vocab_size + i.")
    _in_out(t, "the PEFT prompt-tuning adapter directory", "--output", "the .npy file to write", "float32",
            "dtype of the table (default float32)")
    t.set_defaults(handler=run_convert_prompt)


def _in_out(parser, input_help: str, output_flag: str, output_help: str, storage_default: str,
            storage_help: str) -> None:
    """A converter's -i (adapter directory), -o and --storage_type."""
    parser.add_argument("-i", "--input_dir", required=True, help=input_help)
    parser.add_argument("-o", output_flag, required=True, help=output_help)
    parser.add_argument("--storage_type", choices=["float16", "float32"], default=storage_default, help=storage_help)


def run_convert(args) -> int:
    out = convert_peft_adapter(args.input_dir, args.output_dir, args.storage_type, getattr(args, "base_model", None))
    weights, config = load_lora_dir(out)
    layers = sorted({int(row[1]) for row in config})
    dora = int(config[:, 3].sum()) if config.shape[1] == 4 else 0
    print(f"wrote {out / WEIGHTS_FILE} ({weights.dtype}, {list(weights.shape)}) and {out / CONFIG_FILE} "
          f"({len(config)} module rows over {len(layers)} layers, ranks {sorted({int(r[2]) for r in config})}"
          f"{f', {dora} DoRA rows normalized' if dora else ''})")
    return 0


def run_convert_prompt(args) -> int:
    table = peft_prompt_table(args.input_dir).to(STORAGE_TYPES[args.storage_type])
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".npy", delete=False) as tmp:  # whole or nothing
        np.save(tmp, table.numpy())
    os.replace(tmp.name, out)
    print(f"wrote {out} ({args.storage_type}, {list(table.shape)}: {table.shape[0]} virtual tokens)")
    return 0
