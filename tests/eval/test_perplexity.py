"""``kiln eval perplexity`` against perplexity computed from Hugging Face's own logits."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.cli.main import main
from kiln.eval.perplexity import sliding_windows

MAX_INPUT_LEN = 32  # the engine's in tests/eval/conftest.py (checked below)

SHORT = "The quick brown fox jumps over the lazy dog."
LONG = ("A language model predicts the next token; perplexity measures how well it does. "
        "The engine converts checkpoints, builds engines and runs them fast on a CPU. "
        "Summarize the following article: the quick brown fox jumps over the lazy dog, twice, "
        "and then the model reads it all again, token after token, window after window.")


@torch.inference_mode()
def hf_strided_nll(hf, ids: list[int], window: int, stride: int) -> tuple[float, int, int]:
    """(summed NLL, tokens scored, windows) the way the transformers docs compute strided
    perplexity: labels before the previous window's end are masked, the loss shifts by one."""
    total, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - prev_end
        inputs = torch.tensor([ids[begin:end]])
        labels = inputs.clone()
        labels[:, :-target_len] = -100
        logits = hf(inputs).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        total += loss.item()
        scored += int((labels[0, 1:] != -100).sum())
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    return total, scored, windows


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory, tiny_eval_model):
    path = tmp_path_factory.mktemp("ppl") / "texts.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in (SHORT, LONG)) + "\n")
    return path


def _tokens(engine_dir, text: str) -> list[int]:
    from kiln.tokenizer import load_tokenizer

    return load_tokenizer(engine_dir)(text)["input_ids"]


@pytest.mark.parametrize("stride", [None, 7])
def test_perplexity_matches_hf_over_the_same_windows(tiny_eval_model, texts_file, tmp_path, capsys, stride):
    assert tiny_eval_model.max_input_len == MAX_INPUT_LEN
    short_ids, long_ids = (_tokens(tiny_eval_model.engine_dir, t) for t in (SHORT, LONG))
    assert len(short_ids) < MAX_INPUT_LEN < 3 * MAX_INPUT_LEN < len(long_ids)  # one window, then several
    out = tmp_path / "ppl.json"
    argv = ["eval", "perplexity", "--engine_dir", str(tiny_eval_model.engine_dir), "--dataset", str(texts_file),
            "--output_json", str(out)]
    assert main(argv + (["--stride", str(stride)] if stride else [])) == 0
    record = json.loads(out.read_text())
    window, used_stride = MAX_INPUT_LEN, stride or MAX_INPUT_LEN // 2
    assert (record["window"], record["stride"]) == (window, used_stride)

    expected = [hf_strided_nll(tiny_eval_model.hf, ids, window, used_stride) for ids in (short_ids, long_ids)]
    for text, (nll, scored, windows), ids in zip(record["texts"], expected, (short_ids, long_ids)):
        assert (text["tokens"], text["tokens_scored"], text["windows"]) == (len(ids), scored, windows)
        assert scored == len(ids) - 1  # every token but the first, once
        assert text["nll"] == pytest.approx(nll, rel=1e-4)
    assert record["texts"][1]["windows"] > 3
    total_nll, total_scored = sum(e[0] for e in expected), sum(e[1] for e in expected)
    summary = record["summary"]
    assert summary["tokens_scored"] == total_scored
    assert summary["perplexity"] == pytest.approx(math.exp(total_nll / total_scored), rel=1e-4)
    assert f"{summary['perplexity']:.4f}" in capsys.readouterr().out  # the table shows it


def test_plain_text_file_is_one_text_and_max_samples_cuts(tiny_eval_model, texts_file, tmp_path):
    plain = tmp_path / "long.txt"
    plain.write_text(LONG)
    out_plain, out_first = tmp_path / "plain.json", tmp_path / "first.json"
    engine = ["eval", "perplexity", "--engine_dir", str(tiny_eval_model.engine_dir)]
    assert main(engine + ["--dataset", str(plain), "--window", "20", "--stride", "5",
                          "--output_json", str(out_plain)]) == 0
    assert main(engine + ["--dataset", str(texts_file), "--max_samples", "1", "--output_json", str(out_first)]) == 0
    plain_record, first_record = json.loads(out_plain.read_text()), json.loads(out_first.read_text())
    ids = _tokens(tiny_eval_model.engine_dir, LONG)
    nll, scored, windows = hf_strided_nll(tiny_eval_model.hf, ids, 20, 5)
    assert plain_record["summary"]["texts"] == 1 and plain_record["summary"]["windows"] == windows
    assert plain_record["summary"]["nll"] == pytest.approx(nll, rel=1e-4)
    assert first_record["summary"]["texts"] == 1
    assert first_record["summary"]["tokens_scored"] == len(_tokens(tiny_eval_model.engine_dir, SHORT)) - 1


@pytest.mark.parametrize("num_tokens,window,stride", [(1, 4, 2), (2, 2, 1), (5, 8, 4), (40, 8, 3), (41, 32, 16)])
def test_sliding_windows_score_each_token_once(num_tokens, window, stride):
    windows = sliding_windows(num_tokens, window, stride)
    scored = [p for w in windows for p in range(w.score_from, w.end)]
    assert scored == list(range(1, num_tokens))  # in order, once each, never the first
    for j, w in enumerate(windows):
        assert w.start == j * stride and w.end - w.start <= window and w.start < w.score_from <= w.end


@pytest.mark.parametrize("flags,names", [
    (["--dataset", "{tmp}/missing.jsonl"], "--dataset"),
    (["--dataset", "{bad}"], "line 2"),
    (["--dataset", "{texts}", "--window", str(MAX_INPUT_LEN + 1)], "--window"),
    (["--dataset", "{texts}", "--window", "1"], "--window"),
    (["--dataset", "{texts}", "--stride", "0"], "--stride"),
    (["--dataset", "{texts}", "--window", "8", "--stride", "8"], "--stride"),
    (["--dataset", "{texts}", "--max_samples", "0"], "--max_samples"),
])
def test_bad_inputs_exit_2_naming_the_flag(tiny_eval_model, texts_file, tmp_path, capsys, flags, names):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "no text key"}) + "\n")
    out = tmp_path / "out.json"
    flags = [f.format(tmp=tmp_path, bad=bad, texts=texts_file) for f in flags]
    code = main(["eval", "perplexity", "--engine_dir", str(tiny_eval_model.engine_dir), "--output_json", str(out),
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and names in err, err
    assert not out.exists()


def test_missing_engine_dir_exits_2(tmp_path, texts_file, capsys):
    code = main(["eval", "perplexity", "--engine_dir", str(tmp_path / "nope"), "--dataset", str(texts_file)])
    assert code == 2 and "--engine_dir" in capsys.readouterr().err
