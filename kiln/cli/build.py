"""``kiln build``: a kiln checkpoint -> an engine directory."""
from __future__ import annotations

import json
import time

from kiln.build import build_engine, resolve_build_config
from kiln.build.builder import resolve_engine_dtype
from kiln.checkpoint.format import read_config
from kiln.config.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build a kiln checkpoint into an engine",
                       description="Validate a checkpoint against the build limits and write an engine: "
                                   "weights in the runtime's layout plus config.json with a build_config section.")
    p.add_argument("--checkpoint_dir", required=True, help="the kiln checkpoint (from kiln convert)")
    p.add_argument("--output_dir", required=True, help="where to write the engine (replaced atomically)")
    EngineArgs.add_cli_args(p, "build")
    lora = p.add_argument_group("LoRA (reference 004)")
    lora.add_argument("--lora_dir", nargs="+", default=[], metavar="DIR",
                      help="LoRA adapters to keep in the engine (PEFT adapter directories or kiln lora convert "
                           "outputs), each served by its directory's name")
    lora.add_argument("--max_lora_rank", type=int,
                      help="largest adapter rank the engine takes (default: the largest of --lora_dir)")
    lora.add_argument("--lora_target_modules", nargs="+", metavar="MODULE",
                      help="modules adapters may adapt, by the reference's names (attn_q attn_k attn_v attn_qkv "
                           "attn_dense mlp_h_to_4h mlp_4h_to_h mlp_gate mlp_gate_up) and, in hybrid models, kiln's "
                           "for recurrent mixers (mixer_in mixer_out linear_attn_qkv linear_attn_z linear_attn_b "
                           "linear_attn_a linear_attn_qkvz linear_attn_ba); default: those of --lora_dir")
    lora.add_argument("--dora_plugin", choices=["enable", "disable"], default="disable",
                      help="take DoRA adapters too (rows with is_dora and normalized magnitudes: kiln lora "
                           "normalize-dora); default disable")
    p.set_defaults(handler=run)


def run(args) -> int:
    started = time.perf_counter()
    config = read_config(args.checkpoint_dir)
    engine_args = EngineArgs.from_cli_args(args)
    dtype = resolve_engine_dtype(engine_args.dtype, config)
    build_config = resolve_build_config(config, **engine_args.build_limits())
    dora = args.dora_plugin == "enable"
    out = build_engine(args.checkpoint_dir, args.output_dir, build_config, dtype=dtype, lora_dirs=args.lora_dir,
                       max_lora_rank=args.max_lora_rank, lora_target_modules=args.lora_target_modules, dora=dora)
    limits = ", ".join(f"{k}={v}" for k, v in build_config.to_dict().items())
    print(f"built engine {out} ({dtype}; {limits}) in {time.perf_counter() - started:.1f}s")
    if args.lora_dir or args.max_lora_rank or args.lora_target_modules or dora:
        lora = json.loads((out / "config.json").read_text())["lora_config"]
        print(f"LoRA{' and DoRA' if lora['dora'] else ''}: max rank {lora['max_lora_rank']}, modules "
              f"{' '.join(lora['lora_target_modules'])}, adapters {', '.join(lora['adapters']) or 'none'}")
    return 0
