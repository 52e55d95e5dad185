"""Shared test setup: repo root importable, two CPU threads, and HF dir -> kiln engine in one call."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so `tests.utils` and `kiln` import from the checkout

torch.set_num_threads(2)


def convert_and_build(hf_dir: Path, work_dir: Path, build_options: dict | None = None,
                      **convert_kwargs) -> Path:
    """Convert ``hf_dir`` into ``work_dir/checkpoint`` (float32 unless ``dtype`` is given) and build
    ``work_dir/engine`` (dtype auto: the checkpoint's, as chosen); return the engine dir.

    ``build_options`` go to :func:`kiln.build.resolve_build_config` (``tokens_per_block=4``...).
    """
    from kiln.build import build_engine, resolve_build_config
    from kiln.checkpoint.format import read_config
    from kiln.convert import convert_checkpoint

    work_dir = Path(work_dir)
    convert_kwargs.setdefault("dtype", "float32")  # chosen, so the engine keeps it (exact comparisons with HF)
    checkpoint = convert_checkpoint(hf_dir, work_dir / "checkpoint", progress=False, **convert_kwargs)
    build_config = resolve_build_config(read_config(checkpoint), **(build_options or {}))
    return build_engine(checkpoint, work_dir / "engine", build_config, progress=False)


@pytest.fixture(scope="session")
def build_from_hf() -> Callable[..., Path]:
    """The :func:`convert_and_build` helper, for fixtures of any scope."""
    return convert_and_build


# -- the real model, loaded once per session (each load is ~10 s for HF and for kiln) -----------

@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' own load of the SmolLM2 GGUF, float32. Tests must not modify it."""
    from transformers import AutoModelForCausalLM

    from tests.utils.real_model import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_llm(tmp_path_factory):
    """kiln's LLM on the SmolLM2 GGUF (converted and built into a temporary cache), float32."""
    from kiln import LLM
    from tests.utils.real_model import smollm2_gguf_path

    return LLM(smollm2_gguf_path(), cache_dir=tmp_path_factory.mktemp("smollm2-engines"), dtype="float32",
               max_batch_size=8, max_seq_len=512, progress=False)


@pytest.fixture(scope="module")
def served(smollm2_llm):
    """``kiln serve`` of the bundled model's engine (the LLM fixture's), as "smollm2"."""
    from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
    from kiln.serve import create_app
    from tests.utils.server import LocalServer

    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=4096))
    server = LocalServer(create_app(smollm2_llm.engine_dir, executor_config=config, served_model_name="smollm2"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_engine_without_tokenizer(smollm2_llm, tmp_path_factory) -> Path:
    """``smollm2_llm``'s engine without its tokenizer files (the rest linked, not copied): an
    engine that runs only with a tokenizer given to it."""
    from kiln.checkpoint.format import TOKENIZER_FILES

    engine = tmp_path_factory.mktemp("smollm2-without-tokenizer")
    for path in smollm2_llm.engine_dir.iterdir():
        if path.name not in TOKENIZER_FILES:
            (engine / path.name).symlink_to(path)
    return engine
