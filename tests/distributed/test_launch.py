"""kiln run / serve / bench on an engine split over ranks: the CLI starts the other ranks itself."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils.fakes import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def kiln(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    make_tiny_llama_with_tokenizer(root / "hf")
    return root


def cached_engine(hf: Path, tp_size: int, pp_size: int) -> Path:
    """The engine kiln's cache holds for this split."""
    import json

    for engine in (p.parent for p in (hf / "cache").glob("*/config.json")):
        mapping = json.loads((engine / "config.json").read_text()).get("mapping", {})
        if (mapping.get("tp_size", 1), mapping.get("pp_size", 1)) == (tp_size, pp_size):
            return engine
    raise AssertionError(f"no tp {tp_size} x pp {pp_size} engine in the cache")


RUN = ("run", "--engine_dir", "hf", "--cache_dir", "cache", "--input_text", "the quick brown fox",
       "--max_output_len", "12", "--ignore_eos")


@pytest.fixture(scope="module")
def run(hf):
    """``kiln run`` of the tiny model with a split's flags, each split run once for the module
    (a run also leaves that split's engine in the cache)."""
    done: dict[tuple[str, ...], subprocess.CompletedProcess] = {}

    def get(*split: str) -> subprocess.CompletedProcess:
        if split not in done:
            done[split] = kiln(*RUN, *split, cwd=hf)
        return done[split]
    return get


@pytest.mark.parametrize("split", [("--tp_size", "2"), ("--pp_size", "2"), ("--tp_size", "2", "--pp_size", "2")],
                         ids=["tp2", "pp2", "tp2-pp2"])
def test_kiln_run_split_prints_what_one_process_prints(run, split):
    one, split_run = run(), run(*split)
    assert one.returncode == 0 and split_run.returncode == 0, split_run.stderr
    assert split_run.stdout == one.stdout and one.stdout.strip()
    assert "12 generated" in split_run.stderr


def test_a_mismatched_split_is_refused(hf, run):
    assert run("--tp_size", "2").returncode == 0
    engine = cached_engine(hf, tp_size=2, pp_size=1)
    bad = kiln("run", "--engine_dir", engine, "--input_text", "x", "--tp_size", "4", cwd=hf)
    assert bad.returncode == 2 and "--tp_size 4: " in bad.stderr and "was built for 2" in bad.stderr


def test_kiln_bench_runs_a_pipeline(hf, run):
    """kiln bench throughput on a two-stage engine: the CLI starts the second stage, the
    figures come back, every rank exits."""
    assert run("--pp_size", "2").returncode == 0
    engine = cached_engine(hf, tp_size=1, pp_size=2)
    bench = kiln("bench", "throughput", "--engine_dir", engine, "--pp_size", "2", "--batch_sizes", "2", "4",
                 "--prompt_len", "8", "--new_tokens", "6", "--json", cwd=hf)
    assert bench.returncode == 0, bench.stderr
    record = __import__("json").loads(bench.stdout)
    assert record["world"] == {"tp_size": 1, "pp_size": 2}
    assert [row["batch"] for row in record["batches"]] == [2, 4]
    assert all(row["kiln"]["output_tok_s"] > 0 and row["kiln"]["ttft_s"] > 0 for row in record["batches"])


def _client_once_up(port: int, servers: list[subprocess.Popen]):
    """An openai client of the server on ``port`` once it lists its model, and the model's id."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
    deadline = time.monotonic() + 120
    while True:
        try:
            return client, client.models.list().data[0].id
        except Exception:  # noqa: BLE001 - not up yet
            assert all(s.poll() is None for s in servers) and time.monotonic() < deadline
            time.sleep(0.5)


def _serve(hf: Path, port: int, launcher: list[str], split: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *launcher, "kiln.cli.main", "serve", "hf", "--cache_dir", "cache",
                             "--port", str(port), split, "2"], cwd=hf, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("machines, split", [(1, "--tp_size"), (2, "--tp_size"), (2, "--pp_size")],
                         ids=["spawned-ranks-tp2", "two-torchrun-nodes-tp2", "two-torchrun-nodes-pp2"])
def test_kiln_serve_split_answers_through_the_openai_client(hf, machines, split):
    """One kiln serve starting its second rank itself, or two torchrun "machines" (node groups
    rendezvousing on 127.0.0.1, one rank each: a tensor-parallel half or a pipeline stage each)
    running the same command."""
    from kiln.distributed.launch import free_port

    port = free_port()
    if machines == 1:
        servers = [_serve(hf, port, ["-m"], split)]
    else:
        rendezvous = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                      "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m"]
        servers = [_serve(hf, port, rendezvous, split) for _ in range(2)]
    try:
        client, model = _client_once_up(port, servers)
        text = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        expected = kiln("run", "--engine_dir", "hf", "--cache_dir", "cache", "--input_text", "the quick brown fox",
                        "--max_output_len", "12", "--ignore_eos", cwd=hf).stdout.strip()
        assert text.strip() == expected
    finally:
        for server in servers:  # Ctrl-C: the server shuts its executor down, which releases rank 1
            server.send_signal(2)
        for server in servers:
            server.wait(timeout=60)


def _spawned_ranks(parent: int) -> list[int]:
    """Processes ``parent`` started through multiprocessing's spawn (its followers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            children.append(int(stat.parent.name))
    return children


def test_kiln_serve_exits_when_a_rank_dies(hf):
    """The follower of a tp 2 server is killed: the next request gets an error answer, and the
    server process exits (status 1) instead of serving errors forever."""
    import os
    import signal

    from kiln.distributed.launch import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "hf", "--cache_dir", "cache", "--port",
                               str(port), "--tp_size", "2"], cwd=hf, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        client, model = _client_once_up(port, [server])
        followers = _spawned_ranks(server.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        with pytest.raises(Exception) as failed:  # noqa: PT011 - the openai client's error class varies by status
            client.completions.create(model=model, prompt="the quick brown fox", max_tokens=4)
        assert "died or stopped answering" in str(failed.value)
        assert server.wait(timeout=60) == 1
        assert "kiln serve: stopped: " in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
