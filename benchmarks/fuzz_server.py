"""Robustness run of ``kiln serve`` on the bundled SmolLM2 (a long version of the suite's checks).

1. Schemathesis over the server's own OpenAPI schema: ``--examples`` generated requests per
   operation (valid and hostile bodies; the served model name in most of them), each checked
   for a 5xx, a hang and a response that breaks the published schema, each followed by a normal
   chat request that must succeed.
2. Load with disconnects: ``--rounds`` rounds of ``--streams`` concurrent streaming chat
   requests, a ``--disconnect_fraction`` of which hang up after two events; after each round
   the KV block pool must be back to its idle size.

Prints both reports and appends one line to ``benchmarks/results.jsonl``.

    python benchmarks/fuzz_server.py [--examples 2000] [--seed 1] [--streams 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.utils: the fuzz driver and the in-process server

import torch  # noqa: E402

from kiln.engine_cache import resolve_engine  # noqa: E402
from kiln.examples import smollm2_gguf_path  # noqa: E402
from kiln.runtime.executor import ExecutorConfig, KvCacheConfig  # noqa: E402
from kiln.serve import create_app  # noqa: E402
from tests.utils.fuzz import fuzz_openapi  # noqa: E402
from tests.utils.server import LocalServer  # noqa: E402

MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Say hello."}]


def load_round(server: LocalServer, streams: int, fraction: float, max_tokens: int) -> dict:
    """``streams`` concurrent streaming chats, every ``1/fraction``-th hanging up after two events."""
    client = server.client()
    every = max(1, round(1 / fraction)) if fraction > 0 else 0
    done, hung_up, errors = [], [], []
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    def full(i: int) -> None:
        try:
            chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                                         stream=True, extra_body={"ignore_eos": True}))
            done.append(chunks[-1].choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - counted
            errors.append(repr(e))

    def hang_up(i: int) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            events = 0
            while events < 2:
                line = response.readline()
                if not line:
                    raise ConnectionError("the stream ended early")
                events += line.startswith(b"data: ")
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            hung_up.append(i)
        except Exception as e:  # noqa: BLE001 - counted
            errors.append(repr(e))

    started = time.perf_counter()
    threads = [threading.Thread(target=hang_up if every and i % every == every - 1 else full, args=(i,))
               for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    pool = server.engine.executor.core.pool
    deadline = time.monotonic() + 30
    while pool.num_free != pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"streams": streams, "completed": len(done), "completed_length": done.count("length"),
            "disconnected": len(hung_up), "errors": errors, "blocks_leaked": pool.num_blocks - pool.num_free,
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=2000, help="generated requests per API operation")
    p.add_argument("--seed", type=int, default=1, help="hypothesis seed of the fuzz run")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams per load round")
    p.add_argument("--rounds", type=int, default=5, help="load rounds")
    p.add_argument("--disconnect_fraction", type=float, default=0.25, help="share of streams that hang up")
    p.add_argument("--max_tokens", type=int, default=32, help="tokens each load stream asks for")
    p.add_argument("--cache_dir", help="engine cache (default: a temporary directory)")
    args = p.parse_args()

    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # the code this run loaded
    cache = args.cache_dir or tempfile.mkdtemp(prefix="kiln-fuzz-")
    engine_dir = resolve_engine(smollm2_gguf_path(), cache_dir=cache, progress=True,
                                build_options=dict(max_batch_size=16, max_seq_len=512, max_input_len=384))
    server = LocalServer(create_app(engine_dir, served_model_name=MODEL, executor_config=ExecutorConfig(
        kv_cache_config=KvCacheConfig(max_tokens=16 * 512))))
    client = server.client()

    def normal_request() -> None:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")

    try:
        progress = {"n": 0}

        def tick() -> None:
            progress["n"] += 1
            if progress["n"] % 500 == 0:
                print(f"  {progress['n']} fuzz cases", flush=True)

        print(f"fuzzing: {args.examples} examples per operation, seed {args.seed}", flush=True)
        started = time.perf_counter()
        report = fuzz_openapi(server.url("/openapi.json"), args.examples, model=MODEL, after_each=normal_request,
                              seed=args.seed, on_case=tick)
        fuzz_s = time.perf_counter() - started
        print(f"fuzz: {report.cases} cases in {fuzz_s:.0f} s; statuses {dict(sorted(report.by_status.items()))}; "
              f"5xx: {report.server_errors}; failed checks: {len(report.failures)}")
        for failure in report.failures[:5]:
            print("  " + failure[:1000])
        rounds = []
        for i in range(args.rounds):
            r = load_round(server, args.streams, args.disconnect_fraction, args.max_tokens)
            rounds.append(r)
            print(f"load round {i + 1}: {r['streams']} streams, {r['completed']} completed ({r['completed_length']} "
                  f"to max_tokens), {r['disconnected']} hung up, {len(r['errors'])} errors, "
                  f"{r['blocks_leaked']} KV blocks leaked, {r['seconds']} s")
        healthy = server.engine.failure is None
    finally:
        server.stop()
    record = {"kind": "robustness", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "kiln_commit": commit, "model": "SmolLM2-135M-Instruct (bundled GGUF)",
              "fuzz": {"examples_per_operation": args.examples, "seed": args.seed, "cases": report.cases,
                       "by_status": report.by_status, "server_errors": report.server_errors,
                       "failed_checks": len(report.failures), "seconds": round(fuzz_s)},
              "load": [{k: v for k, v in r.items() if k != "errors"} | {"errors": len(r["errors"])} for r in rounds],
              "engine_healthy_after": healthy,
              "command": "python benchmarks/fuzz_server.py " + " ".join(sys.argv[1:])}
    with open(ROOT / "benchmarks" / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py")], check=True)  # benchmarks/README.md
    clean = (report.server_errors == 0 and not report.failures and healthy
             and all(not r["errors"] and r["blocks_leaked"] == 0 for r in rounds))
    print("clean" if clean else "FOUND PROBLEMS")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
