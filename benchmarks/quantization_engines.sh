#!/usr/bin/env bash
# Builds one engine per quantization mode of MODEL (an HF dir or GGUF file) under OUT, for
# benchmarks/quantization.py. Existing engines are kept (delete one to rebuild it).
# SmolLM2's hidden size (576) is not a multiple of 128, so the coarse 4-bit groups are 192
# (the next size that divides every layer's inputs and tiles in 32s).
#
#   benchmarks/quantization_engines.sh MODEL OUT
set -euo pipefail
model=${1:?usage: quantization_engines.sh MODEL OUT}
out=${2:?usage: quantization_engines.sh MODEL OUT}
build_flags=(--max_batch_size 32 --max_seq_len 1024 --max_input_len 768)
mkdir -p "$out"

engine() {  # NAME DTYPE CONVERT_FLAGS...
    local name=$1 dtype=$2
    shift 2
    [[ -f "$out/$name/config.json" ]] && return
    echo "== $name: kiln convert $* (engine $dtype)"
    rm -rf "$out/$name.ckpt"
    /usr/bin/time -f "$name convert: %e s" kiln convert --model_dir "$model" --output_dir "$out/$name.ckpt" "$@"
    kiln build --checkpoint_dir "$out/$name.ckpt" --output_dir "$out/$name" --dtype "$dtype" "${build_flags[@]}"
    rm -rf "$out/$name.ckpt"
}

engine fp32 float32 --dtype float32
engine bf16 bfloat16
engine W8A16 bfloat16 --quant_algo W8A16
engine W8A16-head bfloat16 --quant_algo W8A16 --exclude_modules
engine W4A16-g64 bfloat16 --quant_algo W4A16 --group_size 64 --has_zero_point
engine W4A16-g192 bfloat16 --quant_algo W4A16 --group_size 192 --has_zero_point
engine W4A16-g32 bfloat16 --quant_algo W4A16 --group_size 32 --has_zero_point
engine W4A16-g64-head bfloat16 --quant_algo W4A16 --group_size 64 --has_zero_point --exclude_modules
engine AWQ-g64 bfloat16 --quant_algo W4A16_AWQ --group_size 64 --has_zero_point
engine AWQ-g192 bfloat16 --quant_algo W4A16_AWQ --group_size 192 --has_zero_point
engine GPTQ-g64 bfloat16 --quant_algo W4A16_GPTQ --group_size 64 --has_zero_point --calib_size 128
engine GPTQ-g192 bfloat16 --quant_algo W4A16_GPTQ --group_size 192 --has_zero_point --calib_size 128
engine AWQ+GPTQ-g64 bfloat16 --quant_algo W4A16_AWQ --group_size 64 --has_zero_point --awq_gptq --calib_size 128
engine IMATRIX-g32 bfloat16 --quant_algo W4A16_IMATRIX
engine FP8 bfloat16 --quant_algo FP8
engine W4A8_AWQ-g64 bfloat16 --quant_algo W4A8_AWQ --group_size 64 --has_zero_point
engine SQ bfloat16 --quant_algo W8A8_SQ_PER_CHANNEL --smoothquant_alpha search
engine SQ-a0.5 bfloat16 --quant_algo W8A8_SQ_PER_CHANNEL --smoothquant_alpha 0.5
engine KV-INT8 bfloat16 --kv_cache_quant_algo INT8
engine KV-FP8 bfloat16 --kv_cache_quant_algo FP8
