"""Hugging Face PEFT LoRA adapters -> reference 004's ``weights`` / ``config`` tensors.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``) with ``...layers.{i}.{...}.{target}.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` per adapted linear. Each becomes one row: the target's module id
(``PEFT_TARGETS``), its layer, its rank, ``A`` and ``B`` times PEFT's scaling (``lora_alpha /
r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` and ``alpha_pattern`` per
module), so that ``B @ A`` is exactly the delta PEFT adds to the weight.

A DoRA adapter (``use_dora``) also holds ``lora_magnitude_vector`` ``[out]`` per linear. PEFT
divides it by the row norms of ``W + B A`` at every call; the reference format carries it
already divided (reference 004: "normalized"), which needs the base weights ``W``:
``normalize_dora`` / ``kiln lora normalize-dora --base_model``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from kiln.checkpoint.format import atomic_output_dir
from kiln.checkpoint.gguf_hybrid import untiled_delta_net_weight
from kiln.checkpoint.lora import LORA_MODULE_IDS, LoraModule, pack_lora_tensors
from kiln.checkpoint.sources import open_source
from kiln.errors import CheckpointError

# PEFT target module names (LLaMA-style, and fused ones) -> reference module names. As in the
# reference's own converter, mlp_h_to_4h is gate_proj (the activated branch: kiln's and the
# reference's `fc`) and mlp_gate is up_proj, whatever the names suggest.
PEFT_TARGETS = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "qkv_proj": "attn_qkv", "query_key_value": "attn_qkv",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h", "gate_up_proj": "mlp_gate_up",
    "w1": "mlp_h_to_4h", "w3": "mlp_gate", "w2": "mlp_4h_to_h",  # LFM2's feed-forward
    "input_linear": "mlp_gate_up", "output_linear": "mlp_4h_to_h",  # Granite's shared MLP
    # recurrent mixers: short convolution and Mamba2, Gated DeltaNet (Qwen3.5; Qwen3-Next's fused)
    "in_proj": "mixer_in", "out_proj": "mixer_out",
    "in_proj_qkv": "linear_attn_qkv", "in_proj_z": "linear_attn_z", "in_proj_b": "linear_attn_b",
    "in_proj_a": "linear_attn_a", "in_proj_qkvz": "linear_attn_qkvz", "in_proj_ba": "linear_attn_ba",
}
# Names that mean another module inside some blocks: (block, name) -> reference module name.
_IN_BLOCK = {("self_attn", "out_proj"): "attn_dense", ("attn", "out_proj"): "attn_dense",  # LFM2, OPT, GPT-J
             ("mixer", "up_proj"): "mlp_h_to_4h"}  # Nemotron-H's plain MLP block: up_proj is the activated one
WEIGHTS_FILE, CONFIG_FILE = "model.lora_weights.npy", "model.lora_config.npy"
STORAGE_TYPES = {"float16": torch.float16, "float32": torch.float32}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?([A-Za-z_]\w*)\."
                  r"(?:lora_(?P<side>[AB])(?:\.[\w-]+)?\.weight|lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?)$")


def _read_adapter(adapter_dir: Path, check_type: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if check_type and config.get("peft_type", "LORA") != "LORA":
        hint = " (prompt-tuning tables: kiln lora convert-prompt)" if config.get("peft_type") == "PROMPT_TUNING" else ""
        raise CheckpointError(f"{config_file}: peft_type {config.get('peft_type')!r}; kiln converts LORA adapters{hint}")
    safetensors_file, bin_file = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            return config, load_file(str(safetensors_file))
        if bin_file.is_file():
            return config, torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which
        raise CheckpointError(f"{adapter_dir}: cannot read the adapter weights ({e})") from None
    raise CheckpointError(f"{adapter_dir}: no adapter_model.safetensors or adapter_model.bin")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's per-module override: the first pattern matching the end of ``key``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def peft_prompt_table(adapter_dir: str | Path) -> torch.Tensor:
    """The virtual-token table ``[num_virtual_tokens, hidden]`` of a PEFT prompt-tuning adapter
    (its ``prompt_embeddings``), float32."""
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        peft_type = json.loads(config_file.read_text()).get("peft_type")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if peft_type != "PROMPT_TUNING":
        raise CheckpointError(f"{config_file}: peft_type {peft_type!r}; a prompt-tuning table comes from a "
                              "PROMPT_TUNING adapter")
    _, tensors = _read_adapter(adapter_dir, check_type=False)
    table = tensors.get("prompt_embeddings")
    if table is None or table.dim() != 2:
        raise CheckpointError(f"{adapter_dir}: no 2-D prompt_embeddings tensor in the adapter weights")
    return table.float()


def load_prompt_table(path: str | Path) -> torch.Tensor:
    """A prompt-tuning table from a PEFT prompt-tuning adapter directory or a ``.npy`` file
    (``kiln lora convert-prompt`` writes one)."""
    path = Path(path)
    if path.is_dir():
        return peft_prompt_table(path)
    try:
        return torch.from_numpy(np.load(path, allow_pickle=False))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read a prompt table ({e})") from None


def peft_to_lora_modules(adapter_dir: str | Path, base_model: str | Path | None = None) -> list[LoraModule]:
    """The rows of a PEFT LoRA adapter, scaled as PEFT applies them, ordered by layer then
    module id. A DoRA adapter needs ``base_model`` (the model it was trained on: a Hugging Face
    directory or GGUF file) to normalize its magnitudes; a plain one ignores it."""
    adapter_dir = Path(adapter_dir)
    config, tensors = _read_adapter(adapter_dir)
    dora = bool(config.get("use_dora"))
    if dora and base_model is None:
        raise CheckpointError(f"{adapter_dir}: a DoRA adapter: its magnitudes must be normalized against the base "
                              f"weights first (kiln lora normalize-dora -i {adapter_dir} --base_model MODEL -o OUT)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise CheckpointError(f"{adapter_dir}: bias {config.get('bias')!r} / lora_bias: the LoRA format has no "
                              "bias terms")
    if config.get("modules_to_save"):
        raise CheckpointError(f"{adapter_dir}: modules_to_save {config['modules_to_save']} are whole weights, "
                              "which the LoRA format cannot carry")
    if config.get("fan_in_fan_out"):
        raise CheckpointError(f"{adapter_dir}: fan_in_fan_out adapters (Conv1D targets) are not converted")
    parts: dict[tuple[int, str], dict] = {}  # (layer, the adapted module's key) -> its tensors
    for key, tensor in tensors.items():
        found = _KEY.search(key)
        if found is None:
            raise CheckpointError(f"{adapter_dir}: tensor {key!r} is not a per-layer lora_A/lora_B weight "
                                  f"(targets kiln converts: {sorted(PEFT_TARGETS)})")
        layer, target = int(found.group(1)), found.group(2)
        if target not in PEFT_TARGETS:
            raise CheckpointError(f"{adapter_dir}: tensor {key!r} adapts {target!r}; kiln converts "
                                  f"{sorted(PEFT_TARGETS)}")
        module_key = key[:found.start(2)] + target
        if ".experts." in module_key:  # one row per (module, layer) has no room for an expert's own
            raise CheckpointError(f"{adapter_dir}: tensor {key!r} adapts an expert; kiln applies no adapters "
                                  "to mixture-of-experts blocks")
        module_id = LORA_MODULE_IDS[_IN_BLOCK.get((module_key.split(".")[-2], target), PEFT_TARGETS[target])]
        parts.setdefault((layer, module_key), {"key": module_key, "id": module_id})[found.group("side") or "M"] = tensor
    source = open_source(base_model) if dora else None
    base_config = (source.hf_config() or {}) if dora else {}  # (read once: a GGUF's is built from its metadata)
    modules = []
    for (layer, module_key), part in parts.items():
        target = module_key.rpartition(".")[2]
        for side, what in (("A", "lora_A"), ("B", "lora_B")) + ((("M", "lora_magnitude_vector"),) if dora else ()):
            if side not in part:
                raise CheckpointError(f"{adapter_dir}: layer {layer} {target} has no {what}")
        a, b = part["A"].float(), part["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{adapter_dir}: layer {layer} {target}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} do not make a rank-r pair ([r, in] and [out, r])")
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern"), part["key"], config.get("lora_alpha", 8))
        b = b * (alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)
        magnitude = None
        if dora:
            magnitude = part["M"].float().reshape(-1)
            if magnitude.numel() != b.shape[0]:
                raise CheckpointError(f"{adapter_dir}: layer {layer} {target}: lora_magnitude_vector has "
                                      f"{magnitude.numel()} values for {b.shape[0]} outputs")
            magnitude = magnitude / _dora_row_norms(source, base_config, part["key"], a, b)
        modules.append(LoraModule(part["id"], layer, a, b, magnitude))
    if not modules:
        raise CheckpointError(f"{adapter_dir}: the adapter has no LoRA weights")
    return sorted(modules, key=lambda m: (m.layer, m.module_id))


def _dora_row_norms(source, config: dict, module_key: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The row norms of ``W + B A`` (``B`` scaled) for the base linear PEFT's ``module_key``
    (``base_model.model.model.layers.3.self_attn.q_proj``) adapts, as PEFT's DoRA takes them;
    ``config``: the base model's (a GGUF's tiled Gated DeltaNet weights are read back in the
    adapter's order)."""
    inner = module_key.split(".layers.", 1)[-1] if ".layers." in module_key else module_key
    suffix = f"layers.{inner}.weight"
    keys = [k for k in source.keys() if k == suffix or k.endswith("." + suffix)]
    if len(keys) != 1:
        raise CheckpointError(f"{source.path}: {'no' if not keys else 'more than one'} base weight named like "
                              f"{suffix!r} for the DoRA module {module_key}{': ' + ', '.join(keys) if keys else ''}")
    weight = untiled_delta_net_weight(keys[0], source.read(keys[0]).float(), config)
    if weight.shape != (b.shape[0], a.shape[1]):
        raise CheckpointError(f"{source.path}: base weight {keys[0]} is {list(weight.shape)}, but the adapter's "
                              f"{module_key} is [{b.shape[0]}, {a.shape[1]}] (another model?)")
    return torch.linalg.vector_norm(weight + b @ a, dim=1)


def convert_peft_adapter(adapter_dir: str | Path, output_dir: str | Path, storage_type: str = "float16",
                         base_model: str | Path | None = None) -> Path:
    """Write ``model.lora_weights.npy`` and ``model.lora_config.npy`` (int32) for a PEFT LoRA
    adapter into ``output_dir`` (atomically: nothing is left on an error). A DoRA adapter is
    normalized against ``base_model`` (see ``peft_to_lora_modules``) and gets ``is_dora`` rows."""
    if storage_type not in STORAGE_TYPES:
        raise CheckpointError(f"--storage-type {storage_type!r}: choose one of {sorted(STORAGE_TYPES)}")
    modules = peft_to_lora_modules(adapter_dir, base_model)
    weights, config = pack_lora_tensors(modules, STORAGE_TYPES[storage_type])
    with atomic_output_dir(output_dir) as tmp:
        np.save(tmp / WEIGHTS_FILE, weights.numpy())
        np.save(tmp / CONFIG_FILE, config.numpy())
    return Path(output_dir)


def load_lora_dir(directory: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, config)`` as ``kiln lora convert`` writes them."""
    directory = Path(directory)
    out = []
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        try:
            out.append(np.load(directory / name, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{directory / name}: cannot read ({e})") from None
    return out[0], out[1]


def read_adapter(directory: str | Path) -> tuple:
    """``(weights, config)`` of a LoRA adapter directory: a Hugging Face PEFT adapter
    (converted in memory) or what ``kiln lora convert`` wrote."""
    directory = Path(directory)
    try:
        if (directory / "adapter_config.json").is_file():
            return pack_lora_tensors(peft_to_lora_modules(directory))
        if not (directory / WEIGHTS_FILE).is_file():
            raise CheckpointError(f"{directory}: not a LoRA adapter (no adapter_config.json of a PEFT adapter, "
                                  f"no {WEIGHTS_FILE} from kiln lora convert)")
        return load_lora_dir(directory)
    except OSError as e:  # a name too long, no permission, a directory where a file should be...
        raise CheckpointError(f"{str(directory)[:200]}: cannot read the adapter: {e.strerror or e}") from None
