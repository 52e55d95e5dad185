"""Hybrid models (recurrent layers beside attention) against Hugging Face on tiny random models,
and the runtime around their state slots: chunked prefill at any chunk size, preemption and
resume, independent samples, beam search (a child takes its parent's state), and no slot or
block left behind by cancelled requests. The recurrences' chunked forms against their step forms
(the gated delta rule, Mamba2's SSD) and the native decode kernels against the PyTorch paths."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from kiln.layers.delta_rule import delta_rule_chunked, delta_rule_step
from kiln.layers.ssd import ssd_chunked, ssd_step
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import FinishReason
from tests.models.zoo import built_fixture, check_prompt_logits, hf_reference_fixture, parity_tests
from tests.utils import tiny_hybrid_models as tiny
from tests.utils.compare import kiln_greedy

# name -> (maker, maker kwargs, build options)
CASES: dict[str, tuple[Callable, dict, dict]] = {
    "lfm2": (tiny.make_lfm2, {}, {"max_beam_width": 2}),
    "qwen3.5": (tiny.make_qwen3_5, {}, {"max_beam_width": 2}),
    "qwen3.5-moe": (tiny.make_qwen3_5_moe, {}, {"max_beam_width": 2}),
    "qwen3-next": (tiny.make_qwen3_next, {}, {"max_beam_width": 2}),
    # Mamba2: one group, no positions, a dense shared MLP; two groups, rotary, experts
    "granite-hybrid": (tiny.make_granite_hybrid, {}, {"max_beam_width": 2}),
    "granite-hybrid-moe": (tiny.make_granite_hybrid, dict(num_local_experts=4, position_embedding_type="rope",
                                                          mamba_n_groups=2), {"max_beam_width": 2}),
    "nemotron-h": (tiny.make_nemotron_h, {}, {"max_beam_width": 2}),
    # Nemotron 3 Nano's blocks: Mamba2, experts (4, top 2, a shared expert), attention
    "nemotron-h-moe": (tiny.make_nemotron_h, dict(pattern="ME*E"), {"max_beam_width": 2}),
}

built = built_fixture(CASES)
hf_reference = hf_reference_fixture()

test_prompt_logits_match_hf, test_batched_greedy_matches_hf = parity_tests(CASES)


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list:
    """Every request's outputs: its samples' tokens, or its beams' (token ids, per-token log-probs)."""
    requests = [core.add_request(p, params, end_id=None) for p in prompts]
    while core.has_unfinished:
        core.step()
    return [[(h.token_ids, h.log_probs) for h in r.hypotheses] if r.hypotheses is not None
            else [s.output_token_ids for s in r.seqs] for r in requests]


def assert_all_returned(core: EngineCore) -> None:
    """No request holds a KV block or a state slot once all are done."""
    assert core.pool.num_free == core.pool.num_blocks
    states = core.scheduler.states
    assert states.num_free_pairs * 2 == states.num_slots


GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def test_chunked_delta_rule_equals_token_by_token() -> None:
    """The chunked (WY) form of the gated delta rule gives the token-by-token outputs and final
    state, from a non-zero state, over 150 tokens (two whole chunks and a padded one)."""
    gen = torch.Generator().manual_seed(0)
    length, heads, dk, dv = 150, 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (torch.nn.functional.normalize(rand(length, heads, dk), dim=-1) for _ in range(2))
    v, g, beta = rand(length, heads, dv), -torch.rand(length, heads, generator=gen), torch.rand(length, heads, generator=gen)
    state = rand(heads, dk, dv)
    out, end = delta_rule_chunked(q, k, v, g, beta, state)
    step_state, steps = state[None], []
    for t in range(length):
        o, step_state = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], step_state)
        steps.append(o[0])
    torch.testing.assert_close(out, torch.stack(steps), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, step_state[0], atol=1e-4, rtol=1e-4)


def test_chunked_ssd_equals_token_by_token() -> None:
    """Mamba2's chunked SSD scan gives the token-by-token outputs and final state, from a non-zero
    state, over 150 tokens (two whole chunks of 64 and a padded one), heads in 2 groups."""
    gen = torch.Generator().manual_seed(0)
    length, heads, groups, head_dim, state_size = 150, 6, 2, 5, 7

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x, b, c = rand(length, heads, head_dim), rand(length, groups, state_size), rand(length, groups, state_size)
    dt, a, d = torch.rand(length, heads, generator=gen), -2 * torch.rand(heads, generator=gen), rand(heads)
    state = rand(heads, head_dim, state_size)
    out, end = ssd_chunked(x, dt, a, b, c, d, state, chunk=64)
    step_state, steps = state[None], []
    for t in range(length):
        o, step_state = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], d, step_state)
        steps.append(o[0])
    torch.testing.assert_close(out, torch.stack(steps), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, step_state[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3.5", "nemotron-h"])
def test_long_prompt_logits_match_hf(built, name: str) -> None:
    """A 150-token prompt (a recurrent layer's prefill over several of its chunks) beside two
    short ones in one step: HF's logits."""
    check_prompt_logits(built(name), prompt_lens=(150, 7, 70))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_gives_the_same_tokens(built, hf_reference, name: str, chunk: int) -> None:
    """Prompts prefilled ``chunk`` tokens a step (the state carried across chunk boundaries) give
    HF's greedy tokens."""
    prompts, expected = hf_reference(name)
    assert kiln_greedy(built(name).engine_dir, prompts, len(expected[0]), max_num_tokens=chunk) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_preempted_sequences_resume_from_a_fresh_state(built, hf_reference, name: str) -> None:
    """A KV cache too small for all four sequences preempts some (their slots freed with their
    blocks) and recomputes them later: HF's greedy tokens still, nothing left held."""
    prompts, expected = hf_reference(name)
    core = EngineCore(Engine(built(name).engine_dir), max_num_seqs=4, max_num_tokens=16, num_blocks=10)
    preempted = 0
    requests = [core.add_request(p, GREEDY, end_id=None) for p in prompts]
    while core.has_unfinished:
        core.step()
        preempted = max(preempted, len(core.scheduler.waiting))
    assert [r.seqs[0].output_token_ids for r in requests] == expected
    assert preempted > 0
    assert_all_returned(core)


@pytest.mark.parametrize("name", list(CASES))
def test_samples_of_one_request_keep_their_own_states(built, name: str) -> None:
    """``n`` seeded samples decoded together equal the same seeds decoded one request at a time."""
    core = EngineCore(Engine(built(name).engine_dir), max_num_seqs=4, num_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3, ignore_eos=True)
    together = run(core, [[3, 4, 5, 6, 7]], params)[0]
    alone = [run(core, [[3, 4, 5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True,
                                                         seed=params.seed_for(i)))[0][0] for i in range(3)]
    assert together == alone and len(set(map(tuple, together))) > 1
    assert_all_returned(core)


@pytest.mark.parametrize("name", list(CASES))
def test_beams_carry_their_parents_states(built, name: str) -> None:
    """Beam search over a hybrid model: every hypothesis's tokens have the log-probs HF's model
    gives them (a beam reading another beam's state would score them differently)."""
    case = built(name)
    core = EngineCore(Engine(case.engine_dir), max_num_seqs=4, num_blocks=64)
    prompt = [9, 8, 7, 6, 5, 4]
    params = SamplingParams(max_tokens=10, use_beam_search=True, n=2, ignore_eos=True)
    hypotheses = run(core, [prompt], params)[0]
    assert len(hypotheses) == 2 and hypotheses[0][0] != hypotheses[1][0]
    for tokens, logprobs in hypotheses:
        with torch.no_grad():
            reference = case.hf(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
        expected = [reference[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
        assert logprobs == pytest.approx(expected, abs=1e-4)
    assert_all_returned(core)


@pytest.mark.parametrize("name", list(CASES))
def test_cancelled_requests_leave_no_slot_or_block(built, name: str) -> None:
    """64 requests on 8 sequences at a time, a quarter cancelled part-way (some while running,
    some while waiting): every state slot and KV block comes back."""
    core = EngineCore(Engine(built(name).engine_dir), max_num_seqs=8, max_num_tokens=32, num_blocks=48)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = [core.add_request([1 + i % 50, 2, 3 + i % 7], params, end_id=None) for i in range(64)]
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        if steps in (2, 5):  # cancels land on running and on waiting requests
            for request in requests[steps::8]:
                core.abort(request)
    cancelled = [r for r in requests if r.seqs[0].finish_reason == FinishReason.CANCELLED]
    assert len(cancelled) >= 12
    assert_all_returned(core)


def _decode_group(read: list[int], write: list[int], fresh: list[bool]):
    from kiln.step.metadata import StateGroup

    return StateGroup(slice(0, len(read)), len(read), 1, torch.tensor(read), torch.tensor(write), torch.tensor(fresh))


def _native_then_pytorch(monkeypatch, module, layer, hidden: torch.Tensor, start: list[torch.Tensor]) -> list:
    """``layer``'s (output, states) for three decode rows (slots 0, 2, 4 -> 1, 3, 5; the second
    row a sequence's first token) through the native kernel, then with ``module``'s kernels off."""
    from types import SimpleNamespace

    from kiln import kernels

    assert kernels.native_library() is not None
    metadata = SimpleNamespace(lora=None, state_groups=[_decode_group([0, 2, 4], [1, 3, 5], [False, True, False])])
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(module.kernels, "recurrent_decode_supported", lambda *a: False)
        state = tuple(s.clone() for s in start)
        results.append((layer(hidden, None, metadata, state), state))
    return results


def _random_layer(layer, dtype) -> None:
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.3)


def _assert_same(results: list, dtype) -> None:
    (ours, ours_state), (ref, ref_state) = results
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    for mine, theirs in zip(ours_state, ref_state):
        torch.testing.assert_close(mine[[1, 3, 5]].float(), theirs[[1, 3, 5]].float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_decode_kernel_equals_the_pytorch_path(monkeypatch, dtype, tiled: bool) -> None:
    """Gated DeltaNet's decode rows through the native kernel and through the PyTorch path: the
    same outputs and the same states in the write slots (float rounding)."""
    from kiln.layers import gated_delta_net

    torch.manual_seed(0)
    # (rows of 16 floats: the next state is written with non-temporal stores where a CPU has them)
    layer = gated_delta_net.GatedDeltaNet(0, 48, num_key_heads=2, num_value_heads=4, key_dim=16, value_dim=16,
                                          kernel_size=4, eps=1e-6, dtype=dtype, value_heads_tiled=tiled)
    _random_layer(layer, dtype)
    layer.A_log.data.uniform_(0.0, 2.0)
    start = [torch.randn(6, *shape).to(dt) for shape, dt in layer.state_spec()]
    _assert_same(_native_then_pytorch(monkeypatch, gated_delta_net, layer, torch.randn(3, 48).to(dtype), start), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_decode_kernel_equals_the_pytorch_path(monkeypatch, dtype) -> None:
    """LFM2's block on decode rows, native and PyTorch: the same outputs and states."""
    from kiln.layers import short_conv

    torch.manual_seed(1)
    layer = short_conv.ShortConv(0, 40, 3, bias=True, dtype=dtype)
    _random_layer(layer, dtype)
    start = [torch.randn(6, 2, 40).to(dtype)]
    _assert_same(_native_then_pytorch(monkeypatch, short_conv, layer, torch.randn(3, 40).to(dtype), start), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_decode_kernel_equals_the_pytorch_path(monkeypatch, dtype) -> None:
    """Mamba2's decode rows (4 heads in 2 groups, a time-step limit that binds) through the native
    kernel and through the PyTorch step form: the same SSM outputs and states."""
    from kiln.layers import mamba2

    torch.manual_seed(2)
    layer = mamba2.Mamba2(0, 48, num_heads=4, head_dim=8, state_size=16, groups=2, kernel_size=4, conv_bias=True,
                          proj_bias=False, eps=1e-5, dtype=dtype, time_step_limit=(0.2, 1.5))
    _random_layer(layer, dtype)
    start = [torch.randn(6, *shape).to(dt) for shape, dt in layer.state_spec()]
    _assert_same(_native_then_pytorch(monkeypatch, mamba2, layer, torch.randn(3, 48).to(dtype), start), dtype)


def test_nemotron_h_reads_older_config_names_and_refuses_what_it_cannot_run() -> None:
    """Nemotron-H configs as NVIDIA's remote code wrote them (``hybrid_override_pattern``,
    ``mamba_*`` field names) read as transformers' do, expert layers included; a block kind kiln
    does not know and expert groups Hugging Face could not score (one expert each: a group scores
    by its two best) are refused, not misread."""
    from kiln.errors import ConfigError
    from kiln.mapping import Mapping
    from kiln.models.nemotron_h import NemotronHForCausalLM

    hf = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16,
              intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, mamba_n_groups=2,
              mamba_d_conv=3, mamba_dt_min=0.01, hybrid_override_pattern="M-*")
    config = NemotronHForCausalLM.config_from_hf(hf, "float32", Mapping())
    assert config.layer_types == ["mamba", "mlp", "full_attention"] and config.head_size == 16
    assert (config.mamba_groups, config.mamba_conv_kernel, config.mamba_time_step_limit) == (2, 3, [0.01, None])
    experts = {**hf, **tiny.NEMOTRON_H_EXPERTS, "hybrid_override_pattern": "ME*", "n_group": 2, "topk_group": 1}
    config = NemotronHForCausalLM.config_from_hf(experts, "float32", Mapping())
    assert config.layer_types == ["mamba", "moe", "full_attention"] and config.expert_groups == [2, 1]
    assert (config.moe_shared_expert_intermediate_size, config.routed_scaling_factor) == (48, 2.5)
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        NemotronHForCausalLM.config_from_hf({**hf, "hybrid_override_pattern": "MX*"}, "float32", Mapping())
    with pytest.raises(ConfigError, match="n_group"):
        NemotronHForCausalLM.config_from_hf({**experts, "n_group": 4}, "float32", Mapping())


def test_nemotron_h_routing_equals_hugging_faces_router() -> None:
    """The expert choice and weights of an ``E`` block equal transformers' NemotronHTopkRouter's
    with expert groups (8 experts in 4 groups, the best 2 groups, top 3, renormalised and scaled)
    and a correction bias that changes the choice."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from kiln.mapping import Mapping
    from kiln.models.nemotron_h import NemotronHExperts, NemotronHForCausalLM

    fields = dict(hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    torch.manual_seed(3)
    theirs = NemotronHTopkRouter(NemotronHConfig(**fields))
    theirs.weight.data.normal_(0, 0.3)
    theirs.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    hf = dict(vocab_size=64, num_attention_heads=4, intermediate_size=16, mamba_num_heads=4, mamba_head_dim=8,
              ssm_state_size=8, hybrid_override_pattern="E", **fields)
    with torch.device("meta"):
        ours = NemotronHExperts(NemotronHForCausalLM.config_from_hf(hf, "float32", Mapping()), engine_layout=False)
    ours.router.weight = torch.nn.Parameter(theirs.weight.data.clone(), requires_grad=False)
    ours.router.e_score_correction_bias = torch.nn.Parameter(theirs.e_score_correction_bias.clone(),
                                                             requires_grad=False)
    x = torch.randn(64, 32)
    _, want_weights, want_experts = theirs(x)
    weights, experts = ours.route(ours.router(x))
    order, want_order = experts.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    unbiased = torch.sigmoid(x @ theirs.weight.T).topk(3, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(unbiased, experts.gather(1, order))  # the bias and the groups changed some choices


SPECULATIVE_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [20, 21, 22, 23, 20, 21], [7, 7, 7, 7]]


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_greedy_is_plain_greedy(built, name, monkeypatch) -> None:
    """Proposals on a hybrid target: plain greedy's tokens, whether the proposals are kept whole
    (the state after the chunk is kept) or rejected part-way (the state before the step is kept
    and the kept tokens run again in front of the next proposals), every slot back at the end.
    The proposer is an oracle that knows plain greedy's continuation and spoils one of its
    proposals on two steps out of three, so both cases occur whatever the tiny model says."""
    from kiln.runtime import speculative

    engine = Engine(built(name).engine_dir)
    expected = run(EngineCore(engine, num_blocks=64), SPECULATIVE_PROMPTS, GREEDY)
    continuations = [p + out[0] for p, out in zip(SPECULATIVE_PROMPTS, expected)]

    def oracle(token_ids: list[int], config, limit: int) -> list[int]:
        full = next(c for c in continuations if c[:len(token_ids)] == token_ids)
        proposals = full[len(token_ids):len(token_ids) + min(limit, config.num_speculative_tokens)]
        spoil = len(token_ids) % 3 - 1  # -1: none; else that proposal
        if 0 <= spoil < len(proposals):
            proposals[spoil] = (proposals[spoil] + 1) % 256
        return proposals

    monkeypatch.setattr(speculative, "propose_ngram", oracle)
    spec = EngineCore(engine, num_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    behind = []
    submit = spec.runner.submit
    spec.runner.submit = lambda out: (behind.extend(
        c.num_tokens - len(c.seq.spec_tokens) for c in out.chunks if c.seq.spec_tokens), submit(out))[1]
    assert run(spec, SPECULATIVE_PROMPTS, GREEDY) == expected
    stats = spec.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert max(behind) > 1  # some verifying chunks ran kept tokens again
    assert_all_returned(spec)


def test_a_draft_model_for_a_hybrid_target_gives_plain_greedy(built, tmp_path, build_from_hf) -> None:
    """A dense draft and a hybrid one (the target's weights with its LM head disturbed, so it
    agrees on some proposals and not others: its mirrors rewind through checkpoint copies of
    their states) proposing for a Qwen3.5 target: plain greedy's tokens, every slot back."""
    from tests.utils.tiny_models import make_llama

    make_llama(tmp_path / "dense", layers=1)
    near = tiny.make_qwen3_5(tmp_path / "near")
    with torch.no_grad():
        near.lm_head.weight.add_(torch.randn(near.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)),
                                 alpha=float(near.lm_head.weight.std()) * NEAR_NOISE)
    near.save_pretrained(tmp_path / "near")
    engine = Engine(built("qwen3.5").engine_dir)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = run(EngineCore(engine, num_blocks=64), SPECULATIVE_PROMPTS, params)
    for draft in ("dense", "near"):
        draft_dir = build_from_hf(tmp_path / draft, tmp_path / f"{draft}-kiln", {})
        spec = EngineCore(engine, num_blocks=64, speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                                     "num_speculative_tokens": 3})
        assert run(spec, SPECULATIVE_PROMPTS, params) == expected
        assert_all_returned(spec)
    stats = spec.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # the hybrid draft: kept and rejected


NEAR_NOISE = 1.0
