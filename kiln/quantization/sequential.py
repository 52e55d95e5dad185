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

from kiln import host_memory
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


class _Calibration:
    """The state of one streamed calibration: the prompts' steps and hidden states, the placer,
    and the one KV cache every layer reuses."""

    def __init__(self, model: nn.Module, token_lists: list[list[int]], chosen: list[str],
                 make_stats: Callable[[], InputStats], quantize: QuantizeLinear):
        if not token_lists:
            raise ConfigError("layer-by-layer calibration: no calibration text of at least 2 tokens")
        self.model, self.chosen, self.make_stats, self.quantize = model, chosen, make_stats, quantize
        self.steps = prompt_steps(token_lists, max_step_tokens=STEP_TOKENS)
        attention = next(iter(model.transformer.layers.values())).attention
        shape = (max(s.num_blocks for s in self.steps), self.steps[0].metadata.block_size, attention.num_kv_heads,
                 attention.head_size)
        dtype = torch_dtype(model.config.dtype)
        self.cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        self.placer = _Placer(model)
        self.hidden: list[torch.Tensor] | None = None
        self.pre: dict[str, torch.Tensor] = {}  # tensors before the first layer, until the prompts are embedded

    def embed(self) -> None:
        """The prompts' first-layer inputs, from the tensors before the layers (then dropped)."""
        for key, tensor in self.pre.items():
            self.placer.place(key, tensor)
        self.hidden = [self.model.first_layer_input(s.input_ids, s.positions, s.metadata.prompts) for s in self.steps]
        for key in self.pre:
            self.placer.drop(key)
        self.pre.clear()

    def run(self, stage: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One stage's checkpoint tensors: the stage placed, the prompts run through it with its
        chosen linears' inputs observed, those linears quantized, the stage dropped."""
        if stage == "pre":
            self.pre.update(tensors)
            return tensors
        if self.hidden is None:
            self.embed()
        for key, tensor in tensors.items():
            self.placer.place(key, tensor)
        stats = self._observe(stage)
        out = {}
        for key, tensor in tensors.items():
            owner = key.rpartition(".")[0]
            if owner in stats and key.endswith(".weight"):
                for part, value in self.quantize(owner, self.placer.modules[owner], stats[owner]).items():
                    out[f"{owner}.{part}"] = value
            else:
                out[key] = tensor
        for key in tensors:
            self.placer.drop(key)
        t = self.model.transformer
        for module in (t.layers[stage] if stage != "post" else self.model).modules():
            if isinstance(module, Linear):
                module.drop_packed_copies()  # bf16 matmuls pack a copy of each weight on first use
        host_memory.release_free_heap()
        return out

    def _observe(self, stage: str) -> dict[str, InputStats]:
        """Statistics of the stage's chosen linears' inputs; a layer's outputs become the next input."""
        t, modules = self.model.transformer, self.placer.modules
        prefix = "" if stage == "post" else f"{_LAYERS}{stage}."
        mine = [n for n in self.chosen if n.startswith(prefix) and (stage != "post" or not n.startswith(_LAYERS))]
        stats = {name: self.make_stats() for name in mine}
        handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: stats[name].observe(args[0]))
                   for name in mine if name != "lm_head"]
        try:
            if stage == "post":
                for h in self.hidden if "lm_head" in stats else ():
                    stats["lm_head"].observe(t.finish(h))
            else:
                layer = t.layers[stage]
                for i, s in enumerate(self.steps):  # in place: one step's states at a time held twice
                    self.hidden[i] = layer(self.hidden[i], s.positions, s.metadata, self.cache)
        finally:
            for handle in handles:
                handle.remove()
        return stats


@torch.inference_mode()
def stream_calibrated(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                      chosen: list[str], make_stats: Callable[[], InputStats], quantize: QuantizeLinear,
                      progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of the checkpoint: ``weights`` (a meta-device ``model``'s float tensors,
    streamed in parameter order) with each linear in ``chosen`` replaced by what ``quantize`` makes
    of it, calibrated on ``token_lists`` (statistics ``make_stats()`` per linear)."""
    calibration = _Calibration(model, token_lists, chosen, make_stats, quantize)
    stage, pending, past_layers = None, {}, False
    with tqdm(total=len(model.transformer.layers), desc="calibrating layers", unit="layer", disable=not progress,
              leave=False) as bar:
        for key, tensor in weights:
            now = _stage(key, past_layers)
            past_layers = past_layers or now not in ("pre", "post")
            if stage is not None and now != stage:
                yield from calibration.run(stage, pending).items()
                bar.update(stage not in ("pre", "post"))
                pending = {}
            stage = now
            pending[key] = tensor
        if stage is not None:
            yield from calibration.run(stage, pending).items()
