"""Prompt tuning (reference 001's PromptTuningEmbedding) against Hugging Face PEFT prompt tuning."""
from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.errors import RequestError
from kiln.layers.embedding import PromptTuningEmbedding
from kiln.runtime.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.executor import Executor, ExecutorConfig, OutputConfig, Request
from kiln.runtime.prompt_tuning import PromptTuningConfig
from tests.conftest import convert_and_build
from tests.utils.tiny_models import make_llama

VOCAB = 256
PROMPT = [5, 17, 42, 99, 3, 64, 8]
NEW_TOKENS = 6


def test_embedding_routes_virtual_tokens_to_each_tasks_rows():
    emb = PromptTuningEmbedding(10, 3)
    emb.weight.data = torch.arange(30.0).reshape(10, 3)
    table = torch.arange(100.0, 100.0 + 4 * 3 * 2).reshape(8, 3)  # 2 tasks x task_vocab_size 4
    ids = torch.tensor([1, 10, 13, 2, 11])
    tasks = torch.tensor([0, 0, 1, 1, 1])
    out = emb(ids, table, tasks, 4)
    assert torch.equal(out[0], emb.weight[1]) and torch.equal(out[3], emb.weight[2])  # normal tokens
    assert torch.equal(out[1], table[0]) and torch.equal(out[2], table[4 + 3]) and torch.equal(out[4], table[4 + 1])
    assert torch.equal(emb(torch.tensor([3])), emb.weight[3:4])  # no table: a plain embedding


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine, two PEFT prompt-tuned models of the base with random virtual-token tables)."""
    from peft import PromptTuningConfig as PeftPromptTuning
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prompt-tuning")
    make_llama(root / "hf", hidden=64, layers=2, num_heads=4, num_kv_heads=2, intermediate=96, vocab=VOCAB)
    engine = Engine(convert_and_build(root / "hf", root / "kiln", {"tokens_per_block": 4,
                                                                  "max_prompt_embedding_table_size": 6},
                                      dtype="float32"))
    tuned = []
    for n, seed in ((4, 0), (6, 1)):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32),
                               PeftPromptTuning(task_type="CAUSAL_LM", num_virtual_tokens=n))
        with torch.no_grad():  # random vectors of the embeddings' scale, so the prompt matters
            model.prompt_encoder["default"].embedding.weight.normal_(0, 1)
        tuned.append(model.eval())
    return engine, tuned


def _table(model) -> torch.Tensor:
    return model.get_prompt_embedding_to_save("default").detach()


def _kiln(engine, prompts, tables):
    core = EngineCore(engine, max_num_seqs=len(prompts), num_blocks=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.1)
    requests = [core.add_request(p, params, None, return_generation_logits=True, prompt_table=t)
                for p, t in zip(prompts, tables)]
    while core.has_unfinished:
        core.step()
    return [(r.seqs[0].output_token_ids, torch.stack([g[0] for g in r.generation_logits])) for r in requests]


def test_prompt_tuning_matches_peft_and_tasks_mix_in_a_batch(setup):
    """PEFT prepends the virtual tokens; kiln's prompt names them as ids vocab_size + i."""
    engine, tuned = setup
    prompts, tables = [], []
    for model in tuned:
        n = _table(model).shape[0]
        prompts.append([VOCAB + i for i in range(n)] + PROMPT)
        tables.append(_table(model))
    results = _kiln(engine, prompts + [PROMPT], tables + [None])  # two tasks and a plain prompt together
    for model, (tokens, logits) in zip(tuned, results):
        expected_tokens, expected_logits = _peft_greedy_penalized(model, PROMPT)
        assert tokens == expected_tokens
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    with tuned[0].disable_adapter():
        plain_tokens, _ = _peft_greedy_penalized(tuned[0], PROMPT)
    assert results[2][0] == plain_tokens != results[0][0]


def _peft_greedy_penalized(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy with HF's repetition penalty 1.1 over the real tokens (what kiln applies); the
    logits before the penalty (what kiln's generation logits are)."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            last = model(input_ids=torch.tensor([ids])).logits[0, -1]
            logits.append(last)
            penalized, seen = last.clone(), torch.tensor(sorted(set(ids)))
            penalized[seen] = torch.where(last[seen] > 0, last[seen] / 1.1, last[seen] * 1.1)
            ids.append(int(penalized.argmax()))
    return ids[len(prompt):], torch.stack(logits)


def test_virtual_ids_need_a_table_that_has_them(setup):
    engine, tuned = setup
    core = EngineCore(engine, max_num_seqs=1, num_blocks=16)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(RequestError, match="virtual tokens, which need a prompt-tuning table"):
        core.add_request([VOCAB] + PROMPT, params, None)
    with pytest.raises(RequestError, match=rf"virtual tokens {VOCAB}..{VOCAB + 3} name the rows"):
        core.add_request([VOCAB + 4] + PROMPT, params, None, prompt_table=_table(tuned[0]))
    with pytest.raises(RequestError, match=r"must be \[n_virtual >= 1, 64\]"):
        core.add_request(PROMPT, params, None, prompt_table=torch.zeros(3, 32))


def test_the_engine_bounds_the_table(setup, tmp_path):
    """Tables up to the build's max_prompt_embedding_table_size rows; none without it (kiln build's default)."""
    import subprocess
    import sys

    engine, tuned = setup
    core = EngineCore(engine, max_num_seqs=1, num_blocks=16)
    with pytest.raises(RequestError, match="7 rows, more than the engine's max_prompt_embedding_table_size 6"):
        core.add_request([VOCAB] + PROMPT, SamplingParams(max_tokens=2), None, prompt_table=torch.zeros(7, 64))
    checkpoint = engine.engine_dir.parent / "checkpoint"
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "build", "--checkpoint_dir", checkpoint,
                          "--output_dir", tmp_path / "plain"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    plain = EngineCore(Engine(tmp_path / "plain"), max_num_seqs=1, num_blocks=16)
    assert plain.engine.build_config.max_prompt_embedding_table_size == 0
    with pytest.raises(RequestError, match="built without it .*--max_prompt_embedding_table_size N"):
        plain.add_request([VOCAB] + PROMPT, SamplingParams(max_tokens=2), None, prompt_table=_table(tuned[0]))


def test_prompt_tuning_through_the_executor(setup):
    engine, tuned = setup
    table = _table(tuned[1])
    prompt = [VOCAB + i for i in range(table.shape[0])] + PROMPT
    ((expected, _),) = _kiln(engine, [prompt], [table])
    executor = Executor(engine, ExecutorConfig(max_batch_size=2))
    try:
        from kiln.runtime.sampling_params import SamplingParams as Params

        rid = executor.enqueue_request(Request(prompt, max_tokens=NEW_TOKENS,
                                               sampling_config=Params(temperature=0, ignore_eos=True,
                                                                      repetition_penalty=1.1),
                                               prompt_tuning_config=PromptTuningConfig(table),
                                               output_config=OutputConfig(exclude_input_from_output=True)))
        while True:
            (response,) = executor.await_responses(rid, timeout=60)
            if response.has_error() or response.result.is_final:
                break
        assert not response.has_error(), response.error_msg
        assert response.result.output_token_ids == [expected]
    finally:
        executor.shutdown()


def test_a_peft_prompt_tuning_adapter_converts_and_loads(setup, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from kiln.checkpoint.peft import load_prompt_table, peft_prompt_table

    engine, tuned = setup
    tuned[0].save_pretrained(tmp_path / "adapter")
    assert torch.equal(peft_prompt_table(tmp_path / "adapter"), _table(tuned[0]))
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lora", "convert-prompt", "-i", tmp_path / "adapter",
                          "-o", tmp_path / "table.npy"], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "4 virtual tokens" in run.stdout, run.stderr
    assert np.array_equal(np.load(tmp_path / "table.npy"), _table(tuned[0]).numpy())
    assert torch.equal(load_prompt_table(tmp_path / "table.npy"), _table(tuned[0]))
    wrong = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lora", "convert", "-i", tmp_path / "adapter",
                            "-o", tmp_path / "x"], cwd=root, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "kiln lora convert-prompt" in wrong.stderr
