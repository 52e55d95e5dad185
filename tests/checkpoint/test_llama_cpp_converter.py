"""A GGUF file written by llama.cpp's own converter (convert_hf_to_gguf.py of the pinned
llama-cpp-python sdist, run with its bundled gguf-py) reads back as the Hugging Face checkpoint
it came from: the other GGUF tests' files are written by kiln's own tests with the gguf package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from gguf import GGUFReader

from kiln.checkpoint.gguf_source import GGUFSource
from tests.utils.llama_cpp_gguf import converter_dir, converter_env, convert_with_llama_cpp, save_converter_tokenizer
from tests.utils.tiny_models import make_llama

VOCAB = 256


def test_llama_cpp_converted_tiny_llama_reads_back(tmp_path: Path):
    hf_dir = tmp_path / "hf"
    model = make_llama(hf_dir, vocab=VOCAB)
    assert save_converter_tokenizer(hf_dir, VOCAB) <= VOCAB
    path = convert_with_llama_cpp(hf_dir, tmp_path / "tiny-llama-f32.gguf", outtype="f32")

    # The converter ran with its own gguf-py, not the gguf package installed for kiln.
    bundled = subprocess.run([sys.executable, "-c", "import gguf; print(gguf.__file__)"], env=converter_env(),
                             check=True, capture_output=True, text=True).stdout.strip()
    assert Path(bundled).is_relative_to(converter_dir() / "gguf-py")

    fields = GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["tokenizer.ggml.model"].contents() == "llama"  # the byte-fallback BPE, read without a hash

    source = GGUFSource(path)
    expected = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in source.keys()
    assert sorted(source.keys()) == sorted(expected)
    for key, want in expected.items():  # q/k rows come back in HF order: llama.cpp permutes them
        torch.testing.assert_close(source.read(key), want, rtol=0, atol=0, msg=key)
