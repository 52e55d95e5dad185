"""The serve tests' tiny engine (built once per session), a server of it per module, and
single-threaded torch."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import convert_and_build
from tests.utils.fakes import make_tiny_llama_with_tokenizer
from tests.utils.server import BUILD_OPTIONS, serve_tiny


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: intra-op threads only wait on each other
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory):
    """A tiny random Llama with a tiny tokenizer, built with small serving limits."""
    d = tmp_path_factory.mktemp("serve")
    make_tiny_llama_with_tokenizer(d / "hf")
    return convert_and_build(d / "hf", d / "w", build_options=BUILD_OPTIONS)


@pytest.fixture(scope="module")
def server(engine_dir):
    s = serve_tiny(engine_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()
