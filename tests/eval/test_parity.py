"""``kiln eval parity``: identical on a faithful engine; on one with a perturbed layer, a
mismatch traced to that layer."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kiln.cli.main import main
from kiln.eval.parity import first_divergence

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "A language model predicts the next token;",
           "The engine converts checkpoints"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def perturbed_engine(tmp_path_factory, tiny_eval_model):
    """The tiny engine with noise added to layer 1's MLP output projection (of 3 layers)."""
    from safetensors.torch import load_file, save_file

    engine = tmp_path_factory.mktemp("perturbed") / "engine"
    shutil.copytree(tiny_eval_model.engine_dir, engine)
    weights = load_file(str(engine / "rank0.safetensors"))
    name = "transformer.layers.1.mlp.proj.weight"
    generator = torch.Generator().manual_seed(0)
    weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=generator)
    save_file(weights, str(engine / "rank0.safetensors"), metadata={"format": "pt"})
    return engine


def _parity(engine_dir, hf_dir, prompts_file, out, *extra) -> dict:
    code = main(["eval", "parity", "--engine_dir", str(engine_dir), "--hf_model_dir", str(hf_dir),
                 "--prompts", str(prompts_file), "--max_tokens", "12", "--output_json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_faithful_engine_is_identical(tiny_eval_model, prompts_file, tmp_path, capsys):
    record = _parity(tiny_eval_model.engine_dir, tiny_eval_model.hf_dir, prompts_file, tmp_path / "p.json")
    assert record["summary"]["verdict"] == "identical" and record["summary"]["identical"] == len(PROMPTS)
    for prompt in record["prompts"]:
        assert prompt["identical"] and prompt["kiln_tokens"] == prompt["hf_tokens"]
        assert len(prompt["kiln_tokens"]) == 12
        assert prompt["relative_logit_diff"] < 1e-5 and prompt["logits_equal"]
    assert record["layers"] is None  # nothing to trace
    report = capsys.readouterr().out
    assert "verdict: identical" in report and "first drifting layer" not in report


def test_perturbed_layer_is_found(tiny_eval_model, perturbed_engine, prompts_file, tmp_path, capsys):
    record = _parity(perturbed_engine, tiny_eval_model.hf_dir, prompts_file, tmp_path / "p.json")
    summary, layers = record["summary"], record["layers"]
    assert summary["verdict"] == "mismatch" and summary["mismatches"] >= 1
    assert summary["max_relative_logit_diff"] > 1e-3
    assert layers["num_layers"] == tiny_eval_model.layers == 3
    assert layers["hf_last_entry_after_final_norm"]  # transformers 5 ties it for Llama
    rows = {row["label"]: row for row in layers["rows"]}
    assert list(rows) == ["embeddings", "0", "1", "2 + final norm"]
    assert rows["embeddings"]["relative_diff"] < 1e-6 and rows["0"]["relative_diff"] < 1e-5
    assert rows["1"]["relative_diff"] > 1e-2
    assert rows["2 + final norm"]["relative_diff"] < 1e-5  # fed HF's input, the layer after is exact again
    assert layers["first_drifting_layer"] == 1 == summary["first_drifting_layer"]
    report = capsys.readouterr().out
    assert "verdict: mismatch" in report and "first drifting layer: 1 (of 3 layers" in report


def test_loose_tolerance_calls_the_perturbed_engine_equal(tiny_eval_model, perturbed_engine, prompts_file, tmp_path):
    """Above the perturbation's logit difference, the logits count as equal (and no layer
    analysis runs) unless the greedy tokens part outside each other's top-k."""
    record = _parity(perturbed_engine, tiny_eval_model.hf_dir, prompts_file, tmp_path / "p.json",
                     "--tolerance", "0.5")
    for prompt in record["prompts"]:
        assert prompt["logits_equal"]
        d = prompt["divergence"]
        swap = d is None or (d["kiln_token_in_hf_top_k"] and d["hf_token_in_kiln_top_k"])
        assert prompt["verdict"] == ("identical" if d is None else "top-k swap" if swap else "mismatch")
    assert (record["layers"] is None) == (record["summary"]["mismatches"] == 0)


def test_first_divergence_rule():
    hf_rows = [torch.tensor([0.0, -1.0, -2.0, -9.0]).log_softmax(0)] * 3
    kiln_top = [{0: -0.4, 1: -1.4}, {1: -1.0, 0: -1.1}, {2: -0.1, 3: -3.0}]
    assert first_divergence([0, 1], kiln_top[:2], [0, 1], hf_rows, 2) is None
    d = first_divergence([0, 1, 3], kiln_top, [0, 0, 0], hf_rows, 2)
    assert d["position"] == 1 and (d["kiln_token"], d["hf_token"]) == (1, 0)
    assert d["kiln_token_in_hf_top_k"] and d["hf_token_in_kiln_top_k"]
    assert d["kiln_gap"] == pytest.approx(0.1) and d["hf_gap"] == pytest.approx(1.0, abs=1e-6)
    d = first_divergence([0, 0, 2], kiln_top, [0, 0, 0], hf_rows, 2)  # kiln's token is HF's third
    assert d["position"] == 2 and not d["kiln_token_in_hf_top_k"] and not d["hf_token_in_kiln_top_k"]
    assert d["kiln_gap"] is None and d["hf_gap"] == pytest.approx(2.0, abs=1e-5)
    assert first_divergence([0, 0, 2], kiln_top, [0, 0, 0], hf_rows, 3)["kiln_token_in_hf_top_k"]


@pytest.mark.parametrize("flags,names", [
    (["--prompts", "{tmp}/missing.txt"], "--prompts"),
    (["--prompts", "{bad}"], "line 2"),
    (["--hf_model_dir", "{tmp}/no-hf"], "--hf_model_dir"),
    (["--max_tokens", "0"], "--max_tokens"),
    (["--max_tokens", "64"], "--max_tokens"),
    (["--top_k", "0"], "--top_k"),
    (["--max_samples", "0"], "--max_samples"),
])
def test_bad_inputs_exit_2_naming_the_flag(tiny_eval_model, prompts_file, tmp_path, capsys, flags, names):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n{not json\n")
    out = tmp_path / "out.json"
    argv = ["eval", "parity", "--engine_dir", str(tiny_eval_model.engine_dir), "--hf_model_dir",
            str(tiny_eval_model.hf_dir), "--prompts", str(prompts_file), "--output_json", str(out)]
    code = main(argv + [f.format(tmp=tmp_path, bad=bad) for f in flags])  # a later flag overrides
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and names in err, err
    assert not out.exists()


def test_long_layer_tables_keep_to_one_screen():
    """30 layers: the table shows the first two rows, two either side of the first drifting
    layer and the last, with gaps marked; a short table is shown whole."""
    from kiln.eval.parity_report import _layer_rows_to_show

    rows = [{"label": str(i), "drifts": i >= 12} for i in range(31)]
    shown = [None if r is None else r["label"] for r in _layer_rows_to_show(rows)]
    assert shown == ["0", "1", None, "10", "11", "12", "13", "14", None, "30"]
    assert _layer_rows_to_show(rows[:5]) == rows[:5]
    calm = [{"label": str(i), "drifts": False} for i in range(31)]
    assert [None if r is None else r["label"] for r in _layer_rows_to_show(calm)] == ["0", "1", None, "30"]
