"""``kiln serve``: an OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""
from __future__ import annotations

import sys
from pathlib import Path

from kiln import env
from kiln.cli.world import add_world_flags, rank_zero
from kiln.config.engine_args import EngineArgs
from kiln.engine_cache import draft_engine_for, engine_for
from kiln.errors import ConfigError
from kiln.runtime.executor import ExecutorConfig, KvCacheConfig
from kiln.runtime.tool_parsers import TOOL_CALL_PARSERS


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve MODEL over HTTP: /v1/models, /v1/completions and /v1/chat/completions "
                                   "(OpenAI-compatible, with streaming), /health (liveness), /health/ready "
                                   "(readiness) and /metrics (Prometheus). "
                                   "MODEL may be an engine, a kiln checkpoint, a Hugging Face dir or a GGUF "
                                   "file; anything but an engine is converted and built into the engine cache "
                                   "first.")
    p.add_argument("model", help="engine directory, checkpoint, HF dir or GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api_key", default=env.api_key(),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $KILN_API_KEY, else no key)")
    p.add_argument("--served_model_name", help="the model name clients send and /v1/models lists "
                                               "(default: the engine directory's name)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a LoRA adapter (a PEFT adapter directory or a kiln lora convert output) as model "
                        "NAME; repeat for more (more can be loaded at run time: POST /v1/load_lora_adapter)")
    p.add_argument("--tool_call_parser", default="hermes", choices=sorted(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls, for chat requests with tools: 'hermes' "
                        "(<tool_call>{...}</tool_call> blocks: Hermes, Qwen, and kiln's generic tool prompt for chat "
                        "templates without tools, such as SmolLM2's) or 'llama3_json' (Llama 3.1+'s bare JSON "
                        "objects) (default hermes)")
    EngineArgs.add_cli_args(p, "serve")
    g = p.add_argument_group("scheduling")
    g.add_argument("--max_queue_size", type=int, default=1024,
                   help="requests allowed to wait for admission; beyond it requests get HTTP 503 with "
                        "Retry-After (default 1024)")
    g.add_argument("--request_timeout", type=float, metavar="SECONDS",
                   help="end a request this long after it arrived, queueing included (finish reason 'abort'; "
                        "default: no limit)")
    g.add_argument("--graceful_shutdown_timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, refuse new requests (503) and let those in flight finish for up "
                        "to this long, then cancel the rest and exit 0; a second signal exits at once (default 30)")
    add_world_flags(p)
    p.set_defaults(handler=serve)


def serve(args) -> int:
    # FastAPI and uvicorn load for kiln serve only (~0.2 s more for every other command)
    import uvicorn

    from kiln.serve.app import create_app
    from kiln.serve.shutdown import DrainingServer

    engine_dir = engine_dir_for(args)
    config = ExecutorConfig(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                            max_queue_size=args.max_queue_size,
                            speculative_config=draft_engine_for(args.speculative_config, args.cache_dir),
                            kv_cache_config=KvCacheConfig(max_tokens=args.kv_cache_max_tokens,
                                                          enable_block_reuse=args.enable_prefix_caching))
    loras = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {spec!r}: expected NAME=DIR")
        loras[name] = path
    broken: list[BaseException] = []
    server: list = []

    def stop_serving(error: BaseException) -> None:
        """Another rank died: the engine cannot step again, so the server shuts down (as on
        Ctrl-C) and the command fails, for a supervisor to restart it."""
        broken.append(error)
        server[0].should_exit = True

    with rank_zero(engine_dir, args.tp_size, args.pp_size):  # the other ranks of a split engine follow
        app = create_app(engine_dir, tokenizer_dir=args.tokenizer, api_key=args.api_key,
                         executor_config=config, served_model_name=args.served_model_name, lora_adapters=loras,
                         on_world_error=stop_serving, request_timeout=args.request_timeout,
                         tool_call_parser=args.tool_call_parser)
        # uvicorn's own wait for open connections is a backstop: the drain has ended them.
        uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                        timeout_graceful_shutdown=5)
        server.append(DrainingServer(app, uvicorn_config, grace=args.graceful_shutdown_timeout))
        server[0].run()
    if broken:
        print(f"kiln serve: stopped: {broken[0]}", file=sys.stderr)
        return 1
    return 0


def engine_dir_for(args) -> Path:
    """The engine MODEL names, built into the cache from any other source as ``LLM(source)`` and
    ``kiln run`` build it. --max_batch_size and --max_num_tokens are run-time limits; only a
    value above what that engine is built for (kiln build's defaults) builds a larger one."""
    return engine_for(EngineArgs.from_cli_args(args, model=args.model), tp_size=args.tp_size, pp_size=args.pp_size)
