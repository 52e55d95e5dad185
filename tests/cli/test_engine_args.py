"""EngineArgs is the one table of engine options: each command's flags and LLM's keywords come from
its fields with the field's default, and a prebuilt engine refuses options it was not built for."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from kiln import LLM
from kiln.config import BuildConfig
from kiln.config.engine_args import COMMANDS, LIMIT, EngineArgs
from kiln.errors import ConfigError
from kiln.cli.main import build_parser

# A minimal command line per command (its required arguments); bench and eval take a mode.
BASE = {"build": ["build", "--checkpoint_dir", "c", "--output_dir", "o"],
        "run": ["run", "--engine_dir", "e", "--input_text", "hi"],
        "serve": ["serve", "m"],
        "bench": ["bench", "latency", "--engine_dir", "e"],
        "eval": ["eval", "perplexity", "--engine_dir", "e", "--dataset", "d"]}


def _flag(f) -> str:
    return f.metadata["flag"] or f"--{f.name}"


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    if command in ("bench", "eval"):
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[BASE[command][1]]
    return sub


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_exactly_its_fields_flags_with_their_defaults(command):
    options = {o for a in _subparser(command)._actions for o in a.option_strings}
    parsed = build_parser().parse_args(BASE[command])
    for f in fields(EngineArgs):
        if f.name == "model":
            continue
        wanted = command in f.metadata["commands"]
        assert (_flag(f) in options) == wanted, (command, f.name)
        if wanted:
            assert getattr(parsed, f.name) == f.default, (command, f.name)
    assert EngineArgs.from_cli_args(parsed) == EngineArgs()


def test_flags_parse_into_the_fields():
    parsed = build_parser().parse_args([*BASE["serve"], "--dtype", "float32", "--max_batch_size", "8",
                                        "--tokenizer_dir", "tok", "--enable_prefix_caching", "--quantization", "W8A16"])
    args = EngineArgs.from_cli_args(parsed, model="m")
    assert args == EngineArgs(model="m", dtype="float32", max_batch_size=8, tokenizer="tok",
                              enable_prefix_caching=True, quantization="W8A16")
    with pytest.raises(SystemExit):  # argparse names the flag and the choices
        build_parser().parse_args([*BASE["run"], "--dtype", "float64"])


def test_values_are_checked_where_the_args_are_made():
    with pytest.raises(ConfigError, match="dtype 'float64' is not one of"):
        EngineArgs(dtype="float64")
    with pytest.raises(ConfigError, match="max_seq_len must be >= 1"):
        EngineArgs(max_seq_len=0)
    with pytest.raises(TypeError, match="max_sequence_len"):  # LLM's keywords are the fields, nothing else
        LLM("unused", max_sequence_len=8)


def test_run_time_limits_build_a_larger_engine_only_above_the_default():
    small = EngineArgs(max_batch_size=8, max_num_tokens=256, max_seq_len=512)
    assert small.build_options() == {"max_seq_len": 512}
    assert small.build_limits() == {"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 512}
    large = EngineArgs(max_batch_size=BuildConfig.max_batch_size + 1)
    assert large.build_options() == {"max_batch_size": BuildConfig.max_batch_size + 1}
    assert {f.name for f in fields(EngineArgs) if f.metadata.get("kind") == LIMIT} == {"max_batch_size",
                                                                                         "max_num_tokens"}


def test_a_prebuilt_engine_refuses_what_it_was_not_built_for(tmp_path):
    built = BuildConfig(max_batch_size=16, max_seq_len=1024, max_input_len=512)
    EngineArgs(max_batch_size=8, max_seq_len=1024, dtype="auto").check_engine(tmp_path, built, "bfloat16")
    with pytest.raises(ConfigError, match="max_seq_len=2048: .* built with max_seq_len=1024"):
        EngineArgs(max_seq_len=2048).check_engine(tmp_path, built, "bfloat16")
    with pytest.raises(ConfigError, match="max_batch_size=32: .* built with max_batch_size=16"):
        EngineArgs(max_batch_size=32).check_engine(tmp_path, built, "bfloat16")
    with pytest.raises(ConfigError, match="dtype=float32: .* built with dtype=bfloat16"):
        EngineArgs(dtype="float32").check_engine(tmp_path, built, "bfloat16")
