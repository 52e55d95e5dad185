"""LoRA adapters through the server, driven by the official ``openai`` client: adapters chosen by
model name, listed by /v1/models, loaded at run time, counted in /metrics."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
from kiln.serve import create_app
from tests.conftest import convert_and_build
from tests.utils.server import LocalServer
from tests.utils.fakes import make_tiny_llama_with_tokenizer

MODEL = "tiny"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine dir, {adapter name: PEFT adapter dir}): two adapters of random, non-zero A and B
    (PEFT's random init, strong enough to change a greedy continuation of the tiny model)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve-lora")
    make_tiny_llama_with_tokenizer(root / "hf")
    engine = convert_and_build(root / "hf", root / "kiln", build_options=dict(tokens_per_block=4, max_batch_size=8),
                               dtype="float32")
    adapters = {}
    for i, (name, targets) in enumerate([("sql", ["q_proj", "v_proj"]), ("poet", ["o_proj", "down_proj"])]):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32),
                               PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        model.save_pretrained(root / name)
        adapters[name] = root / name
    return engine, adapters


@pytest.fixture(scope="module")
def server(setup):
    engine, adapters = setup
    s = LocalServer(create_app(engine, executor_config=ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=2048)),
                           served_model_name=MODEL, lora_adapters={"sql": adapters["sql"]}))
    yield s
    s.stop()


def _expected(setup, lora) -> str:
    llm = LLM(setup[0], progress=False)
    return llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0), lora=lora)[0].outputs[0].text


def _post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(server.url(path), data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_adapters_by_model_name(setup, server):
    client = server.client()
    assert [(m.id, getattr(m, "parent", None)) for m in client.models.list().data] == [(MODEL, None), ("sql", MODEL)]
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    sql = client.completions.create(model="sql", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert base == _expected(setup, None) and sql == _expected(setup, setup[1]["sql"]) and sql != base
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert chat.model == MODEL and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="poet"):
        client.completions.create(model="poet", prompt=PROMPT, max_tokens=2)


def test_loading_an_adapter_at_run_time(setup, server):
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(setup[1]["poet"])})
    assert status == 200 and json.loads(text)["id"] == "poet" and json.loads(text)["parent"] == MODEL, text
    client = server.client()
    assert "poet" in [m.id for m in client.models.list().data]
    poet = client.completions.create(model="poet", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert poet == _expected(setup, setup[1]["poet"])
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(setup[1]["poet"])})
    assert status == 400 and "already served" in json.loads(text)["error"]["message"]
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(setup[0])})
    assert status == 400 and "not a LoRA adapter" in json.loads(text)["error"]["message"]
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as response:
        metrics = response.read().decode()
    assert "kiln_lora_host_adapters" in metrics and "kiln_lora_cache_hits" in metrics


def test_adapters_built_into_the_engine_are_served_by_name(setup, tmp_path):
    from kiln.build import build_engine

    engine, adapters = setup
    built = build_engine(engine.parent / "checkpoint", tmp_path / "engine", progress=False, dtype="float32",
                         lora_dirs=[adapters["poet"]])
    s = LocalServer(create_app(built, executor_config=ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=1024)),
                           served_model_name=MODEL))
    try:
        client = s.client()
        assert [m.id for m in client.models.list().data] == [MODEL, "poet"]
        poet = client.completions.create(model="poet", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
        assert poet == _expected(setup, adapters["poet"])
    finally:
        s.stop()
