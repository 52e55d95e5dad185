"""DecoderModelForCausalLM: the decoder-only transformer every model family declares.

Module tree (its parameter names are the checkpoint names of reference 002)::

    transformer.vocab_embedding            (first pipeline stage)
    transformer.project_in                 (embeddings narrower than the layers only: OPT-350m)
    transformer.ln_embed                   (a LayerNorm on the embeddings: BLOOM)
    transformer.position_embedding         (learned absolute positions only)
    transformer.layers.{i}.input_layernorm / attention.{qkv,dense} / post_layernorm / mlp.*
    transformer.ln_f, project_out, lm_head (last pipeline stage; ln_f unless final_norm is false)

A family subclass sets a few class attributes (norm, gated MLP, key map) and translates
its Hugging Face config; all loading, saving and sharding is shared.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from kiln.checkpoint.format import read_config
from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.embedding import PromptStep
from kiln.layers.linear import ColumnLinear
from kiln.layers.mlp import MLP, GatedMLP
from kiln.layers.normalization import RmsNorm
from kiln.models import loading
from kiln.models.decoder import DecoderLayer, Transformer, layer_field, positive_field
from kiln.models.hybrid import attention_modules
from kiln.models.lora_targets import assign_lora_targets
from kiln.models.native_decode import native_decode_for
from kiln.models.registry import get_model_class


class DecoderModelForCausalLM(nn.Module):
    """A decoder-only causal LM in kiln's layout. Subclasses declare a family."""

    # -- what a family declares ---------------------------------------------------------
    gated_mlp: ClassVar[bool] = True
    source_transposed: ClassVar[bool] = False  # external linear weights stored (in, out)
    hf_key_map: ClassVar[dict] = {}  # customized key dict for the weights loader
    norm_class: ClassVar[type[nn.Module]] = RmsNorm  # the layer norms' class (LayerNorm, GemmaRmsNorm...)
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer  # a family with another layer shape overrides it
    sublayer_norms: ClassVar[str] = "pre"  # the layers' norms when the config does not say (DecoderLayer)

    @classmethod
    def make_norm(cls, config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
        return cls.norm_class(config.hidden_size, config.norm_epsilon, dtype=dtype)

    @classmethod
    def key_map_for(cls, external_keys: set[str]) -> dict:
        """The key map for a checkpoint holding ``external_keys`` (a family whose checkpoints
        come in several layouts picks one here)."""
        return cls.hf_key_map

    @classmethod
    def config_for_keys(cls, config: PretrainedConfig, external_keys: set[str]) -> PretrainedConfig:
        """``config`` adjusted to the tensors a checkpoint holds (a family whose checkpoints may
        carry optional parts, such as Qwen3.5's multi-token-prediction layer, says so here)."""
        return config

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, engine_layout: bool) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (a family with experts overrides this)."""
        tp = config.mapping
        shard = dict(dtype=torch_dtype(config.dtype), tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        inter = layer_field(config, layer_idx, "intermediate_size") or 4 * config.hidden_size
        bias = config.get("mlp_bias", False)
        if cls.gated_mlp:
            return GatedMLP(config.hidden_size, inter, config.hidden_act, bias, fused=engine_layout, **shard)
        return MLP(config.hidden_size, inter, config.hidden_act, bias, source_transposed=cls.source_transposed,
                   **shard)

    @classmethod
    def config_from_hf(cls, hf_config: dict, dtype: str, mapping) -> PretrainedConfig:
        raise ConfigError(f"{cls.__name__} has no Hugging Face config translation")

    # -- the module ------------------------------------------------------------------------
    def __init__(self, config: PretrainedConfig, engine_layout: bool = False):
        super().__init__()
        self.config = config
        self.engine_layout = engine_layout
        mapping = config.mapping
        self.transformer = Transformer(type(self), config, engine_layout)
        attentions = attention_modules(self.transformer.layers.values())
        if config.quantization.kv_cache_quant_algo is not None:  # static K/V scales per layer
            for attention in attentions:
                attention.use_kv_cache_scales()
        if config.get("qkv_per_head"):  # the source's fused qkv rows come per head or KV group (GPT-NeoX, BLOOM)
            for attention in attentions:
                attention.qkv.interleaved_heads = True
        self.final_logit_softcap = positive_field(config, "final_logit_softcapping")  # Gemma 2
        self.logits_scaling = positive_field(config, "logits_scaling")  # Granite: logits divided by it
        self.vocab_size_padded = math.ceil(config.vocab_size / mapping.tp_size) * mapping.tp_size
        if mapping.is_last_pp_rank:
            self.lm_head = ColumnLinear(config.get("embedding_dim") or config.hidden_size, self.vocab_size_padded,
                                        bias=bool(config.get("lm_head_bias", False)),
                                        dtype=torch_dtype(config.dtype), tp_size=mapping.tp_size,
                                        tp_rank=mapping.tp_rank, gather_output=True)
            if self.shares_embedding_table:
                self.lm_head.weight = self.transformer.vocab_embedding.weight

    @property
    def shares_embedding_table(self) -> bool:
        """lm_head reuses the embedding table (only when both hold the same rows)."""
        m, c = self.config.mapping, self.config
        if not c.share_embedding_table or m.pp_size > 1:
            return False
        return m.tp_size == 1 or (c.use_parallel_embedding and c.embedding_sharding_dim == 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata,
                kv_caches: list, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run one packed step. ``input_ids``/``positions``: ``[num_tokens]``; returns hidden states.

        On a pipeline stage (``config.mapping``) after the first, ``hidden`` is the previous
        stage's output, taken instead of embedding ``input_ids``; a stage before the last
        returns its last layer's output, for the next stage."""
        t = self.transformer
        if hidden is None:
            hidden = self.first_layer_input(input_ids, positions, metadata.prompts)
            self.prepare_layer_inputs(input_ids, hidden, metadata)
        native = native_decode_for(self, kv_caches, metadata)
        if native is not None:  # a decode step: every layer in one native call (one rank only)
            return t.finish(native(hidden, positions, metadata))
        for cache, layer in zip(kv_caches, t.layers.values()):
            hidden = layer(hidden, positions, metadata, cache)
        return t.finish(hidden) if self.config.mapping.is_last_pp_rank else hidden

    def assign_lora_targets(self) -> None:
        """Mark every linear with the LoRA modules it holds (kiln.models.lora_targets)."""
        assign_lora_targets(self.transformer.layers)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata,
                      kv_caches: list) -> torch.Tensor | None:
        """float32 logits ``[num_tokens, vocab_size]`` of every token of a decode step, when the
        native decode step runs the whole of it (layers, final norm and LM head in one call:
        what ``compute_logits(forward(...))`` gives, bit for bit); else None, and nothing ran."""
        native = native_decode_for(self, kv_caches, metadata)
        if native is None or not native.computes_logits(metadata.num_tokens):
            return None
        return native(self.first_layer_input(input_ids, positions, metadata.prompts), positions, metadata, logits=True)

    def first_layer_input(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          prompts: PromptStep | None = None) -> torch.Tensor:
        """The first decoder layer's input ``[num_tokens, hidden]``: the token embeddings, scaled,
        normalised and position-embedded as the family does (layer-by-layer calibration starts here);
        virtual tokens from the step's prompt-tuning tables (``prompts``)."""
        t = self.transformer
        hidden = t.embed(input_ids, prompts)
        multiplier = self.config.get("embedding_multiplier")
        if multiplier:  # Gemma: rounded to the model dtype first, as Hugging Face does
            hidden = hidden * torch.tensor(multiplier, dtype=hidden.dtype)
        if hasattr(t, "ln_embed"):
            hidden = t.ln_embed(hidden)
        if hasattr(t, "position_embedding"):
            hidden = hidden + t.position_embedding(positions)
        return hidden

    def prepare_layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor, metadata) -> None:
        """Give the step (``metadata.layer_inputs``) the per-layer inputs its layers read, where the
        model has them (Gemma 4's per-layer embeddings), from the token ids and the first layer's
        input ``hidden``; a caller running the layers one by one calls it after ``first_layer_input``."""
        t = self.transformer
        if getattr(t, "per_layer_input_size", None):
            metadata.layer_inputs = t.layer_inputs(input_ids, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab_size]`` for the given final hidden states ``[n, hidden]``
        (soft-capped, ``cap * tanh(logits / cap)``, when the config sets ``final_logit_softcapping``;
        divided by ``logits_scaling`` where set)."""
        logits = self.lm_head(hidden)[..., : self.config.vocab_size].float()
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcap is not None:
            logits = self.final_logit_softcap * torch.tanh(logits / self.final_logit_softcap)
        return logits

    # -- construction from weights (kiln/models/loading.py) -----------------------------------

    @classmethod
    def from_hugging_face(cls, source, dtype: str | None = None, mapping=None,
                          customized_key_dict: dict | None = None, progress: bool = False,
                          config_overrides: dict | None = None) -> "DecoderModelForCausalLM":
        """Build this rank's model (``mapping.rank``) from a Hugging Face directory or GGUF file
        (``loading.load_hugging_face``)."""
        return loading.load_hugging_face(cls, source, dtype, mapping, customized_key_dict, progress, config_overrides)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, rank: int = 0,
                        engine_layout: bool = False) -> "DecoderModelForCausalLM":
        """Load rank ``rank`` of a kiln checkpoint (or, with ``engine_layout``, an engine)."""
        config = read_config(checkpoint_dir, rank)
        model_cls = cls if cls is not DecoderModelForCausalLM else get_model_class(config.architecture)
        return loading.load_checkpoint(model_cls, config, checkpoint_dir, rank, engine_layout)

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """This rank's tensors by checkpoint name (a shared table appears once)."""
        return {name: p.data for name, p in self.named_parameters()}

    def save_checkpoint(self, checkpoint_dir: str | Path) -> None:
        """Write a single-rank model as a checkpoint, atomically (``loading.save_checkpoint``)."""
        loading.save_checkpoint(self, checkpoint_dir)
