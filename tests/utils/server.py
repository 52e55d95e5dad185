"""A kiln server on a tiny engine for the serve tests: uvicorn in a background thread on a free
loopback port, with the official ``openai`` client pointed at it."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import uvicorn

MODEL = "tiny"  # the served model name
MAX_INPUT_LEN = 48
MAX_SEQ_LEN = 128
BUILD_OPTIONS = dict(tokens_per_block=4, max_batch_size=16, max_num_tokens=128, max_input_len=MAX_INPUT_LEN,
                     max_seq_len=MAX_SEQ_LEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """uvicorn serving ``app`` on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    @property
    def engine(self):
        """The app's ServingEngine."""
        return self.app.state.engine

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve_tiny(engine_dir, speculative_config: dict | None = None, **app_kwargs) -> LocalServer:
    """A LocalServer of ``engine_dir`` as MODEL, with a 4,096-token KV cache."""
    from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
    from kiln.serve import create_app

    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=4096), speculative_config=speculative_config)
    return LocalServer(create_app(engine_dir, executor_config=config, served_model_name=MODEL, **app_kwargs))


def streams_with_hang_ups(server: LocalServer, client: openai.OpenAI, prompt: str, count: int = 64,
                          max_tokens: int = 24) -> tuple[dict, list, list]:
    """``count`` streaming completions at once, every fourth client reading two events and hanging
    up. Returns ({i: (text events, finish reason)} of those that read to the end, the errors, the
    indices that hung up)."""
    results, errors, hung_up = {}, [], []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def streams(i):
        try:
            chunks = list(client.completions.create(model=MODEL, prompt=f"{prompt} {i}", max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
            results[i] = (sum(1 for c in chunks if c.choices and c.choices[0].text is not None),
                          chunks[-1].choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    def hangs_up(i):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({**body, "prompt": f"{prompt} {i}"}),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            events = 0
            while events < 2:
                events += response.readline().startswith(b"data: ")
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            hung_up.append(i)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=hangs_up if i % 4 == 3 else streams, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors, hung_up
