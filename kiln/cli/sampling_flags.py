"""The sampling flags of ``kiln run``, generated from :class:`SamplingParams`' fields: each flag is
a field's name (plus the older names in its metadata), with its help and default, so a new
sampling knob needs no CLI code. A field whose group is None (a tensor) has no flag."""
from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, Field, fields

from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams

_GROUP_ORDER = ("length", "sampling", "penalties and biases", "stop and bad words", "several outputs", "log-probs")
_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def _json(kind: str):
    def parse(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON {kind} ({e.msg})") from None
    parse.__name__ = f"JSON {kind}"  # argparse names the type in its error
    return parse


_KINDS = {  # argparse keywords by a field's declared type
    "int": dict(type=int), "int | None": dict(type=int), "float": dict(type=float),
    "bool": dict(action="store_true"),
    "list[int]": dict(type=int, nargs="*", metavar="ID"), "list[str]": dict(nargs="*", metavar="TEXT"),
    "dict[int, float]": dict(type=_json("object"), metavar="JSON"),
    "list[list[int]]": dict(type=_json("list"), metavar="JSON"),
    "bool | str": dict(choices=list(_EARLY_STOPPING)),
}


def _flag_options(f: Field, default) -> dict:
    """argparse keywords for field ``f``, by its declared type."""
    if f.type == "bool | str":  # early_stopping: the flag's words for True and False
        default = {True: "true", False: "false"}.get(default, default)
    shown = "" if f.type == "bool" or default in (None, [], {}) else f" (default {default})"
    return dict(_KINDS[f.type], default=default, help=f.metadata["help"] + shown)


def add_sampling_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> dict:
    """Add a flag per SamplingParams field, grouped; ``defaults`` overrides a field's default
    for this command (``kiln run`` decodes greedily and 64 tokens unless told otherwise).
    Returns the argument groups by name, for a command's own flags."""
    defaults = defaults or {}
    groups = {name: parser.add_argument_group(name) for name in _GROUP_ORDER}
    for f in fields(SamplingParams):
        group = f.metadata.get("group")
        if group is None:
            continue
        default = defaults.get(f.name, f.default if f.default is not MISSING else f.default_factory())
        groups[group].add_argument(f"--{f.name}", *f.metadata["aliases"], dest=f.name, **_flag_options(f, default))
    return groups


def sampling_params_from(args: argparse.Namespace, **overrides) -> SamplingParams:
    """The SamplingParams the parsed flags describe (``overrides`` win); a value out of range is
    a RequestError naming the field."""
    values = {f.name: getattr(args, f.name) for f in fields(SamplingParams) if hasattr(args, f.name)}
    if isinstance(values.get("early_stopping"), str):
        values["early_stopping"] = _EARLY_STOPPING[values["early_stopping"]]
    given = values.get("logit_bias")
    if not isinstance(given, dict):
        raise RequestError(f"logit_bias must be a JSON object of token id -> bias, got {given!r}")
    try:
        values["logit_bias"] = {int(token): bias for token, bias in given.items()}
    except ValueError:
        raise RequestError(f"logit_bias keys must be token ids, got {sorted(given)}") from None
    return SamplingParams(**{**values, **overrides})
