"""kiln beside llama.cpp at real model sizes: SmolLM2-1.7B, Llama-3.2-3B and Llama-3.1-8B shapes.

    python benchmarks/scale.py --shape smollm2-1.7b [--work_dir /tmp/kiln-scale] [--rounds 3]

The models have the real shapes (hidden size, layers, FFN width, heads, KV heads, tied or
untied head) with **random weights** and SmolLM2's real tokenizer (so every shape has SmolLM2's
49,152-token vocabulary, not Llama 3's 128k). Each is written once as a sharded Hugging Face
safetensors directory and as a bf16 GGUF carrying SmolLM2's tokenizer metadata (so llama.cpp
loads it), both holding the same numbers (the GGUF's q/k rows in llama.cpp's rotary order).
Then, on this machine, with the same thread count:

* kiln convert (HF dir -> bf16, W8A16, W4A16 g64 zero-point and W4A16_IMATRIX g32 checkpoints,
  the last calibrated layer by layer on ShareGPT) and kiln build: time and peak RSS (a child
  process each);
* llama.cpp's own quantizer makes Q8_0, Q4_0 and Q4_K_M from the bf16 GGUF;
* rounds alternate engines, each round a fresh process per engine (two engines of an 8B model
  would not fit in memory together): load to first token, peak RSS, prefill tok/s at 512 tokens,
  batch-1 greedy decode tok/s (32-token prompt, ``--new_tokens``), and the share of the machine's
  measured read bandwidth the decode reaches (bytes of weights a token reads x tok/s); kiln's
  batched decode at 8 and 32 sequences too. Medians.

llama.cpp is llama-cpp-python, an optional benchmark dependency (see benchmarks/llamacpp_peer.py
for the build flags). Records go to ``--output_json`` (benchmarks/results.jsonl by default, kind
"scale"); ``python benchmarks/report.py`` puts the newest into benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kiln.bench.common import append_record, new_record
from kiln.bench.machine import machine_facts
from kiln.checkpoint.gguf_source import GGUFSource
from kiln.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter
from kiln.examples import smollm2_gguf_path
from llamacpp_peer import llamacpp_round  # benchmarks/ is on the path: scripts run from it

SHAPES = {  # hidden, layers, FFN, heads, KV heads, tied head, rope theta
    "smollm2-1.7b": (2048, 24, 8192, 32, 32, True, 130000.0),
    "llama-3.2-3b": (3072, 28, 8192, 24, 8, True, 500000.0),
    "llama-3.1-8b": (4096, 32, 14336, 32, 8, False, 500000.0),
}
VOCAB = 49152  # SmolLM2's tokenizer
SHARD_BYTES = 2 << 30
LLAMA_FTYPES = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15}  # llama_ftype values
BATCHES = (8, 32)  # kiln's batched decode, sequences per step
ROUND_ENGINES = ("kiln bf16", "llama.cpp bf16", "kiln W8A16", "llama.cpp q8_0", "kiln W4A16", "llama.cpp q4_0",
                 "kiln W4A16_IMATRIX", "llama.cpp q4_k_m")


# -- the models ---------------------------------------------------------------------------------

def hf_tensors(shape: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, "matrix" | "norm") of the HF checkpoint of ``shape``."""
    hidden, layers, ffn, heads, kv_heads, tied, _ = SHAPES[shape]
    kv = hidden // heads * kv_heads
    out = {"model.embed_tokens.weight": ((VOCAB, hidden), "matrix"), "model.norm.weight": ((hidden,), "norm")}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": ((hidden, hidden), "matrix"),
                    p + "self_attn.k_proj.weight": ((kv, hidden), "matrix"),
                    p + "self_attn.v_proj.weight": ((kv, hidden), "matrix"),
                    p + "self_attn.o_proj.weight": ((hidden, hidden), "matrix"),
                    p + "mlp.gate_proj.weight": ((ffn, hidden), "matrix"),
                    p + "mlp.up_proj.weight": ((ffn, hidden), "matrix"),
                    p + "mlp.down_proj.weight": ((hidden, ffn), "matrix"),
                    p + "input_layernorm.weight": ((hidden,), "norm"),
                    p + "post_attention_layernorm.weight": ((hidden,), "norm")})
    if not tied:
        out["lm_head.weight"] = ((VOCAB, hidden), "matrix")
    return out


def write_hf(shape: str, out: Path) -> None:
    """Random bf16 weights (N(0, 0.02); norms 1) as sharded safetensors, one tensor in memory."""
    hidden, layers, ffn, heads, kv_heads, tied, theta = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(shape)
    shards, current, size = [], [], 0
    for name, (dims, _) in tensors.items():
        current.append(name)
        size += 2 * int(np.prod(dims))
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
    shards += [current] if current else []
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for n, names in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(out / file, {k: (torch.bfloat16, tensors[k][0]) for k in names},
                                   metadata={"format": "pt"})
        for name in names:
            dims, kind = tensors[name]
            tensor = torch.ones(dims) if kind == "norm" else torch.randn(dims, generator=generator) * 0.02
            writer.write(name, tensor.to(torch.bfloat16))
            weight_map[name] = file
        writer.close()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": VOCAB, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": theta, "hidden_act": "silu", "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}, indent=1))
    GGUFSource(smollm2_gguf_path()).save_tokenizer(out)


def _rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's rotary order (what its HF converter writes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(shape: str, hf_dir: Path, out: Path) -> None:
    """The HF checkpoint's numbers as a bf16 GGUF (norms f32) with SmolLM2's tokenizer metadata."""
    import gguf

    hidden, layers, ffn, heads, kv_heads, tied, theta = SHAPES[shape]
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in parts.items()})
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    readers = {file: SafetensorsReader(hf_dir / file) for file in set(index.values())}
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"random {shape}")
    for key, value in (("block_count", layers), ("context_length", 8192), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", VOCAB),
                       ("rope.dimension_count", hidden // heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("general.file_type", 32)  # MOSTLY_BF16
    for key, field in gguf.GGUFReader(smollm2_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    order = [k for k in hf_tensors(shape)]
    for name in order:
        dims = readers[index[name]].shape(name)
        norm = len(dims) == 1
        nbytes = int(np.prod(dims)) * (4 if norm else 2)
        writer.add_tensor_info(names[name], dims, np.dtype(np.float32 if norm else np.uint16), nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.F32 if norm else gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in order:
        tensor = readers[index[name]].read(name)
        if name.endswith("q_proj.weight"):
            tensor = _rotary_rows(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _rotary_rows(tensor, kv_heads)
        array = tensor.float().numpy() if tensor.dim() == 1 else tensor.view(torch.int16).numpy().view(np.uint16)
        writer.write_tensor_data(array)
    writer.close()


# -- one engine in a child process --------------------------------------------------------------

def run_kiln(engine: str, new_tokens: int, contexts: tuple[int, ...] = ()) -> dict:
    from kiln.bench.common import ForwardTimer, stream_round, weight_bytes_per_token
    from kiln.bench.throughput import kiln_batch
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    started = time.perf_counter()
    llm = LLM(engine, progress=False, kv_cache_max_tokens=max([4096, *(c + new_tokens for c in contexts)]))
    prompt, long = _prompts(512)
    list(llm.stream(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    load = time.perf_counter() - started
    timed = time.perf_counter()
    llm.generate(long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill = len(long) / (time.perf_counter() - timed)
    _, decode = stream_round(llm, prompt, new_tokens)
    figures = {"load_to_first_token_s": load, "prefill_tok_s": prefill, "decode_tok_s": decode,
               "weight_bytes": weight_bytes_per_token(llm.engine.model)}
    if llm.core.runner.state_slot_bytes:  # a hybrid model: its recurrent state (two slots) per sequence
        figures["state_bytes_per_sequence"] = 2 * llm.core.runner.state_slot_bytes
    figures["kv_bytes_per_token"] = kv_bytes_per_token(llm.engine)
    timer = ForwardTimer(llm.core.runner.model)
    for batch in BATCHES:  # batched decode (llama-cpp-python has no batched generate to set beside it)
        # each sequence its own prompt: a mixture of experts then routes the batch's tokens apart
        prompts = [_prompts(0, seed=1 + i)[0] for i in range(batch)]
        kiln_batch(llm, prompts, 4, timer)  # warm-up at this batch size
        figures[f"decode_tok_s_batch{batch}"] = kiln_batch(llm, prompts, new_tokens // 2, timer)["decode_tok_s"]
    for context in contexts:  # batch-1 decode after a long prompt: the KV cache read grows with it
        first, decode = stream_round(llm, _prompts(context, seed=7)[1], new_tokens // 2)  # no cached prefix
        figures[f"decode_tok_s_context{context}"] = decode
        figures[f"prefill_tok_s_context{context}"] = context / first  # the prompt's prefill, to its first token
    return figures


def kv_bytes_per_token(engine) -> int:
    """K/V cache bytes a token of a sequence takes (the attention layers only: a hybrid's
    recurrent layers keep their state instead)."""
    from kiln.models.hybrid import attention_modules
    from kiln.step.kv_cache import kv_cache_dtype, layer_cache_bytes_per_token

    return layer_cache_bytes_per_token(attention_modules(engine.model.transformer.layers.values()),
                                       kv_cache_dtype(engine.config))


def run_llamacpp(gguf_path: str, new_tokens: int, contexts: tuple[int, ...] = ()) -> dict:
    import llama_cpp

    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=max([1024, *(c + new_tokens for c in contexts)]), n_batch=512,
                          n_threads=torch.get_num_threads(),
                          verbose=False)
    prompt, long = _prompts(512)
    next(iter(llm.generate(prompt, temp=0.0, top_k=1, reset=True)))
    load = time.perf_counter() - started
    llm.reset()
    timed = time.perf_counter()
    llm.eval(long)
    prefill = len(long) / (time.perf_counter() - timed)
    _, decode = llamacpp_round(llm, prompt, new_tokens)
    figures = {"load_to_first_token_s": load, "prefill_tok_s": prefill, "decode_tok_s": decode,
               "weight_bytes": gguf_bytes_per_token(gguf_path)}
    for context in contexts:
        first, decode = llamacpp_round(llm, _prompts(context, seed=7)[1], new_tokens // 2)
        figures[f"decode_tok_s_context{context}"] = decode
        figures[f"prefill_tok_s_context{context}"] = context / first
    return figures


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of a GGUF's weights one decode step reads: all, but an untied token embedding (a
    lookup reads one row of it) and, of stacked experts (``*_exps``), the ``expert_used_count`` of
    ``expert_count`` a token is routed to."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    used, count = reader.fields.get(f"{arch}.expert_used_count"), reader.fields.get(f"{arch}.expert_count")
    # (a model without experts may still write expert_count 0: Granite 4's converter)
    share = used.contents() / count.contents() if used is not None and count is not None and count.contents() else 1.0
    tensors = {t.name: int(t.n_bytes) * (share if "_exps." in t.name else 1) for t in reader.tensors}
    untied = "output.weight" in tensors
    return int(sum(tensors.values()) - (tensors["token_embd.weight"] if untied else 0))


def _prompts(long_len: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A 32-token prompt and one of ``long_len`` tokens, random ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, VOCAB, (32 + long_len,), generator=generator).tolist()
    return ids[:32], ids[32:]


def child(kind: str, path: str, new_tokens: int, contexts: tuple[int, ...] = ()) -> dict:
    """Run one engine in a fresh process; its figures plus its peak RSS."""
    code = (f"import sys, json, resource; sys.path.insert(0, {str(Path(__file__).parent)!r}); import scale; "
            f"r = scale.run_{kind}({path!r}, {new_tokens}, {tuple(contexts)!r}); "
            "r['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024; print(json.dumps(r))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_child(argv: list[str]) -> dict:
    """Time and peak RSS of a command (kiln convert / build), run under a watcher process of its own
    (a process's RUSAGE_CHILDREN keeps the largest child so far)."""
    watch = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
             "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", watch, *argv], capture_output=True, text=True)
    rc, peak = done.stdout.split()[-2:]
    if int(rc) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return {"seconds": time.perf_counter() - started, "peak_rss_mb": int(peak) / 1024}


# -- the driver -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), required=True, help="model shape to write and measure")
    p.add_argument("--work_dir", default="/tmp/kiln-scale", help="where the models and engines go (reused)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians (default 3)")
    p.add_argument("--new_tokens", type=int, default=64, help="greedy tokens decoded per round (default 64)")
    p.add_argument("--contexts", nargs="*", type=int, default=[2048],
                   help="also decode batch-1 after prompts of these many tokens (default 2048; 8192 "
                        "takes llama.cpp minutes of prefill a round)")
    p.add_argument("--engines", nargs="+", default=list(ROUND_ENGINES), choices=ROUND_ENGINES,
                   help="engines to measure (default: all)")
    p.add_argument("--drop_hf", action="store_true",
                   help="delete the HF directory once the kiln engines are built and the GGUF written, "
                        "before llama.cpp quantizes (an 8B run's disk peak: ~50 GB instead of ~70)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    kiln = [str(Path(sys.executable).parent / "kiln")]
    work = Path(args.work_dir) / args.shape
    hf, gguf_bf16 = work / "hf", work / "model-bf16.gguf"
    if not (hf / "config.json").is_file():
        print(f"writing {args.shape} (random weights) to {hf}", flush=True)
        write_hf(args.shape, hf)
    machine = machine_facts()
    record = new_record("scale", shape=args.shape, random_weights=True, vocab=VOCAB, threads=torch.get_num_threads(),
                        new_tokens=args.new_tokens, rounds=args.rounds, machine=machine, convert={}, build={})
    steps = work / "steps.json"  # convert/build figures of the engines kept from an earlier run
    if steps.is_file():
        record.update(json.loads(steps.read_text()))
    engines = {}
    for mode, flags in (("bf16", []), ("W8A16", ["--quant_algo", "W8A16"]),
                        ("W4A16", ["--quant_algo", "W4A16", "--group_size", "64", "--has_zero_point"]),
                        ("W4A16_IMATRIX", ["--quant_algo", "W4A16_IMATRIX"])):
        if f"kiln {mode}" not in args.engines:
            continue
        ckpt, engine = work / f"ckpt-{mode}", work / f"engine-{mode}"
        if not (engine / "config.json").is_file():
            print(f"kiln convert + build {mode}", flush=True)
            record["convert"][mode] = timed_child([*kiln, "convert", "--model_dir", str(hf), "--output_dir",
                                                   str(ckpt), "--dtype", "bfloat16", *flags])
            record["build"][mode] = timed_child([*kiln, "build", "--checkpoint_dir", str(ckpt), "--output_dir",
                                                 str(engine), "--max_batch_size", "32", "--max_seq_len", "8448",
                                                 "--max_input_len", "8192"])
            subprocess.run(["rm", "-rf", str(ckpt)], check=True)
            steps.write_text(json.dumps({"convert": record["convert"], "build": record["build"]}))
        engines[f"kiln {mode}"] = ("kiln", str(engine))
    # The GGUF after kiln's engines: an 8B run never holds the HF directory, a checkpoint, an
    # engine and the GGUF at once.
    if not gguf_bf16.is_file() and any(name.startswith("llama.cpp") for name in args.engines):
        print(f"writing {gguf_bf16}", flush=True)
        write_gguf(args.shape, hf, gguf_bf16)
    if args.drop_hf:
        subprocess.run(["rm", "-rf", str(hf)], check=True)
    for kind, ftype in (("bf16", None), *LLAMA_FTYPES.items()):
        name = f"llama.cpp {kind}"
        if name not in args.engines:
            continue
        path = gguf_bf16 if ftype is None else work / f"model-{kind}.gguf"
        if not path.is_file():
            print(f"llama.cpp quantize {kind}", flush=True)
            _llama_quantize(gguf_bf16, path, ftype)
        engines[name] = ("llamacpp", str(path))
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, (kind, path) in engines.items():
            runs[name].append(child(kind, path, args.new_tokens, tuple(args.contexts)))
            print(f"round {r + 1}: {name}: {runs[name][-1]['decode_tok_s']:.1f} tok/s", flush=True)
    bandwidth = machine.get("read_gbs")
    record["engines"] = {}
    for name, results in runs.items():
        figures = {key: statistics.median(run[key] for run in results)
                   for key in ("load_to_first_token_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb")}
        figures["weight_bytes"] = results[0]["weight_bytes"]
        for key in results[0]:
            if key.startswith(("decode_tok_s_batch", "decode_tok_s_context")):
                figures[key] = statistics.median(run[key] for run in results)
        if bandwidth:
            figures["bandwidth_share"] = figures["decode_tok_s"] * figures["weight_bytes"] / (bandwidth * 1e9)
        record["engines"][name] = figures
    record["command"] = " ".join(["python", "benchmarks/scale.py", *(argv if argv is not None else sys.argv[1:])])
    print(format_scale(record))
    append_record(args.output_json, record)
    return 0


def _llama_quantize(source: Path, out: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not write {out}")


def format_scale(record: dict) -> str:
    lines = [f"{record['shape']} (random weights, vocab {VOCAB}), {record['threads']} threads, "
             f"{record['new_tokens']} new tokens, median of {record['rounds']}; read bandwidth "
             f"{record['machine'].get('read_gbs', 0):.1f} GB/s",
             f"  {'engine':16} {'decode tok/s':>12} {'% bandwidth':>11} {'prefill tok/s':>13} "
             f"{'load s':>7} {'peak RSS MB':>11}"]
    for name, f in record["engines"].items():
        share = f"{100 * f['bandwidth_share']:.0f}%" if "bandwidth_share" in f else "-"
        lines.append(f"  {name:16} {f['decode_tok_s']:12.1f} {share:>11} {f['prefill_tok_s']:13.0f} "
                     f"{f['load_to_first_token_s']:7.2f} {f['peak_rss_mb']:11.0f}")
    for name, f in record["engines"].items():
        batched = [f"{b}: {f[f'decode_tok_s_batch{b}']:.1f}" for b in BATCHES if f"decode_tok_s_batch{b}" in f]
        if batched:
            lines.append(f"  {name} batched decode tok/s by batch size: {', '.join(batched)}")
        long = [f"{k.rpartition('context')[2]}: {v:.1f}" for k, v in f.items() if k.startswith("decode_tok_s_context")]
        if long:
            lines.append(f"  {name} batch-1 decode tok/s after a long prompt, by its tokens: {', '.join(long)}")
    for step in ("convert", "build"):
        for mode, f in record[step].items():
            lines.append(f"  kiln {step} {mode}: {f['seconds']:.1f} s, peak RSS {f['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
