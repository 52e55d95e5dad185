"""One build path: ``LLM(src)``, ``kiln run --engine_dir src`` and ``kiln serve src`` resolve a
Hugging Face directory or a GGUF file to the same cached engine, whose dtype is what ``kiln
convert`` + ``kiln build --dtype auto`` writes (bf16 on a CPU with native bf16), with the same
limits (beam search works from the CLI too); a dtype chosen at convert time carries through."""
from __future__ import annotations

import json

import pytest

from kiln import LLM
from kiln.build.builder import cpu_has_native_bf16
from kiln.cli import run as run_cli
from kiln.cli import serve as serve_cli
from kiln.cli.main import build_parser, main
from tests.utils.fakes import make_tiny_llama_with_tokenizer
from tests.utils.real_model import smollm2_gguf_path


def _engine_config(engine_dir) -> dict:
    return json.loads((engine_dir / "config.json").read_text())


@pytest.fixture(params=["hf", "gguf"])
def source(request, tmp_path):
    if request.param == "gguf":
        return smollm2_gguf_path()
    make_tiny_llama_with_tokenizer(tmp_path / "hf")
    return tmp_path / "hf"


def test_llm_run_and_serve_resolve_one_engine_as_kiln_build_auto_builds_it(source, tmp_path, capsys):
    cache = tmp_path / "cache"
    engine = LLM(source, cache_dir=cache, progress=False).engine_dir
    parse = build_parser().parse_args
    assert run_cli.engine_dir_for(parse(["run", "--engine_dir", str(source), "--cache_dir", str(cache),
                                         "--input_text", "hi"])) == engine
    assert serve_cli.engine_dir_for(parse(["serve", str(source), "--cache_dir", str(cache)])) == engine
    assert main(["convert", "--model_dir", str(source), "--output_dir", str(tmp_path / "ckpt")]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "eng")]) == 0
    built, cached = _engine_config(tmp_path / "eng"), _engine_config(engine)
    # the bundled GGUF is quantized: its kernels compute in bf16 on any CPU
    assert cached["dtype"] == built["dtype"] == ("bfloat16" if cpu_has_native_bf16() or source.suffix == ".gguf"
                                                 else "float32")
    assert cached["build_config"]["max_beam_width"] >= 2
    assert main(["run", "--engine_dir", str(source), "--cache_dir", str(cache), "--num_beams", "2",
                 "--max_output_len", "4", "--input_text", "hi"]) == 0
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [engine.name]  # nothing else was built
    capsys.readouterr()


def test_a_dtype_chosen_at_convert_carries_through_kiln_build(tmp_path):
    make_tiny_llama_with_tokenizer(tmp_path / "hf")
    assert main(["convert", "--model_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"),
                 "--dtype", "float32"]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "eng")]) == 0
    assert _engine_config(tmp_path / "eng").get("dtype", "float32") == "float32"
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "eng16"),
                 "--dtype", "bfloat16"]) == 0
    assert _engine_config(tmp_path / "eng16")["dtype"] == "bfloat16"


def test_serve_limits_within_the_engine_are_run_time_settings(tmp_path):
    """kiln serve's --max_batch_size / --max_num_tokens do not key another engine unless they
    exceed what the cached engine is built for."""
    make_tiny_llama_with_tokenizer(tmp_path / "hf")
    cache, parse = tmp_path / "cache", build_parser().parse_args
    serve = ["serve", str(tmp_path / "hf"), "--cache_dir", str(cache)]
    engine = serve_cli.engine_dir_for(parse(serve))
    assert serve_cli.engine_dir_for(parse([*serve, "--max_batch_size", "8", "--max_num_tokens", "256"])) == engine
    larger = serve_cli.engine_dir_for(parse([*serve, "--max_batch_size", "128"]))
    assert larger != engine and _engine_config(larger)["build_config"]["max_batch_size"] == 128
