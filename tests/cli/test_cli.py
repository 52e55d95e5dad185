"""The kiln CLI (convert, build, run) as a user runs it: summaries, streaming, and one-line errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.bench.common import precision
from kiln.cli.main import build_parser
from tests.utils.fakes import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, command: str, *names: str) -> None:
    """Exit code 2 and exactly one stderr line ``kiln <command>: error: ...`` mentioning each of ``names``."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip("\n").split("\n")
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"kiln {command}: error: "), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"


def assert_no_output(output_dir: Path) -> None:
    """A failed command leaves neither its output dir nor a temporary sibling."""
    assert not output_dir.exists()
    assert not [p.name for p in output_dir.parent.iterdir() if p.name.startswith(f".{output_dir.name}.tmp-")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny Llama HF dir with a tokenizer, converted to ``checkpoint`` and built to ``engine`` by the CLI.

    Returns the work dir and the two commands' results.
    """
    work = tmp_path_factory.mktemp("cli")
    make_tiny_llama_with_tokenizer(work / "hf")
    convert = kiln("convert", "--model_dir", work / "hf", "--output_dir", work / "checkpoint")
    build = kiln("build", "--checkpoint_dir", work / "checkpoint", "--output_dir", work / "engine",
                 "--max_seq_len", 64, "--tokens_per_block", 8)
    return {"dir": work, "convert": convert, "build": build}


@pytest.fixture(scope="module")
def work(tiny) -> Path:
    assert tiny["convert"].returncode == 0 and tiny["build"].returncode == 0, "the tiny model's convert/build failed"
    return tiny["dir"]


def test_convert_and_build_print_their_summaries(tiny):
    """convert and build succeed and print one summary line each naming what they wrote."""
    work, convert, build = tiny["dir"], tiny["convert"], tiny["build"]
    assert convert.returncode == 0, convert.stderr
    assert convert.stdout.startswith("converted LlamaForCausalLM (2 layers, float32, tp=1 pp=1) to ")
    assert str(work / "checkpoint") in convert.stdout
    assert build.returncode == 0, build.stderr
    assert build.stdout.startswith(f"built engine {work / 'engine'} (")
    assert "max_seq_len=64" in build.stdout and "tokens_per_block=8" in build.stdout
    assert (work / "engine" / "config.json").is_file() and (work / "engine" / "tokenizer.json").is_file()


def test_run_prints_text_and_stats(work):
    """kiln run prints the generated text on stdout and a stats line on stderr, with or without --streaming."""
    outputs = []
    for extra in ([], ["--streaming"]):
        result = kiln("run", "--engine_dir", work / "engine", "--input_text", "hello world", "--max_output_len", 6,
                      *extra)
        assert result.returncode == 0, result.stderr
        stats = result.stderr.strip().split("\n")[-1]
        assert "6 generated, finish: length" in stats and "tok/s" in stats, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_missing_model_dir(tmp_path):
    """convert of a path that does not exist names it."""
    out = tmp_path / "out"
    assert_one_line_error(kiln("convert", "--model_dir", tmp_path / "nope", "--output_dir", out), "convert",
                          str(tmp_path / "nope"))
    assert_no_output(out)


def test_truncated_safetensors(work, tmp_path):
    """convert of a cut-off weights file names the file."""
    hf = shutil.copytree(work / "hf", tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    out = tmp_path / "out"
    assert_one_line_error(kiln("convert", "--model_dir", hf, "--output_dir", out), "convert", "model.safetensors")
    assert_no_output(out)


def test_unknown_architecture(work, tmp_path):
    """convert of a config.json naming an unknown architecture names it and lists the supported ones."""
    hf = shutil.copytree(work / "hf", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    out = tmp_path / "out"
    assert_one_line_error(kiln("convert", "--model_dir", hf, "--output_dir", out), "convert", "FooForCausalLM",
                          "LlamaForCausalLM", "GPTNeoXForCausalLM", "QWenLMHeadModel", "LlavaForConditionalGeneration")
    assert_no_output(out)


def test_max_input_len_over_max_seq_len(work, tmp_path):
    """build with --max_input_len > --max_seq_len names both limits and writes nothing."""
    out = tmp_path / "engine"
    result = kiln("build", "--checkpoint_dir", work / "checkpoint", "--output_dir", out, "--max_input_len", 64,
                  "--max_seq_len", 32)
    assert_one_line_error(result, "build", "max_input_len", "max_seq_len")
    assert_no_output(out)


def test_dashed_aliases_and_prompt_over_max_input_len(work, tmp_path):
    """--max-input-len/--max-seq-len work; kiln run of a longer prompt then fails naming max_input_len."""
    engine = tmp_path / "engine"
    result = kiln("build", "--checkpoint-dir", work / "checkpoint", "--output-dir", engine, "--max-input-len", 4,
                  "--max-seq-len", 32)
    assert result.returncode == 0, result.stderr
    build_config = json.loads((engine / "config.json").read_text())["build_config"]
    assert (build_config["max_input_len"], build_config["max_seq_len"]) == (4, 32)
    result = kiln("run", "--engine-dir", engine, "--input-text", "the quick brown fox jumps over the lazy dog")
    assert_one_line_error(result, "run", "max_input_len 4")


def all_parsers(parser=None, prefix=()):
    """(command words, parser) of kiln and every (nested) subcommand."""
    parser = parser or build_parser()
    found = [(list(prefix), parser)]
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                found += all_parsers(sub, (*prefix, name))
    return found


@pytest.mark.parametrize("command", ["", "convert", "build", "run", "bench latency", "bench throughput"])
def test_help_exits_zero_and_lists_every_flag(command, capsys):
    """--help of kiln and of each command exits 0 and mentions every flag (and its dashed alias)."""
    parsers = dict((" ".join(args), p) for args, p in all_parsers())
    flags = [s for a in parsers[command]._actions for s in a.option_strings if s.startswith("--")]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(command.split() + ["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--help" in flags and len(flags) > 1
    missing = [f for f in flags if f not in text]
    assert not missing, f"kiln {command} --help does not mention {missing}"
    assert all(f.replace("_", "-") in flags for f in flags), "a flag lacks its dashed alias"


def test_console_script_help():
    """The installed ``kiln`` entry point runs and lists the three commands."""
    result = subprocess.run([str(Path(sys.executable).parent / "kiln"), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and all(c in result.stdout for c in ("convert", "build", "run"))


def test_bench_latency_and_throughput_record_kiln_beside_hf(work):
    """kiln bench measures kiln and the HF peer in one run and appends one JSON line per run."""
    out = work / "bench.jsonl"
    common = ["--engine_dir", work / "engine", "--hf_dir", work / "hf", "--prompt_len", 8, "--new_tokens", 4,
              "--output_json", out]
    latency = kiln("bench", "latency", *common, "--prefill_len", 16, "--rounds", 1,
                   "--speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert latency.returncode == 0, latency.stderr
    assert "decode tok/s" in latency.stdout and "host overhead" in latency.stdout
    assert "speculative decoding: " in latency.stdout
    throughput = kiln("bench", "throughput", *common, "--batch_sizes", 2, 3)
    assert throughput.returncode == 0, throughput.stderr
    lat, thr = [json.loads(line) for line in out.read_text().splitlines()]
    assert lat["kind"] == "latency" and thr["kind"] == "throughput"
    assert lat["weights"] == lat["dtype"] and f"latency: {lat['dtype']}, " in latency.stdout  # a float engine
    assert precision({"dtype": "bfloat16", "weights": "W4A16"}) == "bfloat16, weights W4A16"
    for side in ("kiln", "hf"):
        assert lat[side]["decode_tok_s"] > 0 and lat[side]["prefill_tok_s"] > 0 and lat[side]["ttft_s"] > 0
    expected_fraction = lat["kiln"]["weight_bytes"] * lat["kiln"]["decode_tok_s"] / (lat["machine"]["read_gbs"] * 1e9)
    assert lat["kiln"]["peak_rss_mb"] > 0 and lat["kiln"]["bandwidth_fraction"] == pytest.approx(expected_fraction,
                                                                                                   rel=0.02)
    assert lat["kiln"]["weight_bytes"] > 0 and lat["kiln_over_hf"]["decode_tok_s"] > 0
    assert lat["machine"]["read_gbs"] > 0 and lat["command"].startswith("kiln bench latency")
    assert 0 <= lat["kiln"]["spec_decode"]["acceptance_rate"] <= 1
    assert [b["batch"] for b in thr["batches"]] == [2, 3]
    for row in thr["batches"]:
        assert row["kiln"]["output_tok_s"] > 0 and row["hf"]["output_tok_s"] > 0 and row["kiln_over_hf"] > 0


def test_bench_rejects_batches_beyond_the_engine(work):
    result = kiln("bench", "throughput", "--engine_dir", work / "engine", "--batch_sizes", 4096, "--new_tokens", 2)
    assert_one_line_error(result, "bench", "4096", "max_batch_size")
