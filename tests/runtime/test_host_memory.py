"""Weights and KV cache on huge pages: same values, tied weights stay tied, views do not overlap."""
import pytest
import torch

from kiln import host_memory
from kiln.checkpoint.format import read_rank_weights
from kiln.convert import convert_checkpoint
from kiln.models import get_model_class
from kiln.step.kv_cache import allocate_kv_cache
from tests.utils.tiny_models import make_llama


@pytest.fixture
def no_huge_pages(monkeypatch):
    monkeypatch.setenv("KILN_HUGE_PAGES", "0")
    host_memory.huge_pages_available.cache_clear()
    yield
    host_memory.huge_pages_available.cache_clear()


def test_a_loaded_checkpoint_sits_in_one_huge_page_arena_per_dtype(tmp_path):
    """Loading reads each tensor once, straight into its slot: same values, ties kept."""
    make_llama(tmp_path / "hf", tie=True)
    convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    model = get_model_class("LlamaForCausalLM").from_checkpoint(tmp_path / "ckpt")
    stored = read_rank_weights(tmp_path / "ckpt", 0)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(stored)
    assert all(torch.equal(p, stored[name]) for name, p in params.items())
    assert model.lm_head.weight is model.transformer.vocab_embedding.weight
    if not host_memory.huge_pages_available():
        return
    for dtype in {p.dtype for p in params.values()}:  # one arena per dtype, starting on a huge page
        ptrs = sorted(p.data_ptr() for p in params.values() if p.dtype == dtype)
        assert ptrs[0] % host_memory.HUGE_PAGE_BYTES == 0 and all(ptr % 64 == 0 for ptr in ptrs)


def test_disabled_gives_ordinary_tensors(no_huge_pages):
    assert host_memory.empty((3, 4), torch.float32).shape == (3, 4)
    assert [t.numel() for t in host_memory.empty_many([5, 0, 7], torch.bfloat16)] == [5, 0, 7]


def test_empty_many_gives_separate_aligned_tensors():
    parts = host_memory.empty_many([3, 100, 1], torch.float32)
    for i, part in enumerate(parts):
        part.fill_(i)
        assert part.data_ptr() % 64 == 0
    assert [p.tolist() for p in parts] == [[0.0] * 3, [1.0] * 100, [2.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_layers_are_separate_tensors(dtype):
    caches = allocate_kv_cache(3, num_blocks=4, block_size=2, num_kv_heads=2, head_size=8, dtype=dtype)
    assert len(caches) == 3
    for layer, (k, v) in enumerate(caches):
        assert k.shape == v.shape == (4, 2, 2, 8) and k.dtype == dtype and k.is_contiguous()
        k.fill_(2 * layer)
        v.fill_(2 * layer + 1)
    for layer, (k, v) in enumerate(caches):
        assert torch.all(k == 2 * layer) and torch.all(v == 2 * layer + 1)
