"""EngineArgs: every option that picks, builds and sizes an engine, each with one default.

``LLM(model, **options)`` takes its fields as keywords, and the flags of ``kiln build``, ``run``,
``serve``, ``bench`` and ``eval`` are generated from them (``add_cli_args``), so an option has
one name, one default and one help text everywhere. Each field says what it is:

* ``source``: how the model is found or converted (tokenizer, cache directory, quantization);
* ``build``: a build limit, part of the engine's identity (a different value is a different
  engine; given with a prebuilt engine it must match what that engine was built with);
* ``limit``: a run-time limit the engine is built for at least: a value above kiln build's
  default builds a larger engine, any other value only caps the runtime (and a prebuilt engine
  caps it at its own limit);
* ``runtime``: a run-time setting only (KV-cache size, prefix caching).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

from kiln.config.build import BuildConfig
from kiln.config.quant_algos import ALGOS
from kiln.config.speculative import SpeculativeConfig
from kiln.dtypes import DTYPES
from kiln.errors import ConfigError

SOURCE, BUILD, LIMIT, RUNTIME = "source", "build", "limit", "runtime"
COMMANDS = ("build", "run", "serve", "bench", "eval")
_LIMIT_COMMANDS = ("build", "serve")  # run, bench and eval size their own batches


def option(default, kind: str, commands: tuple[str, ...], help: str, *, flag: str | None = None,
           choices: tuple | None = None):
    """An EngineArgs field: its default, kind, the commands with a flag for it, and its help."""
    return field(default=default, metadata={"kind": kind, "commands": commands, "help": help, "flag": flag,
                                            "choices": choices})


@dataclass
class EngineArgs:
    """The engine options of ``LLM``, ``kiln run``, ``kiln serve``, ``kiln bench`` and ``kiln eval``
    (``kiln build`` takes the build ones). ``model``: an engine directory, a kiln checkpoint, a
    Hugging Face directory or a GGUF file; anything but an engine is converted and built into the
    engine cache, the same way by every path."""

    model: str | Path | None = None
    tokenizer: str | Path | None = option(
        None, SOURCE, ("run", "serve", "eval"),
        "tokenizer to use: a tokenizer directory or a GGUF file (default: the one stored in the engine)",
        flag="--tokenizer_dir")
    skip_tokenizer_init: bool = option(
        False, SOURCE, (),
        "load no tokenizer (LLM only): prompts must be token ids, outputs carry token ids and empty text, "
        "and requests may not use stop strings, bad words or structured outputs")
    cache_dir: str | Path | None = option(
        None, SOURCE, ("run", "serve", "bench"),
        "engine cache for a model that is not an engine yet (default $KILN_CACHE_DIR, else ~/.cache/kiln)")
    quantization: str | object | None = option(
        None, SOURCE, ("run", "serve", "bench"),
        "quantize a Hugging Face or GGUF model while converting it into the cache, with this algorithm "
        "(default: none; kiln convert has every quantization option)", choices=tuple(ALGOS))
    dtype: str = option(
        "auto", BUILD, COMMANDS[:4],
        "compute dtype of the engine; auto (default) keeps a dtype chosen with kiln convert --dtype, and is "
        "otherwise bfloat16 for a float32/bfloat16 checkpoint on a CPU with native bf16 (AVX512-BF16 or AMX), "
        "else the checkpoint's", choices=("auto", *DTYPES))
    max_batch_size: int | None = option(
        None, LIMIT, _LIMIT_COMMANDS,
        f"most sequences in one step (default: the engine's limit; kiln build's is {BuildConfig.max_batch_size})")
    max_num_tokens: int | None = option(
        None, LIMIT, _LIMIT_COMMANDS,
        f"most tokens computed in one step, prompt chunks included (default: the engine's limit, kiln build's "
        f"is {BuildConfig.max_num_tokens}; kiln serve takes 1024 or the engine's limit if lower, so running "
        "requests keep streaming while long prompts prefill)")
    max_input_len: int | None = option(
        None, BUILD, ("build",),
        f"longest prompt in tokens (default {BuildConfig.max_input_len}, capped at max_seq_len)")
    max_seq_len: int | None = option(
        None, BUILD, ("build",),
        f"longest prompt + generation in tokens (default {BuildConfig.max_seq_len}, capped at the model's "
        "max positions)")
    tokens_per_block: int | None = option(
        None, BUILD, ("build",), f"tokens per paged KV-cache block (default {BuildConfig.tokens_per_block})")
    max_beam_width: int | None = option(
        None, BUILD, ("build",),
        "widest beam search the engine serves (default 1: none; engines built into the cache: 8)")
    gather_all_token_logits: bool | None = option(
        None, BUILD, ("build",), "let requests ask for the logits of every prompt token (context logits)")
    max_prompt_embedding_table_size: int | None = option(
        None, BUILD, ("build",),
        "enable prompt tuning: the most virtual-token rows a request's embedding table may have (default 0: off)")
    kv_cache_max_tokens: int | None = option(
        None, RUNTIME, ("run", "serve", "bench"),
        "size the KV cache for this many tokens (default: a fraction of free memory)")
    enable_prefix_caching: bool = option(
        False, RUNTIME, ("serve",), "reuse the KV cache of prompt prefixes shared between requests (hybrid models: "
        "also their recurrent states, kept at block boundaries)")
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, RUNTIME, ("run", "serve", "bench"),
        "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' proposes the tokens that followed the last "
        "n tokens' latest earlier occurrence in the prompt and output, and the model keeps those it agrees "
        "with (the same greedy output, the same sampling distribution); '{\"method\": \"draft_model\", "
        "\"model\": \"SOURCE\", \"num_speculative_tokens\": 4}' proposes with a draft model of the same "
        "vocabulary (\"quantization\": \"W4A16\" builds a quantized copy); '{\"method\": \"mtp\", "
        "\"num_speculative_tokens\": 2}' proposes with the model's own multi-token-prediction layer "
        "(Qwen3.5 / Qwen3-Next checkpoints that keep it; default: off)")

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ConfigError(f"tokenizer {self.tokenizer}: skip_tokenizer_init=True loads no tokenizer; "
                              "give one or the other")
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices and isinstance(value, str) and value not in choices:
                raise ConfigError(f"{f.name} {value!r} is not one of {list(choices)}")
            least = 0 if f.name == "max_prompt_embedding_table_size" else 1  # 0: prompt tuning off
            if f.metadata.get("kind") in (BUILD, LIMIT, RUNTIME) and isinstance(value, int) \
                    and not isinstance(value, bool) and value < least:
                raise ConfigError(f"{f.name} must be >= {least}, got {value}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, command: str) -> None:
        """Add the flags ``command`` takes, in one group, each with its field's default and help."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if command not in f.metadata.get("commands", ()):
                continue
            flag = f.metadata["flag"] or f"--{f.name}"
            kwargs: dict = {"dest": f.name, "help": f.metadata["help"]}
            if f.type in ("bool", "bool | None"):
                kwargs.update(action="store_true", default=None if f.default is None else f.default)
            else:
                kwargs.update(default=f.default, choices=f.metadata["choices"],
                              type=int if f.type == "int | None" else None)
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model: str | Path | None = None) -> "EngineArgs":
        """The options parsed by a parser ``add_cli_args`` filled (the others keep their defaults)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "model" and hasattr(args, f.name)}
        return cls(model=model, **given)

    def for_engine(self, engine_dir: str | Path) -> "EngineArgs":
        """These options aimed at the engine they resolved to (already quantized, or not, when its
        source was converted)."""
        return dataclasses.replace(self, model=engine_dir, quantization=None)

    def of_kind(self, *kinds: str) -> dict:
        """The options of these kinds that were set (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata.get("kind") in kinds and getattr(self, f.name) is not None}

    def build_limits(self) -> dict:
        """Every build limit and run-time limit given: what an explicit ``kiln build`` builds with."""
        limits = self.of_kind(BUILD, LIMIT)
        limits.pop("dtype", None)  # None (the source's own) is not "set"
        return limits

    def build_options(self) -> dict:
        """The build limits an engine built from a source gets: every build option given, and a
        run-time limit only when it is above kiln build's default (otherwise it caps the runtime)."""
        return {name: value for name, value in self.build_limits().items()
                if name not in _LIMITS or value > getattr(BuildConfig, name)}

    def check_engine(self, path: Path, build: BuildConfig, dtype: str) -> None:
        """A prebuilt engine at ``path`` (built with ``build`` and ``dtype``) serves these options:
        an explicit dtype and every build option given match it, and a run-time limit is not above
        its own (each would need another engine)."""
        built = {"dtype": dtype, **build.to_dict()}
        wanted = self.of_kind(BUILD, LIMIT)
        if self.dtype == "auto":  # whatever the engine was built with
            del wanted["dtype"]
        for name, value in wanted.items():
            differs = built[name] < value if name in _LIMITS else built[name] != value
            if differs:
                raise ConfigError(f"{name}={value}: {path} is an engine built with {name}={built[name]}; "
                                  "build another one (kiln build) or pass the model it was built from")


_LIMITS = {f.name for f in fields(EngineArgs) if f.metadata.get("kind") == LIMIT}
