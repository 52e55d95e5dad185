"""Layer-by-layer calibration while the weights stream in: a calibrated convert that holds one
decoder layer, never the model.

The source's tensors arrive in the model's parameter order (``ModelWeightsLoader.iter_weights``):
the embedding, then each decoder layer's, then the final norm and head. They are taken a stage at
a time (what comes before the first layer, each layer, what comes after): the stage's tensors
are placed into the meta-device model, the calibration prompts' hidden states (all that is kept
between stages) run through it with the inputs of its chosen linears observed, those linears
quantized from what was observed, the stage's tensors handed on and the stage dropped back to the
meta device. The statistics are the float model's (each stage runs with float weights), or with
``quantized_outputs`` each stage's inputs come from the stages before it as quantized (GPTQ).

Every calibrated algorithm (AWQ, GPTQ, SmoothQuant, FP8, W4A16_IMATRIX) runs here, in a streamed
convert and on a model in memory alike (``quantize_in_memory``): one arithmetic for both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch import nn
from tqdm import tqdm

from kiln import host_memory
from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.layers.linear import Linear
from kiln.quantization.calibration import prompt_steps, step_kv_cache
from kiln.quantization.kv_cache import KVRangeObserver
from kiln.quantization.weight_only import use_quantized_layout, use_weight_only_layout


class Observer(Protocol):
    """What watches one linear's inputs during calibration (``InputStats``, a GPTQ Hessian)."""

    def observe(self, x: torch.Tensor) -> None: ...


# (a stage's chosen linears with their float weights placed, their observers) -> each linear's
# checkpoint tensors (names relative to the linear: "weight", "weights_scaling_factor", ...).
QuantizeStage = Callable[[dict[str, nn.Module], dict[str, Observer]], dict[str, dict[str, torch.Tensor]]]
_LAYERS = "transformer.layers."


def per_linear(quantize: Callable[[str, nn.Module, Observer], dict[str, torch.Tensor]]) -> QuantizeStage:
    """A ``QuantizeStage`` quantizing each linear on its own statistics."""
    return lambda linears, observers: {name: quantize(name, linear, observers[name]) for name, linear in linears.items()}


def _stage(key: str, past_layers: bool) -> str:
    """``pre`` (before the layers), a layer's index, or ``post``."""
    if key.startswith(_LAYERS):
        return key[len(_LAYERS):].partition(".")[0]
    return "post" if past_layers else "pre"


@dataclass(frozen=True)
class KVCacheCalibration:
    """Static KV cache scales (``kiln.quantization.kv_cache``) calibrated in the same stream on
    the model the engine runs: after its linears are quantized, each layer runs again as
    ``recorded`` quantizes it, on the outputs of the layers before it run so, its K/V ranges
    observed."""

    algo: str  # INT8 or FP8
    recorded: QuantConfig  # the checkpoint's quantization


class _Placer:
    """Puts streamed tensors into a meta-device model's parameters and takes them all back out."""

    def __init__(self, model: nn.Module):
        self.modules = dict(model.named_modules())

    def place(self, key: str, tensor: torch.Tensor) -> None:
        owner, _, name = key.rpartition(".")
        self.modules[owner]._parameters[name] = nn.Parameter(tensor, requires_grad=False)

    def drop_packed_copies(self) -> None:
        """Forget the copies bf16 matmuls pack of a weight on first use."""
        for module in self.modules.values():
            if isinstance(module, Linear):
                module.drop_packed_copies()

    def drop_all(self) -> None:
        """Every parameter back on the meta device (a quantized linear's new ones too), no packed
        copy left."""
        for module in self.modules.values():
            for name, param in module._parameters.items():
                if param is not None and not param.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                            requires_grad=False)
        self.drop_packed_copies()


class _Calibration:
    """The state of one streamed calibration: the prompts' steps, their hidden states (the float
    model's, and for the KV cache the engine's), the placer, and the one KV cache every layer
    reuses."""

    def __init__(self, model: nn.Module, token_lists: list[list[int]], chosen: list[str],
                 make_observer: Callable[[], Observer] | None, quantize: QuantizeStage, quantized_outputs: bool,
                 kv_cache: KVCacheCalibration | None):
        longest = model.config.max_position_embeddings
        if longest:  # positions beyond the model's would calibrate on activations it never sees
            token_lists = [ids[:longest] for ids in token_lists]
        if not token_lists:
            raise ConfigError("no calibration text of at least 2 tokens (--calib_dataset, --calib_max_len)")
        self.model, self.chosen, self.make_observer, self.quantize = model, set(chosen), make_observer, quantize
        self.quantized_outputs, self.kv = quantized_outputs, kv_cache
        layers = model.transformer.layers
        self.layer_index = {name: i for i, name in enumerate(layers)}
        self.kv_ranges = KVRangeObserver(len(layers)) if kv_cache is not None else None
        self.steps = prompt_steps(token_lists, backend=self.kv_ranges)
        self.caches: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # by (KV heads, head size)
        self.placer = _Placer(model)
        self.hidden: list[torch.Tensor | None] = [None] * len(self.steps)  # the float model's
        self.engine_hidden: list[torch.Tensor | None] = [None] * len(self.steps)  # the quantized model's

    def run(self, stage: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One stage's checkpoint tensors: the stage placed, the prompts run through it with the
        inputs of its chosen linears (those whose weights arrive with it) observed, those linears
        quantized, the stage dropped. The next stage's inputs are the float stage's outputs, or
        with ``quantized_outputs`` those of the stage with each linear's weight as quantized (the
        quantizer puts that in place of the float one)."""
        for key, tensor in tensors.items():
            self.placer.place(key, tensor)
        mine = sorted({key.rpartition(".")[0] for key in tensors} & self.chosen)
        observers = {name: self.make_observer() if self.make_observer else None for name in mine}
        # The float pass: for the statistics, and for the next stage's inputs (none after "post").
        float_pass = self.make_observer is not None and (mine or stage != "post")
        requantized = float_pass and self.quantized_outputs and mine and stage != "post"
        if float_pass:
            self._observe(stage, observers, keep=not requantized)
        self.placer.drop_packed_copies()  # the quantizer's float32 temporaries take their place
        made = self.quantize({name: self.placer.modules[name] for name in mine}, observers) if mine else {}
        if requantized:  # the next stage's inputs from this one as quantized
            self._pass(stage, self.hidden, keep=True)
        out = {}
        for key, tensor in tensors.items():
            owner = key.rpartition(".")[0]
            if owner in made and key == f"{owner}.weight":
                out.update((f"{owner}.{part}", value) for part, value in made[owner].items())
            else:
                out[key] = tensor
        if self.kv is not None and stage != "post":
            out.update(self._kv_ranges(stage, made))
        self.placer.drop_all()
        host_memory.release_free_heap()
        return out

    def _kv_ranges(self, stage: str, made: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The stage run as the engine will (its linears quantized) on the quantized model's
        hidden states; a layer's K/V ranges give its ``kv_cache_scaling_factor``."""
        for name, tensors in made.items():
            use_quantized_layout(name, self.placer.modules[name], self.kv.recorded, tile_order=False, tensors=tensors)
        index = self.layer_index.get(stage)
        self.kv_ranges.layer = index
        try:
            self._pass(stage, self.engine_hidden, keep=True)
        finally:
            self.kv_ranges.layer = None
        if index is None:
            return {}
        return {f"{_LAYERS}{stage}.attention.kv_cache_scaling_factor": self.kv_ranges.scales(self.kv.algo)[index]}

    def _observe(self, stage: str, observers: dict[str, Observer], keep: bool) -> None:
        """A pass through the float stage with the linears' inputs observed (``lm_head``'s: the
        model's output, so no ``[tokens, vocab]`` logits are computed)."""
        modules = self.placer.modules
        handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: observers[name].observe(args[0]))
                   for name in observers if name != "lm_head"]
        try:
            self._pass(stage, self.hidden, keep, observers.get("lm_head"))
        finally:
            for handle in handles:
                handle.remove()

    def _cache(self, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A step cache for layer ``stage``, one per shape (layers may differ in KV heads and head size)."""
        attention = self.model.transformer.layers[stage].attention
        key = (attention.num_kv_heads, attention.head_size)
        if key not in self.caches:
            self.caches[key] = step_kv_cache(self.model, self.steps, stage)
        return self.caches[key]

    def _pass(self, stage: str, hidden: list[torch.Tensor | None], keep: bool, head: Observer | None = None) -> None:
        """Every step through the stage from ``hidden``; ``keep``: its outputs replace them
        (step by step, so one step's states are held twice at most)."""
        model, t = self.model, self.model.transformer
        for i, s in enumerate(self.steps):
            if stage == "pre":
                out = model.first_layer_input(s.input_ids, s.positions, s.metadata.prompts)
                model.prepare_layer_inputs(s.input_ids, out, s.metadata)  # Gemma 4's per-layer inputs
            elif stage == "post":
                out = t.finish(hidden[i])
                if head is not None:
                    head.observe(out)
                continue
            else:
                out = t.layers[stage](hidden[i], s.positions, s.metadata, self._cache(stage))
            if keep:
                hidden[i] = out


@torch.inference_mode()
def stream_calibrated(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], token_lists: list[list[int]],
                      chosen: list[str], make_observer: Callable[[], Observer] | None, quantize: QuantizeStage,
                      progress: bool = False, quantized_outputs: bool = False,
                      kv_cache: KVCacheCalibration | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of the checkpoint: ``weights`` (a meta-device ``model``'s float tensors,
    streamed in parameter order) with each linear in ``chosen`` replaced by what ``quantize``
    makes of it, calibrated on ``token_lists`` (an observer ``make_observer()`` per linear; None:
    ``quantize`` needs no statistics) stage by stage (what comes before the first layer, each
    layer, what comes after). ``quantized_outputs``: each stage's successors are calibrated on
    its quantized outputs (GPTQ's sequential mode). ``kv_cache``: each layer's KV cache scales
    calibrated too."""
    calibration = _Calibration(model, token_lists, chosen, make_observer, quantize, quantized_outputs, kv_cache)
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


def quantize_in_memory(model: nn.Module, recorded: QuantConfig,
                       stream: Callable[[nn.Module, Iterable[tuple[str, torch.Tensor]]],
                                        Iterator[tuple[str, torch.Tensor]]]) -> None:
    """Quantize a float ``model`` (in memory) in place as a streamed convert would: its own
    tensors go through ``stream`` (a ``stream_calibrated`` over a meta-device twin) and what
    comes out fills the quantized layout ``recorded`` describes. One arithmetic for both paths."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    tensors = dict(stream(twin, list(model.named_parameters())))
    use_weight_only_layout(model, recorded, tile_order=False)
    placer, current = _Placer(model), dict(model.named_parameters())
    for key, tensor in tensors.items():
        if current.get(key) is not tensor:
            placer.place(key, tensor)
