"""``kiln lora convert``: a Hugging Face PEFT LoRA adapter -> reference 004's tensors."""
from __future__ import annotations


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
    c.add_argument("-i", "--input_dir", required=True, help="the PEFT adapter directory")
    c.add_argument("-o", "--output_dir", required=True, help="where to write the two .npy files (replaced atomically)")
    c.add_argument("--storage_type", choices=["float16", "float32"], default="float16",
                   help="dtype of the weights tensor (default float16; the config tensor is int32)")
    c.set_defaults(handler=run_convert)


def run_convert(args) -> int:
    from kiln.checkpoint.peft import CONFIG_FILE, WEIGHTS_FILE, convert_peft_adapter, load_lora_dir

    out = convert_peft_adapter(args.input_dir, args.output_dir, args.storage_type)
    weights, config = load_lora_dir(out)
    layers = sorted({int(row[1]) for row in config})
    print(f"wrote {out / WEIGHTS_FILE} ({weights.dtype}, {list(weights.shape)}) and {out / CONFIG_FILE} "
          f"({len(config)} module rows over {len(layers)} layers, ranks {sorted({int(r[2]) for r in config})})")
    return 0
