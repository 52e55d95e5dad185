"""Layer-by-layer calibration while the weights stream in: a calibrated convert that holds one
decoder layer, never the model.

The source's tensors arrive in the model's parameter order (``ModelWeightsLoader.iter_weights``):
the embedding, then each decoder layer's, then the final norm and head. The tensors before the
first layer are placed into the meta-device model and the calibration prompts embedded (their
hidden states are all that is kept between layers). Each layer's tensors are then placed, the
prompts' hidden states run through it with its quantized linears' inputs observed, its linears
quantized from those statistics, its tensors handed on, and the layer dropped back to the meta
device. The statistics are the float model's (each layer runs with float weights), as a whole
model run in memory (``collect_linear_inputs``) gives them, step for step the same arithmetic.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.quantization.calibration import InputStats, prompt_steps

# (linear name, the linear with its float weight placed, its input statistics) -> its checkpoint
# tensors (names relative to the linear: "weight", "weights_scaling_factor", ...).
QuantizeLinear = Callable[[str, nn.Module, InputStats], dict[str, torch.Tensor]]
_LAYERS = "transformer.layers."
# Tokens a calibration step runs at once: half the in-memory default, as one layer's activations
# are most of what a streamed convert holds.
STEP_TOKENS = 2048


def _stage(key: str, past_layers: bool) -> str:
    """``pre`` (before the layers), a layer's index, or ``post``."""
    if key.startswith(_LAYERS):
        return key[len(_LAYERS):].partition(".")[0]
    return "post" if past_layers else "pre"


class _Placer:
    """Puts streamed tensors into a meta-device model's parameters and takes them back out."""

    def __init__(self, model: nn.Module):
        self.modules = dict(model.named_modules())

    def place(self, key: str, tensor: torch.Tensor) -> None:
        owner, _, name = key.rpartition(".")
        self.modules[owner]._parameters[name] = nn.Parameter(tensor, requires_grad=False)

    def drop(self, key: str) -> None:
        owner, _, name = key.rpartition(".")
        param = self.modules[owner]._parameters[name]
        self.modules[owner]._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                             requires_grad=False)


@torch.inference_mode()
def stream_calibrated(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                      chosen: list[str], make_stats: Callable[[], InputStats], quantize: QuantizeLinear,
                      progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of the checkpoint: ``weights`` (a meta-device ``model``'s float tensors,
    streamed in parameter order) with each linear in ``chosen`` replaced by what ``quantize`` makes
    of it, calibrated on ``token_lists`` (statistics ``make_stats()`` per linear)."""
    if not token_lists:
        raise ConfigError("layer-by-layer calibration: no calibration text of at least 2 tokens")
    t = model.transformer
    steps = prompt_steps(token_lists, max_step_tokens=STEP_TOKENS)
    attention = next(iter(t.layers.values())).attention
    shape = (max(s.num_blocks for s in steps), steps[0].metadata.block_size, attention.num_kv_heads,
             attention.head_size)
    dtype = torch_dtype(model.config.dtype)
    cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))  # reused by every layer
    placer = _Placer(model)
    modules = dict(model.named_modules())
    hidden: list[torch.Tensor] | None = None
    pre: dict[str, torch.Tensor] = {}  # the tensors before the first layer, until the prompts are embedded
    bar = tqdm(total=len(t.layers), desc="calibrating layers", unit="layer", disable=not progress, leave=False)

    def finish(stage: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal hidden
        if stage == "pre":
            pre.update(tensors)
            return iter(tensors.items())
        if hidden is None:  # the first layer: embed the prompts, then drop the embedding
            for key, tensor in pre.items():
                placer.place(key, tensor)
            hidden = [model.first_layer_input(s.input_ids, s.positions, s.metadata.prompts) for s in steps]
            for key in pre:
                placer.drop(key)
            pre.clear()
        for key, tensor in tensors.items():
            placer.place(key, tensor)
        prefix = "" if stage == "post" else f"{_LAYERS}{stage}."
        mine = [name for name in chosen if name.startswith(prefix) and (stage != "post" or not name.startswith(_LAYERS))]
        stats = {name: make_stats() for name in mine}
        handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: stats[name].observe(args[0]))
                   for name in mine if name != "lm_head"]
        try:
            if stage == "post":
                if "lm_head" in stats:
                    for h in hidden:
                        stats["lm_head"].observe(t.finish(h))
            else:
                layer = t.layers[stage]
                hidden = [layer(h, s.positions, s.metadata, cache) for h, s in zip(hidden, steps)]
                bar.update()
        finally:
            for handle in handles:
                handle.remove()
        out = {}
        for key, tensor in tensors.items():
            owner = key.rpartition(".")[0]
            if owner in stats and key.endswith(".weight"):
                for part, value in quantize(owner, modules[owner], stats[owner]).items():
                    out[f"{owner}.{part}"] = value
            else:
                out[key] = tensor
        for key in tensors:
            placer.drop(key)
        for module in (t.layers[stage] if stage != "post" else model).modules():
            if isinstance(module, Linear):
                module.drop_packed_copies()  # bf16 matmuls pack a copy of each weight on first use
        return iter(out.items())

    stage, pending, past_layers = None, {}, False
    try:
        for key, tensor in weights:
            now = _stage(key, past_layers)
            past_layers = past_layers or now not in ("pre", "post")
            if stage is not None and now != stage:
                yield from finish(stage, pending)
                pending = {}
            stage = now
            pending[key] = tensor
        if stage is not None:
            yield from finish(stage, pending)
    finally:
        bar.close()
