"""Weights and KV cache on huge pages: same values, tied weights stay tied, views do not overlap."""
import pytest
import torch
from torch import nn

from kiln import host_memory
from kiln.step.kv_cache import allocate_kv_cache


@pytest.fixture
def no_huge_pages(monkeypatch):
    monkeypatch.setenv("KILN_HUGE_PAGES", "0")
    host_memory.huge_pages_available.cache_clear()
    yield
    host_memory.huge_pages_available.cache_clear()


def _tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=True), nn.LayerNorm(6))
    model[1].weight = model[0].weight  # tied like an lm_head and its embedding table
    model[2].weight.data = model[2].weight.data.bfloat16()
    return model.requires_grad_(False)


def test_parameters_move_with_their_values_and_ties():
    model = _tied_model()
    before = {name: p.clone() for name, p in model.named_parameters()}
    moved = host_memory.move_parameters_to_huge_pages(model)
    if not host_memory.huge_pages_available():
        assert moved == 0
        return
    assert moved >= sum(p.numel() * p.element_size() for p in before.values())
    assert model[1].weight is model[0].weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.dtype == before[name].dtype, name
    for dtype in (torch.float32, torch.bfloat16):  # one arena per dtype, starting on a huge page
        ptrs = sorted(p.data_ptr() for p in model.parameters() if p.dtype == dtype)
        assert ptrs[0] % host_memory.HUGE_PAGE_BYTES == 0
        assert ptrs[-1] - ptrs[0] < moved + 64 * len(ptrs) and all(ptr % 64 == 0 for ptr in ptrs)


def test_disabled_leaves_parameters_in_place(no_huge_pages):
    model = _tied_model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert host_memory.move_parameters_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
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
