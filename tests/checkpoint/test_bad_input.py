"""Bad input at the library level: clear errors naming the culprit, and no output left behind.

Every failing ``convert_checkpoint`` / ``build_engine`` call writes into an empty parent
directory, which must still be empty afterwards (no output dir, no ``.tmp-`` sibling).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.build import build_engine
from kiln.convert import convert_checkpoint
from kiln.errors import CheckpointError, ConfigError
from tests.utils.tiny_models import make_llama


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny HF Llama directory and its converted kiln checkpoint (never modified)."""
    root = tmp_path_factory.mktemp("good")
    make_llama(root / "hf", layers=1)
    convert_checkpoint(root / "hf", root / "checkpoint", progress=False)
    return root / "hf", root / "checkpoint"


def copy_of(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / f"in-{src.name}"))


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def assert_fails_cleanly(run: Callable[[Path], object], tmp_path: Path, error: type[Exception],
                         *fragments: str) -> None:
    """``run(out)`` raises ``error`` mentioning every fragment, and leaves ``out``'s parent empty."""
    parent = tmp_path / "outputs"
    parent.mkdir()
    with pytest.raises(error) as info:
        run(parent / "out")
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    assert sorted(p.name for p in parent.iterdir()) == []


def convert(hf_dir: Path) -> Callable[[Path], object]:
    return lambda out: convert_checkpoint(hf_dir, out, progress=False)


def build(checkpoint: Path) -> Callable[[Path], object]:
    return lambda out: build_engine(checkpoint, out, progress=False)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# -- convert_checkpoint -----------------------------------------------------------------------


def test_truncated_safetensors(good, tmp_path: Path) -> None:
    """A safetensors file cut in half -> CheckpointError naming the file."""
    hf = copy_of(good[0], tmp_path)
    truncate(hf / "model.safetensors")
    assert_fails_cleanly(convert(hf), tmp_path, CheckpointError, str(hf / "model.safetensors"))


def test_missing_tensor(good, tmp_path: Path) -> None:
    """A tensor absent from the HF checkpoint -> CheckpointError naming the missing external key."""
    hf = copy_of(good[0], tmp_path)
    edit_tensors(hf / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))
    assert_fails_cleanly(convert(hf), tmp_path, CheckpointError, "model.layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("external, shape, named", [
    ("model.layers.0.self_attn.o_proj.weight", (64, 32), "transformer.layers.0.attention.dense.weight"),
    ("model.layers.0.self_attn.k_proj.weight", (24, 64), "model.layers.0.self_attn.k_proj.weight"),
    ("model.norm.weight", (65,), "transformer.ln_f.weight"),
])
def test_wrong_shape(good, tmp_path: Path, external: str, shape: tuple[int, ...], named: str) -> None:
    """A tensor replaced by a wrong-shaped one -> CheckpointError naming the parameter."""
    hf = copy_of(good[0], tmp_path)
    edit_tensors(hf / "model.safetensors", lambda t: t.update({external: torch.zeros(shape)}))
    assert_fails_cleanly(convert(hf), tmp_path, CheckpointError, named)


def test_hf_config_missing_field(good, tmp_path: Path) -> None:
    """An HF config.json without hidden_size -> ConfigError naming the field."""
    hf = copy_of(good[0], tmp_path)
    edit_json(hf / "config.json", lambda c: c.pop("hidden_size"))
    assert_fails_cleanly(convert(hf), tmp_path, ConfigError, "hidden_size")


def test_unknown_hf_architecture(good, tmp_path: Path) -> None:
    """An architecture kiln does not know -> ConfigError naming it."""
    hf = copy_of(good[0], tmp_path)
    edit_json(hf / "config.json", lambda c: c.update(architectures=["FrobnicatorForCausalLM"]))
    assert_fails_cleanly(convert(hf), tmp_path, ConfigError, "FrobnicatorForCausalLM")


def test_failed_convert_keeps_existing_output(good, tmp_path: Path) -> None:
    """Converting over an existing output dir and failing leaves the old output as it was."""
    hf = copy_of(good[0], tmp_path)
    parent = tmp_path / "outputs"
    out = convert_checkpoint(hf, parent / "out", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    edit_tensors(hf / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        convert_checkpoint(hf, out, progress=False)
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# -- build_engine ----------------------------------------------------------------------------


def test_checkpoint_config_missing_mandatory_field(good, tmp_path: Path) -> None:
    """A kiln checkpoint config.json without hidden_size -> ConfigError naming it; no engine."""
    checkpoint = copy_of(good[1], tmp_path)
    edit_json(checkpoint / "config.json", lambda c: c.pop("hidden_size"))
    assert_fails_cleanly(build(checkpoint), tmp_path, ConfigError, "hidden_size")


def test_checkpoint_unknown_architecture(good, tmp_path: Path) -> None:
    """A checkpoint whose architecture kiln does not know -> ConfigError naming it; no engine."""
    checkpoint = copy_of(good[1], tmp_path)
    edit_json(checkpoint / "config.json", lambda c: c.update(architecture="FrobnicatorForCausalLM"))
    assert_fails_cleanly(build(checkpoint), tmp_path, ConfigError, "FrobnicatorForCausalLM")


def test_checkpoint_wrong_shape(good, tmp_path: Path) -> None:
    """A misshapen tensor in rank0.safetensors -> CheckpointError naming it; no engine."""
    checkpoint = copy_of(good[1], tmp_path)
    name = "transformer.layers.0.mlp.proj.weight"
    edit_tensors(checkpoint / "rank0.safetensors", lambda t: t.update({name: torch.zeros(64, 7)}))
    assert_fails_cleanly(build(checkpoint), tmp_path, CheckpointError, name)


def test_checkpoint_truncated_rank_file(good, tmp_path: Path) -> None:
    """A truncated rank0.safetensors -> CheckpointError naming the file; no engine."""
    checkpoint = copy_of(good[1], tmp_path)
    truncate(checkpoint / "rank0.safetensors")
    assert_fails_cleanly(build(checkpoint), tmp_path, CheckpointError, str(checkpoint / "rank0.safetensors"))


# -- loading an engine ------------------------------------------------------------------------


def test_engine_of_another_format_is_refused(good, tmp_path: Path) -> None:
    """An engine written for another weight layout (an older kiln's) -> ConfigError asking for a
    rebuild, instead of kernels reading its codes in the wrong order."""
    from kiln.engine_cache import ENGINE_FORMAT_VERSION
    from kiln.runtime.engine import Engine

    engine = build_engine(good[1], tmp_path / "engine", progress=False)
    assert json.loads((engine / "config.json").read_text())["engine_format"] == ENGINE_FORMAT_VERSION
    Engine(engine)  # loads
    edit_json(engine / "config.json", lambda c: c.pop("engine_format"))  # as kiln wrote them before formats
    with pytest.raises(ConfigError, match="engine format 1.*rebuild the engine"):
        Engine(engine)
