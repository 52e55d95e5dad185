"""ModelWeightsLoader (reference 000): external checkpoint tensors -> kiln parameters.

For each kiln parameter name the loader

1. translates it, section by section, into one or more external names
   (``transformer.layers.0.attention.qkv.weight`` -> ``model.layers.0.self_attn.{q,k,v}_proj.weight``);
2. reads only the slice this rank needs (the owning layer's ``load_spec``);
3. runs an optional ``preprocess`` and the layer's ``postprocess`` (concatenation,
   transposes, padding) to get kiln tensors.

Key-map priority, lowest to highest: the default LLaMA map, the customized map given to
the constructor, then a layer's own ``external_key_map`` for its parameters.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from kiln.checkpoint.safetensors_io import SafetensorsReader
from kiln.checkpoint.sources import TensorSource, open_source
from kiln.errors import CheckpointError, preview
from kiln.checkpoint.shard_spec import ShardSpec, rank_range

KeyMap = dict[str, "str | list[str]"]

DEFAULT_KEY_MAP: KeyMap = {
    "transformer": "model",
    "vocab_embedding": "embed_tokens",
    "lm_head": "lm_head",
    "ln_f": "norm",
    "attention": "self_attn",
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "dense": "o_proj",
    "gate": "up_proj",
    "proj": "down_proj",
    "fc": "gate_proj",
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}


def translate_key(key: str, key_map: KeyMap) -> list[str]:
    """All external names for a kiln name; one-to-many entries multiply the result.

    A section mapped to ``""`` is dropped (``{"transformer": ""}`` for unprefixed names).
    """
    results = [[]]
    for section in key.split("."):
        mapped = key_map.get(section, section)
        options = mapped if isinstance(mapped, list) else [mapped]
        results = [prefix + ([m] if m else []) for prefix in results for m in options]
    return [".".join(parts) for parts in results]


class ModelWeightsLoader:
    """Loads kiln parameters from an external checkpoint (directory, file or open source)."""

    def __init__(self, model_dir: str | Path | TensorSource, customized_key_dict: KeyMap | None = None):
        self.source: TensorSource = (open_source(model_dir) if isinstance(model_dir, (str, Path))
                                     else model_dir)
        self.key_map: KeyMap = {**DEFAULT_KEY_MAP, **(customized_key_dict or {})}
        self._external_keys = set(self.source.keys())
        self._module_key_maps: dict[str, KeyMap] = {}

    # -- translation ------------------------------------------------------------------

    def update_key_mapping(self, model: nn.Module) -> None:
        """Record layer-level key maps (a layer's ``external_key_map`` wins for its parameters)."""
        self._module_key_maps = {
            name: {**self.key_map, **module.external_key_map}
            for name, module in model.named_modules() if getattr(module, "external_key_map", None)
        }

    def translate(self, tllm_key: str) -> list[str]:
        module_name = tllm_key.rpartition(".")[0]
        key_map = self.key_map
        # The innermost module with its own map decides.
        while True:
            if module_name in self._module_key_maps:
                key_map = self._module_key_maps[module_name]
                break
            if not module_name:
                break
            module_name = module_name.rpartition(".")[0]
        return translate_key(tllm_key, key_map)

    # -- loading ---------------------------------------------------------------------------

    def load_tensor(self, key: str, tp_size: int = 1, tp_dim: int | None = None, tp_rank: int = 0,
                    spec: ShardSpec | None = None) -> torch.Tensor | None:
        """Read external tensor ``key``, or only rank ``tp_rank``'s part of it along ``tp_dim``.

        Returns ``None`` when the checkpoint has no such tensor. Only the needed slice is
        read. ``spec`` describes a dimension made of several parts, each split on its own.
        """
        if key not in self._external_keys:
            return None
        if spec is None:
            spec = ShardSpec.even(tp_dim, tp_size, tp_rank)
        if spec.dim is None:
            return self.source.read(key)
        shape = self.source.shape(key)
        dim = spec.dim % len(shape)
        sizes = [size if size is not None else shape[dim] for size, _, _ in spec.parts]
        if sum(sizes) != shape[dim]:
            raise CheckpointError(
                f"{self.source.path}: tensor {key!r} has {shape[dim]} entries along dim {dim}, "
                f"expected {sum(sizes)} (parts {sizes})")
        pieces, offset = [], 0
        for size, (_, part_tp_size, part_tp_rank) in zip(sizes, spec.parts):
            if part_tp_size == 0:  # a part this parameter does not take
                offset += size
                continue
            start, stop = rank_range(size, part_tp_size, part_tp_rank)
            index = tuple(slice(offset + start, offset + stop) if d == dim else slice(None)
                          for d in range(len(shape)))
            pieces.append(self.source.read(key, index))
            offset += size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def load(self, tllm_key: str, preprocess: Callable | None = None, module: nn.Module | None = None,
             **kwargs) -> dict[str, torch.Tensor]:
        """Load one kiln parameter (and whatever its layer's postprocess adds)."""
        external = self.translate(tllm_key)
        param_name = tllm_key.rpartition(".")[2]
        missing = [k for k in external if k not in self._external_keys]
        if missing:
            raise CheckpointError(
                f"{self.source.path}: {tllm_key!r} needs external tensor(s) {missing}, which the "
                f"checkpoint does not have{self._near_miss_hint(missing[0])}")
        if module is not None and hasattr(module, "load_spec"):
            specs = module.load_spec(param_name, len(external))
        else:
            specs = [ShardSpec()] * len(external)
        weights = [self.load_tensor(k, spec=s) for k, s in zip(external, specs)]
        if preprocess is not None:
            weights = preprocess(weights)
        if module is not None and hasattr(module, "postprocess"):
            return module.postprocess(tllm_key, weights, **kwargs)
        return {tllm_key: weights[0] if len(weights) == 1 else torch.cat(weights)}

    def _near_miss_hint(self, missing: str) -> str:
        stem = missing.rpartition(".")[0].rpartition(".")[0]
        near = sorted(k for k in self._external_keys if k.startswith(stem))[:6]
        return f"; tensors under {stem!r}: {near}" if near else ""

    def generate_weights(self, model: nn.Module, preprocess: Callable | None = None,
                         progress: bool = False, **kwargs) -> dict[str, torch.Tensor]:
        """Load every parameter of ``model`` (shared parameters once), cast to its dtype."""
        return dict(self.iter_weights(model, preprocess, progress, **kwargs))

    def iter_weights(self, model: nn.Module, preprocess: Callable | None = None, progress: bool = False,
                     **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter of ``model`` (shared ones once), cast to its
        dtype, one layer's parameter at a time: a conversion never holds the whole model."""
        self.update_key_mapping(model)
        modules = dict(model.named_modules())
        produced: set[str] = set()
        params = dict(model.named_parameters())
        for name, param in tqdm(params.items(), desc="loading weights", disable=not progress, leave=False):
            if name in produced:
                continue  # already produced by a layer's postprocess
            module = modules[name.rpartition(".")[0]]
            for key, tensor in self.load(name, preprocess, module, config=getattr(model, "config", None),
                                         **kwargs).items():
                expected = params.get(key)
                if expected is not None and tuple(tensor.shape) != tuple(expected.shape):
                    raise CheckpointError(
                        f"{self.source.path}: {key!r} made from {self.translate(key)} has shape "
                        f"{list(tensor.shape)}, expected {list(expected.shape)} for this config")
                # Cast to the dtype of the parameter produced (a postprocess may add others: scales).
                dtype = (expected if expected is not None else param).dtype
                produced.add(key)
                yield key, tensor.to(dtype) if tensor.is_floating_point() else tensor

    @staticmethod
    def fill(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Assign ``weights`` to ``model``'s parameters, strictly: each one exactly once, right shape."""
        fill_parameters(model, weights, source="external checkpoint")


def fill_parameters(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Replace every parameter of ``model`` by the same-named tensor of ``weights``.

    Parameters shared between modules (tied embeddings) appear once in
    ``named_parameters()`` and stay shared. Raises :class:`CheckpointError` naming the
    missing, unexpected or misshapen tensors.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing tensors {preview(missing)}, unexpected tensors {preview(unexpected)}")
    for name, param in params.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {list(tensor.shape)}, "
                                  f"expected {list(param.shape)}")
        if tensor.dtype != param.dtype:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected {param.dtype}")
    # Assign by identity so tied parameters (one Parameter, two modules) stay tied.
    replacement = {id(p): nn.Parameter(weights[n], requires_grad=False) for n, p in params.items()}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in replacement:
                module._parameters[pname] = replacement[id(p)]


def check_file_tensors(model: nn.Module, reader: SafetensorsReader) -> None:
    """The file holds exactly ``model``'s tensors, each of its shape and dtype (a CheckpointError
    naming the file and the tensors that are not)."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(reader.keys())), sorted(set(reader.keys()) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"{reader.path}: missing tensors {preview(missing)}, unexpected tensors "
                              f"{preview(unexpected)}")
    for name, p in params.items():
        dtype, shape = reader.dtype(name), reader.shape(name)
        if tuple(shape) != tuple(p.shape) or dtype != p.dtype:
            raise CheckpointError(f"{reader.path}: tensor {name!r} is {dtype} {list(shape)}, expected "
                                  f"{p.dtype} {list(p.shape)}")
