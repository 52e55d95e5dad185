"""Calibration statistics: what kiln's float model feeds each linear equals what HF's feeds
the same linear on the same tokens, however many prompts a packed step holds."""
from __future__ import annotations

import torch

from kiln.models.llama import LlamaForCausalLM
from kiln.quantization.calibration import (InputStats, calibration_texts, collect_linear_inputs, pack_prompts,
                                          prompt_steps)
from tests.utils.tiny_models import make_llama


def test_linear_input_stats_equal_hf_hooked_inputs(tmp_path):
    hf = make_llama(tmp_path / "hf", layers=2)
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", dtype="float32")
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17)]
    stats = collect_linear_inputs(model, prompts, ["transformer.layers.1.attention.qkv", "transformer.layers.0.mlp.proj"])
    seen = {"q": [], "down": []}
    handles = [hf.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen["q"].append(a[0][0])),
               hf.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen["down"].append(a[0][0]))]
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    for h in handles:
        h.remove()
    for name, key in (("transformer.layers.1.attention.qkv", "q"), ("transformer.layers.0.mlp.proj", "down")):
        rows = torch.cat(seen[key])
        s = stats[name]
        assert s.rows == rows.shape[0] == 26
        torch.testing.assert_close(s.absmax, rows.abs().amax(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.abs_mean, rows.abs().mean(0), rtol=1e-5, atol=1e-6)
        assert s.rows_sample().shape == (26, rows.shape[1])


def test_packed_steps_give_the_statistics_of_one_prompt_per_step(tmp_path):
    """Several prompts a step (the runtime's packed format) against one prompt a step and HF:
    the same per-channel statistics and the same row sample."""
    hf = make_llama(tmp_path / "hf", layers=2)
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", dtype="float32")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 17, 2, 30, 5, 12)]
    names = ["transformer.layers.0.attention.qkv", "transformer.layers.1.attention.dense", "transformer.layers.1.mlp.proj"]
    make = lambda: InputStats(max_sample=20)  # smaller than the rows seen: the sample is a strided pick
    single = collect_linear_inputs(model, prompts, names, make=make, max_step_tokens=1)
    packed = collect_linear_inputs(model, prompts, names, make=make, max_step_tokens=40)
    assert [len(s.query_lens) for s in prompt_steps(prompts, max_step_tokens=40)] == [3, 2, 1]
    seen = []
    handle = hf.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    handle.remove()
    for name in names:
        a, b = single[name], packed[name]
        assert a.rows == b.rows == 75
        torch.testing.assert_close(b.absmax, a.absmax, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.abs_mean, a.abs_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.rows_sample(), a.rows_sample(), rtol=1e-5, atol=1e-5)
    rows = torch.cat(seen)
    torch.testing.assert_close(packed[names[2]].absmax, rows.abs().amax(0), rtol=1e-5, atol=1e-6)


def test_prompts_pack_in_order_under_the_token_budget():
    assert pack_prompts([5, 5, 5, 20, 3], 10) == [[0, 1], [2], [3], [4]]
    assert pack_prompts([4], 1) == [[0]]


def test_row_sample_is_capped_and_spread_over_every_row_seen():
    stats = InputStats(max_sample=10)
    for start in (0, 40, 80):  # rows numbered 0..119 in their first column
        stats.observe(torch.arange(start, start + 40.0).repeat(4, 1).t())
    sample = stats.rows_sample()[:, 0]
    assert stats.rows == 120 and 5 <= sample.numel() <= 10
    assert torch.equal(sample, torch.arange(0, 120, stats.stride).float())  # evenly spaced, from all three calls
    for size in (1, 7, 33):  # however the rows arrive
        other = InputStats(max_sample=10)
        for rows in torch.arange(120.0).repeat(4, 1).t().split(size):
            other.observe(rows)
        assert torch.equal(other.rows_sample(), stats.rows_sample())


def test_sharegpt_calibration_texts_are_long_replies_held_out_from_evaluation():
    """Deterministic, long replies, none of them among kiln eval perplexity's ShareGPT texts."""
    from kiln.eval.perplexity import load_texts

    texts = calibration_texts("sharegpt", 4)
    assert len(texts) == 4 and all(len(t) >= 200 for t in texts)
    assert calibration_texts("sharegpt", 4) == texts
    assert not set(texts) & set(load_texts("sharegpt", 500))

