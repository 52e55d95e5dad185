"""kiln run / kiln serve on a tensor-parallel engine: the CLI starts the other ranks itself."""
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


def test_kiln_run_with_tp_2_prints_what_one_process_prints(hf):
    common = ("run", "--engine_dir", "hf", "--cache_dir", "cache", "--input_text", "the quick brown fox",
              "--max_output_len", "12", "--ignore_eos")
    one, two = kiln(*common, cwd=hf), kiln(*common, "--tp_size", "2", cwd=hf)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "12 generated" in two.stderr
    engine = next(p for p in (hf / "cache").iterdir() if (p / "rank1.safetensors").is_file())
    bad = kiln("run", "--engine_dir", engine, "--input_text", "x", "--tp_size", "4", cwd=hf)
    assert bad.returncode == 2 and "--tp_size 4: " in bad.stderr and "was built for 2" in bad.stderr


def _serve(hf: Path, port: int, launcher: list[str], extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *launcher, "kiln.cli.main", "serve", "hf", "--cache_dir", "cache",
                             "--port", str(port), "--tp_size", "2", *extra], cwd=hf, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("machines", [1, 2], ids=["spawned-ranks", "two-torchrun-nodes"])
def test_kiln_serve_with_tp_2_answers_through_the_openai_client(hf, machines):
    """One kiln serve starting its second rank itself, or two torchrun "machines" (node groups
    rendezvousing on 127.0.0.1, one rank each) running the same command."""
    from openai import OpenAI

    from kiln.distributed.launch import free_port

    port = free_port()
    if machines == 1:
        servers = [_serve(hf, port, ["-m"], [])]
    else:
        rendezvous = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                      "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m"]
        servers = [_serve(hf, port, rendezvous, []) for _ in range(2)]
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert all(s.poll() is None for s in servers) and time.monotonic() < deadline
                time.sleep(0.5)
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
