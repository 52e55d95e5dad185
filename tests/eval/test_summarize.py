"""``kiln eval summarize``: prompts, ShareGPT mining, kiln beside HF on a tiny model, bad inputs."""
from __future__ import annotations

import json
import re

import pytest
from rouge_score import rouge_scorer

from kiln.cli.main import main
from kiln.data.sharegpt import iter_conversations, summarization_request, summarization_requests
from kiln.eval.summarize import DEFAULT_INSTRUCTION, PromptBuilder
from tests.conftest import convert_and_build
from tests.utils.tiny_models import make_llama
from tests.utils.tiny_tokenizer import VOCAB_SIZE, save_tiny_tokenizer

ARTICLES = [
    {"article": "The quick brown fox jumps over the lazy dog near the river bank every morning. " * 6,
     "highlights": "A fox jumps over a dog each morning."},
    {"article": "The engine converts checkpoints and builds engines.",  # shorter than the budget
     "highlights": "The engine builds engines."},
    {"id": "third", "article": "A language model predicts the next token, and perplexity measures how well "
                               "it does on held-out text. " * 5,
     "highlights": "Perplexity measures a language model.", "instruction": "Give a one-line summary."},
    {"article": "Summarize the following article about a CPU that runs models fast. " * 8,
     "highlights": "A CPU runs models fast."},
]
MAX_OUTPUT = 12
ARTICLE_TOKENS = 60


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF dir with the tiny tokenizer, kiln engine dir, JSONL dataset path) of a float32 tiny Llama."""
    root = tmp_path_factory.mktemp("summ")
    hf_dir = root / "hf"
    make_llama(hf_dir, vocab=VOCAB_SIZE, max_positions=512)
    save_tiny_tokenizer(hf_dir)
    engine = convert_and_build(hf_dir, root / "work", dtype="float32")
    dataset = root / "articles.jsonl"
    dataset.write_text("\n".join(json.dumps(a) for a in ARTICLES) + "\n\n")
    return hf_dir, engine, dataset


def _summarize(engine, *extra) -> int:
    return main(["eval", "summarize", "--engine_dir", str(engine), "--threads", "2", *map(str, extra)])


# -- prompts ------------------------------------------------------------------------------------

def test_prompt_is_instruction_then_article_cut_to_budget(tmp_path):
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    builder = PromptBuilder(tok)
    assert not builder.chat
    article = ARTICLES[0]["article"]
    article_ids = tok(article.strip(), add_special_tokens=False)["input_ids"]
    ids = builder.build(DEFAULT_INSTRUCTION, article, 20)
    assert len(ids) == builder.overhead(DEFAULT_INSTRUCTION) + 20
    assert article_ids[:20] in [ids[i:i + 20] for i in range(len(ids) - 19)]
    text = tok.decode(ids)
    assert text.startswith(DEFAULT_INSTRUCTION + "\n\n") and text.endswith("\n\nSummary:")
    assert tok.decode(article_ids[:20]) in text

    # A chat template: instruction and article become one user message
    tok.chat_template = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    builder = PromptBuilder(tok)
    assert builder.chat
    ids = builder.build("Sum it up.", "Short text.", 100)
    assert tok.decode(ids) == "<s>[user] Sum it up.\n\nShort text.</s>[assistant] "


# -- kiln beside HF on a tiny model -----------------------------------------------------------------

def test_kiln_and_hf_agree_and_check_accuracy(tiny, tmp_path, capsys):
    hf_dir, engine, dataset = tiny
    out = tmp_path / "result.json"
    code = _summarize(engine, "--dataset", dataset, "--hf_model_dir", hf_dir, "--output_json", out,
                      "--batch_size", 3, "--max_output_len", MAX_OUTPUT, "--max_input_len", ARTICLE_TOKENS,
                      "--check_accuracy", "--rouge1_threshold", 0)
    printed = capsys.readouterr().out
    assert code == 0
    assert "PASS" in printed and re.search(r"^kiln\s", printed, re.M) and re.search(r"^HF\s", printed, re.M)
    record = json.loads(out.read_text())
    assert record["article_tokens"] == ARTICLE_TOKENS and record["chat_template"] is False
    assert record["check_accuracy"] == {"rouge1_threshold": 0.0, "passed": True}
    samples = record["samples"]
    assert [s["id"] for s in samples] == ["line 1", "line 2", "third", "line 4"]
    # the short article is not padded to the budget; the others are cut to it
    lengths = [s["prompt_tokens"] for s in samples]
    assert lengths[1] < lengths[0] and lengths[0] != lengths[2]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    for side in ("kiln", "hf"):
        assert record[side]["samples"] == len(ARTICLES)
        assert record[side]["output_tokens"] == sum(len(s[side]["tokens"]) for s in samples)
        for s, article in zip(samples, ARTICLES):
            assert 1 <= len(s[side]["tokens"]) <= MAX_OUTPUT
            expected = scorer.score(article["highlights"], s[side]["text"])
            assert s[side]["rouge"] == pytest.approx({k: 100 * v.fmeasure for k, v in expected.items()})
    # float32 and greedy: the same tokens, so the same ROUGE
    assert [s["kiln"]["tokens"] for s in samples] == [s["hf"]["tokens"] for s in samples]
    assert record["identical_outputs"] == len(ARTICLES)
    assert record["kiln"]["rouge"] == record["hf"]["rouge"]

    # References near kiln's own outputs give ROUGE well above 0, distinct per key; the
    # threshold is inclusive: kiln's ROUGE-1 passes, a hair above it fails, and so does 101
    near = tmp_path / "near.jsonl"
    near.write_text("".join(json.dumps({**a, "highlights": f"{s['kiln']['text']} fox river\nmodel"}) + "\n"
                            for a, s in zip(ARTICLES, samples)))
    common = ["--dataset", near, "--max_output_len", MAX_OUTPUT, "--max_input_len", ARTICLE_TOKENS,
              "--check_accuracy", "--output_json", out]
    assert _summarize(engine, *common, "--rouge1_threshold", 101) == 1
    assert "FAIL" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["check_accuracy"]["passed"] is False
    scores = record["kiln"]["rouge"]
    assert 0 < scores["rouge1"] < 100 and len(set(scores.values())) > 1
    for key, value in scores.items():
        assert value == pytest.approx(sum(s["kiln"]["rouge"][key] for s in record["samples"]) / len(ARTICLES))
    for s in record["samples"]:
        expected = scorer.score(s["reference"], s["kiln"]["text"])
        assert s["kiln"]["rouge"] == pytest.approx({k: 100 * v.fmeasure for k, v in expected.items()})
    assert _summarize(engine, *common, "--rouge1_threshold", repr(scores["rouge1"])) == 0
    assert "PASS" in capsys.readouterr().out
    assert _summarize(engine, *common, "--rouge1_threshold", repr(scores["rouge1"] + 0.01)) == 1
    assert "FAIL" in capsys.readouterr().out


def test_max_input_len_beyond_the_engine_is_an_error(tiny, capsys):
    _, engine, dataset = tiny
    assert _summarize(engine, "--dataset", dataset, "--max_input_len", 100_000) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max_input_len 100000" in err


# -- ShareGPT ---------------------------------------------------------------------------------------

def test_sharegpt_requests_are_deterministic_and_follow_the_rule():
    first = summarization_requests(5)
    assert len(first) == 5
    assert [r["id"] for r in summarization_requests(5)] == [r["id"] for r in first]
    turns = {}
    wanted = {r["id"].split(":")[0] for r in first}
    for conversation in iter_conversations():
        if conversation["id"] in wanted:
            turns[conversation["id"]] = conversation["conversations"]
            if len(turns) == len(wanted):
                break
    for r in first:
        conversation, index = r["id"].split(":")
        human, gpt = turns[conversation][int(index)], turns[conversation][int(index) + 1]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        assert re.search(r"summar|tl;?\s?dr|sum up", r["instruction"], re.I)
        assert r["instruction"].rstrip(":") in human["value"] and r["article"] in human["value"]
        assert len(r["article"].split()) >= 200 and len(r["highlights"].split()) >= 20
        assert r["highlights"] == gpt["value"].strip()
        assert "```" not in r["article"]


def test_summarization_request_rules():
    text = " ".join(["The council met on Tuesday to discuss the new budget for the city and its parks."] * 15)
    reply = "The council discussed the city budget and the parks on Tuesday, and it agreed to meet again next month to vote on the plan."
    asked = summarization_request("Summarize this article:\n" + text, reply)
    assert asked == {"article": text, "highlights": reply, "instruction": "Summarize this article:"}
    assert summarization_request(text + "\nTL;DR", reply)["instruction"] == "TL;DR"
    assert summarization_request("Summarize this: " + text, reply)["article"] == text  # same line
    assert summarization_request("Please write a short summary of this.\n" + text, reply) is not None
    assert summarization_request("Don't summarize it, just say okay.\n" + text, reply) is None
    assert summarization_request("Translate this.\n" + text, reply) is None
    assert summarization_request("In summary, the council met.\n" + text, reply) is None
    assert summarization_request("Summarize this:\n" + " ".join(text.split()[:150]), reply) is None
    assert summarization_request("Summarize this:\n" + text, "A short reply.") is None
    code = "\n".join(["def f(x):", "    return {x: [x * 2]}; y = f(1)"] * 40)
    assert summarization_request("Summarize this code:\n" + code + "\n" + text, reply) is None
    other = " ".join(["Der Rat hat am Dienstag über den neuen Haushalt für die Stadt und Parks gesprochen."] * 20)
    assert summarization_request("Summarize this:\n" + other, reply) is None


def test_sharegpt_end_to_end(tiny, tmp_path):
    _, engine, _ = tiny
    out = tmp_path / "sharegpt.json"
    assert _summarize(engine, "--dataset", "sharegpt", "--max_samples", 2, "--max_output_len", 8,
                      "--output_json", out) == 0
    record = json.loads(out.read_text())
    assert "hf" not in record and record["kiln"]["samples"] == 2
    assert [s["id"] for s in record["samples"]] == [r["id"] for r in summarization_requests(2)]
    assert all(s["prompt_tokens"] <= 512 - 8 for s in record["samples"])


# -- bad inputs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "malformed", "fields", "empty", "unknown"])
def test_bad_datasets_exit_2_naming_them(tiny, tmp_path, capsys, case):
    _, engine, _ = tiny
    path = tmp_path / "data.jsonl"
    expected = str(path)
    if case == "malformed":
        path.write_text(json.dumps(ARTICLES[0]) + "\n{not json\n")
        expected = f"{path} line 2"
    elif case == "fields":
        path.write_text(json.dumps({"article": "text"}) + "\n")
        expected = f"{path} line 1"
    elif case == "empty":
        path.write_text("\n\n")
    elif case == "unknown":
        path = expected = "cnn_dailymail"
    out = tmp_path / "out.json"
    assert _summarize(engine, "--dataset", path, "--output_json", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dataset" in err and expected in err, err
    assert not out.exists()
