"""Convert an external model (Hugging Face directory or GGUF file) into a kiln checkpoint."""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.checkpoint.format import atomic_output_dir, copy_tokenizer_files, rank_file, write_config, write_rank_weights
from kiln.checkpoint.gguf_source import GGUFSource
from kiln.checkpoint.safetensors_io import SafetensorsWriter
from kiln.checkpoint.sources import open_source
from kiln.config import PretrainedConfig, QuantConfig
from kiln.errors import ConfigError
from kiln.mapping import Mapping
from kiln.models import get_model_class
from kiln.models.loading import prepare_hugging_face
from kiln.quantization import SMOOTHQUANT_ALGO, quantize_model, use_weight_only_layout
from kiln.quantization.awq import AWQ_ALGO, AWQ_ALGOS, check_awq_request
from kiln.quantization.calibrated import (CALIBRATED_ALGOS, CalibrationOptions, calibrate_model, quantization_plan,
                                          stream_calibration)
from kiln.quantization.calibration import (DEFAULT_CALIB_LEN, DEFAULT_CALIB_SIZE, calibration_texts,
                                           calibration_token_ids)
from kiln.quantization.gptq import GPTQ_ALGO, gptq_settings
from kiln.quantization.gptq_quantize import check_gptq_request
from kiln.quantization.imatrix import IMATRIX_ALGO, check_imatrix_request
from kiln.quantization.kv_cache import calibrate_kv_cache_scales, set_kv_cache_scales
from kiln.quantization.sequential import KVCacheCalibration
from kiln.quantization.smoothquant import DEFAULT_ALPHA
from kiln.quantization.weight_only import (FP8_ALGO, WEIGHT_ONLY_ALGOS, quantize_weight, untie_lm_head_for,
                                           untie_needed)
from kiln.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def hf_architecture(hf_config: dict, where: str) -> str:
    archs = hf_config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ConfigError(f"{where}: Hugging Face config.json has no 'architectures' list")
    return archs[0]


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, dtype: str | None = None,
                       tp_size: int = 1, pp_size: int = 1, customized_key_dict: dict | None = None,
                       use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                       quantization: QuantConfig | None = None, progress: bool = True,
                       smoothquant_alpha: float | str = DEFAULT_ALPHA, calib_dataset: str = "sharegpt",
                       calib_size: int = DEFAULT_CALIB_SIZE, calib_max_len: int = DEFAULT_CALIB_LEN,
                       gptq_act_order: bool = True, gptq_sequential: bool = True, awq_gptq: bool = False) -> Path:
    """Write ``config.json`` and ``rank{N}.safetensors`` for every rank, plus the tokenizer.

    With ``use_parallel_embedding`` the embedding table is split over the tensor-parallel
    ranks along ``embedding_sharding_dim`` (0: vocabulary, 1: hidden), as reference 001
    describes; otherwise every rank holds it whole. A GGUF file converted with no ``dtype`` and no
    ``quant_algo`` keeps its quantized linears at their own precision (``kiln.quantization.gguf``:
    a ``MIXED_PRECISION`` checkpoint, float parts float32); a ``dtype`` or ``quant_algo`` given
    dequantizes them first. ``quantization`` (a weight-only
    ``quant_algo``: W8A16, W4A16) quantizes the linear layers' weights by round-to-nearest
    (``kiln.quantization``). A GPTQ checkpoint (``quantization_config`` in config.json) is
    imported into the same layout as W4A16_GPTQ (``kiln.quantization.gptq``). ``W4A16_AWQ`` and
    ``W4A8_AWQ`` (``kiln.quantization.awq``; with ``awq_gptq`` W4A16_AWQ's scaled weights rounded
    by GPTQ), ``W4A16_GPTQ`` (``kiln.quantization.gptq_quantize``, in ``gptq_act_order``, with
    ``gptq_sequential`` layer-by-layer calibration), ``FP8`` (``kiln.quantization.fp8``) and
    ``W8A8_SQ_PER_CHANNEL`` (SmoothQuant, ``kiln.quantization.smoothquant``, smoothing with
    ``smoothquant_alpha``, or each group's searched alpha when it is ``"search"``) first run the float model
    on ``calib_size`` texts of ``calib_dataset`` (``sharegpt`` or a file, each cut to
    ``calib_max_len`` tokens), tokenized by the source's tokenizer. A ``kv_cache_quant_algo``
    (INT8 or FP8) records a KV cache of that type with static per-layer K/V scales calibrated on
    the same texts (``kiln.quantization.kv_cache``). The output appears all at once when everything succeeded
    (nothing half-written).
    """
    source = _at_own_precision(open_source(model_dir), dtype, quantization, tp_size)
    hf = source.hf_config()
    if hf is None:
        raise ConfigError(f"{model_dir}: no Hugging Face config.json found next to the weights")
    model_cls = get_model_class(hf_architecture(hf, str(model_dir)), source=str(model_dir))
    gptq = gptq_settings(hf, str(model_dir))
    if gptq is not None and quantization is not None and quantization.quant_algo:
        raise ConfigError(f"{model_dir}: a GPTQ checkpoint is already quantized (imported as W4A16_GPTQ); "
                          f"drop --quant_algo {quantization.quant_algo}")
    algo = quantization.quant_algo if quantization is not None else None
    if awq_gptq and algo != AWQ_ALGO:
        raise ConfigError(f"--awq_gptq goes with --quant_algo {AWQ_ALGO}, not {algo}")
    kv_algo = quantization.kv_cache_quant_algo if quantization is not None else None
    if kv_algo is not None and tp_size * pp_size != 1:
        # Calibration runs the whole float model; kiln runs single-rank engines anyway.
        raise ConfigError(f"--kv_cache_quant_algo {kv_algo}: converts a single-rank checkpoint (tp_size = "
                          f"pp_size = 1), got tp_size={tp_size} pp_size={pp_size}")
    world = Mapping(world_size=tp_size * pp_size, tp_size=tp_size, pp_size=pp_size)
    calibrated = _checked_calibration(quantization, world.world_size, str(model_dir))
    calibration = None  # token ids, tokenized once for every calibrated step
    if calibrated or kv_algo is not None:
        calibration = _calibration_tokens(source, Path(model_dir), calib_dataset, calib_size, calib_max_len,
                                          quantization.quant_algo if calibrated else f"KV cache {kv_algo}")
    overrides = {"use_parallel_embedding": use_parallel_embedding, "embedding_sharding_dim": embedding_sharding_dim}
    options = CalibrationOptions(smoothquant_alpha, gptq_act_order, gptq_sequential, awq_gptq)
    # A GPTQ import fills its own layout: in memory. Everything else streams, calibration (of
    # linears and of KV cache scales) layer by layer.
    streamable = gptq is None
    with atomic_output_dir(output_dir) as tmp:
        config = None
        for rank in tqdm(range(world.world_size), desc="converting ranks", disable=not progress or world.world_size == 1):
            if streamable:
                config = stream_rank(source, model_cls, tmp, rank, dtype, world.with_rank(rank), customized_key_dict,
                                     overrides, quantization, progress, calibration, options)
                if config is not None:
                    continue
            model = model_cls.from_hugging_face(source, dtype, world.with_rank(rank), customized_key_dict,
                                                progress=progress, config_overrides=overrides)
            if quantization is not None and quantization.quant_algo is not None:
                model.config = _quantize(model, quantization, str(model_dir), calibration, options, progress)
            if kv_algo is not None:  # calibrated on the model the engine runs (weights quantized already)
                _calibrate_kv_cache(model, kv_algo, calibration, calib_dataset, progress)
            write_rank_weights(tmp, rank, model.checkpoint_weights())
            config = model.config
            del model
        # A dtype the user chose carries through: engines built with dtype "auto" keep it.
        chosen = {"keep_dtype": True} if dtype not in (None, "auto") else {}
        write_config(tmp, {**config.to_dict(), **chosen})
        _save_tokenizer(source, Path(model_dir), tmp)
    return Path(output_dir)


def _at_own_precision(source, dtype: str | None, quantization: QuantConfig | None, tp_size: int):
    """``source``, or for a GGUF file converted with no dtype and no quant_algo, the same file
    read as raw blocks: its quantized linears keep their own precision (kiln.quantization.gguf).
    A dtype or quant_algo given dequantizes them first, as for any float source."""
    if not isinstance(source, GGUFSource) or dtype not in (None, "auto") or (
            quantization is not None and quantization.quant_algo is not None):
        return source
    if tp_size > 1:  # the imported blocks are read whole, as GPTQ tensors are
        logger.warning("%s: tp_size %d: converting the GGUF file dequantized (its own precision needs "
                       "tp_size 1)", source.path, tp_size)
        return source
    return GGUFSource(source.path, blocks=True)


def _checked_calibration(quantization: QuantConfig | None, world_size: int, where: str) -> bool:
    """Whether ``quantization`` calibrates (AWQ, GPTQ, SmoothQuant, FP8), after checking it can."""
    algo = quantization.quant_algo if quantization is not None else None
    if algo in AWQ_ALGOS:
        check_awq_request(quantization, world_size, where)
    elif algo == GPTQ_ALGO:
        check_gptq_request(quantization, world_size, where)
    elif algo == IMATRIX_ALGO:
        check_imatrix_request(quantization, world_size, where)
    elif algo in (SMOOTHQUANT_ALGO, FP8_ALGO) and world_size != 1:
        raise ConfigError(f"--quant_algo {algo} calibrates the whole model in one process: use --tp_size 1 --pp_size 1")
    return algo in CALIBRATED_ALGOS


def stream_rank(source, model_cls: type, out: Path, rank: int, dtype: str | None, mapping: Mapping,
                customized_key_dict: dict | None, overrides: dict, quantization: QuantConfig | None,
                progress: bool, calibration: list[list[int]] | None = None,
                options: CalibrationOptions = CalibrationOptions()) -> PretrainedConfig | None:
    """Write rank ``rank``'s checkpoint file one tensor at a time (read, cast, round to nearest
    where ``quantization`` asks, write), never holding the model: the file is laid out first
    from a model of the final config on the meta device (what ``from_checkpoint`` reads back).
    Calibrated algorithms and KV cache scales calibrate on the token lists ``calibration`` layer
    by layer as the layers stream past (``kiln.quantization.calibrated``). Returns the rank's
    config, or None (nothing written) when a quantized lm_head shares the embedding table, which
    the in-memory path unties first."""
    model, loader = prepare_hugging_face(model_cls, source, dtype, mapping, customized_key_dict, overrides)
    quant = quantization if quantization is not None and quantization.quant_algo is not None else None
    kv_algo = quantization.kv_cache_quant_algo if quantization is not None else None
    calibrating = quant is not None and quant.quant_algo in CALIBRATED_ALGOS
    names, recorded = [], quantization
    if quant is not None:
        if untie_needed(model, quant):
            return None
        names, recorded = quantization_plan(model, quant)
    config = dataclasses.replace(model.config, quantization=recorded) if recorded is not None else model.config
    with torch.device("meta"):
        layout = model_cls(config)
        use_weight_only_layout(layout, config.quantization, tile_order=False)
    entries = {name: (p.dtype, tuple(p.shape)) for name, p in layout.named_parameters()}
    weights = loader.iter_weights(model, progress=progress and not (calibrating or kv_algo))  # else a bar per layer
    if calibrating or kv_algo is not None:
        kv = KVCacheCalibration(kv_algo, recorded) if kv_algo is not None else None
        tensors = stream_calibration(model, weights, calibration or [], quantization, names, options, progress, kv)
    else:
        tensors = _rounded_to_nearest(weights, {f"{name}.weight": f"{name}." for name in names}, quant)
    with SafetensorsWriter(rank_file(out, rank), entries, metadata={"format": "pt"}) as writer:
        for key, tensor in tensors:
            writer.write(key, tensor)
    return config


def _rounded_to_nearest(weights, rounded: dict[str, str], quant: QuantConfig | None):
    """``weights`` with each weight of ``rounded`` (name -> its parameters' prefix) replaced by
    its round-to-nearest tensors."""
    bits = WEIGHT_ONLY_ALGOS.get(quant.quant_algo) if quant is not None else None
    for key, tensor in weights:
        if key not in rounded:
            yield key, tensor
            continue
        for name, part in quantize_weight(tensor.float(), bits, quant.group_size, quant.has_zero_point).items():
            yield rounded[key] + name, part


def _calibration_tokens(source, model_dir: Path, dataset: str, size: int, max_len: int,
                        algo: str) -> list[list[int]]:
    """The calibration prompts' token ids, through the model's own tokenizer (a GGUF's is saved
    to a temporary directory first)."""
    texts = calibration_texts(dataset, size)
    with tempfile.TemporaryDirectory(prefix="kiln-calib-tokenizer-") as tmp:
        try:
            if getattr(source, "save_tokenizer", None) is not None:
                source.save_tokenizer(Path(tmp))
                tokenizer = load_tokenizer(tmp)
            else:
                tokenizer = load_tokenizer(model_dir if model_dir.is_dir() else model_dir.parent)
        except ConfigError as e:
            raise ConfigError(f"{algo} calibration needs the source model's tokenizer: {e}") from None
        return calibration_token_ids(tokenizer, texts, max_len)


def _quantize(model, quantization: QuantConfig, where: str, calibration: list[list[int]] | None = None,
              options: CalibrationOptions = CalibrationOptions(), progress: bool = False):
    """Quantize ``model`` in place (calibrated algorithms on the token lists ``calibration``);
    its config records what was quantized (see ``quantize_model``)."""
    if quantization.quant_algo in CALIBRATED_ALGOS:
        recorded = calibrate_model(model, quantization, calibration or [], options, progress)
    else:
        untie_lm_head_for(model, quantization)  # a quantized head gets its own copy of a tied table
        recorded = quantize_model(model, quantization)
    if recorded is None:
        raise ConfigError(f"{where}: --quant_algo {quantization.quant_algo} found no linear layer to quantize")
    return dataclasses.replace(model.config, quantization=recorded)


def _calibrate_kv_cache(model, algo: str, token_lists: list[list[int]], dataset: str, progress: bool) -> None:
    """Give ``model`` its KV cache scales for ``algo`` (INT8, FP8) and record ``algo`` in its
    quantization config."""
    if not token_lists:
        raise ConfigError(f"--calib_dataset {dataset}: no text of at least 2 tokens to calibrate the KV cache on")
    set_kv_cache_scales(model, calibrate_kv_cache_scales(model, token_lists, algo, progress))
    model.config = dataclasses.replace(model.config, quantization=dataclasses.replace(
        model.config.quantization, kv_cache_quant_algo=algo))


def _save_tokenizer(source, model_dir: Path, out: Path) -> None:
    save = getattr(source, "save_tokenizer", None)
    if save is not None:  # GGUF carries its tokenizer inside the file
        save(out)
        return
    src = model_dir if model_dir.is_dir() else model_dir.parent
    if not copy_tokenizer_files(src, out):
        logger.warning("%s: no tokenizer files found; pass --tokenizer_dir when running", src)
