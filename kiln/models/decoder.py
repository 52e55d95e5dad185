"""The shared decoder: per-layer attention settings from the config (windows, soft-caps,
layer types), ``DecoderLayer`` and the ``Transformer`` stack that
:class:`kiln.models.base.DecoderModelForCausalLM` holds as ``transformer``."""
from __future__ import annotations

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.attention import Attention
from kiln.layers.embedding import Embedding, PromptStep, PromptTuningEmbedding
from kiln.layers.linear import Linear
from kiln.layers.normalization import LayerNorm, RmsNorm
from kiln.layers.rotary import RotaryEmbedding


LAYER_TYPES = ("full_attention", "sliding_attention")


def positive_field(config: PretrainedConfig, name: str) -> float | None:
    """Config field ``name``: None, or a positive number (else a ConfigError naming it)."""
    value = config.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConfigError(f"config field {name!r} must be a positive number or null, got {value!r}")
    return value


def layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s sliding attention window in tokens (None: full attention).

    ``sliding_window`` sets the window; ``layer_types`` (one of ``LAYER_TYPES`` per layer, as
    transformers 5 writes it) says which layers use it; without it, every layer does.
    """
    window = positive_field(config, "sliding_window")
    if window is not None and int(window) != window:
        raise ConfigError(f"config field 'sliding_window' must be a whole number of tokens, got {window!r}")
    types = config.get("layer_types")
    if types is not None:
        if layer_type(config, layer_idx) == "full_attention":
            return None
        if window is None:
            raise ConfigError(f"config field 'layer_types' marks layer {layer_idx} sliding_attention but "
                              "'sliding_window' is not set")
    return None if window is None else int(window)


def layer_type(config: PretrainedConfig, layer_idx: int) -> str:
    """Layer ``layer_idx``'s entry of ``layer_types`` (``full_attention`` where the config has none)."""
    types = config.get("layer_types")
    if types is None:
        return "full_attention"
    if not isinstance(types, list) or len(types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"config field 'layer_types' must list one of {LAYER_TYPES} for each of the "
                          f"{config.num_hidden_layers} layers, got {types!r}")
    return types[layer_idx]


def layer_rotaries(config: PretrainedConfig) -> list[RotaryEmbedding | None] | None:
    """Each layer's rotary embedding (None: positions are not rotary), followed by the shared
    default one (the last entry); None for models without rotary positions.

    ``rotary_base`` / ``rotary_scaling`` / ``rotary_pct`` (or ``rotary_dim``) set the default;
    ``layer_rotary`` (``{layer type: {field: value}}``) overrides them for the layers of one
    ``layer_types`` kind (Gemma 3's local base on sliding layers, OLMo 3's scaling on full ones);
    ``nope_layers`` lists layers that apply no rotary at all (SmolLM3, EXAONE 4's global layers).
    Layers with the same settings share one module (their cos/sin are computed once a step).
    """
    if config.position_embedding_type not in ("rope_gpt_neox", "rope"):
        return None
    overrides = config.get("layer_rotary") or {}
    if not isinstance(overrides, dict) or any(k not in LAYER_TYPES or not isinstance(v, dict)
                                                for k, v in overrides.items()):
        raise ConfigError(f"config field 'layer_rotary' must map layer types {LAYER_TYPES} to settings, "
                          f"got {overrides!r}")
    nope = set(config.get("nope_layers") or ())
    if any(not isinstance(i, int) or not 0 <= i < config.num_hidden_layers for i in nope):
        raise ConfigError(f"config field 'nope_layers' must list layer indices below {config.num_hidden_layers}, "
                          f"got {sorted(nope, key=str)!r}")
    shared: dict[str, RotaryEmbedding] = {}

    def rotary_of(settings: dict) -> RotaryEmbedding:
        # rotary_dim (GPT-J) exactly, or a fraction of the head (rotary_pct)
        dim = settings.get("rotary_dim") or int(config.head_size * settings.get("rotary_pct", 1.0))
        key = repr((dim, settings.get("rotary_base", 10000.0), settings.get("rotary_scaling")))
        if key not in shared:
            shared[key] = RotaryEmbedding(dim, settings.get("rotary_base", 10000.0), config.max_position_embeddings,
                                          settings.get("rotary_scaling"))
        return shared[key]

    fields = ("rotary_dim", "rotary_pct", "rotary_base", "rotary_scaling")
    default = {name: config.get(name) for name in fields if config.get(name) is not None}
    layers = [None if i in nope else rotary_of({**default, **overrides.get(layer_type(config, i), {})})
              for i in range(config.num_hidden_layers)]
    return [*layers, rotary_of(default)]


def attention_settings(config: PretrainedConfig, layer_idx: int) -> dict:
    """The per-layer attention keywords the config asks for: scale (``attention_multiplier``
    itself, or ``query_pre_attn_scalar ** -0.5``), sliding window, attention logit soft-cap
    (``attn_logit_softcapping``), ALiBi, attention sinks (``attention_sinks``)."""
    scalar, multiplier = positive_field(config, "query_pre_attn_scalar"), positive_field(config, "attention_multiplier")
    scale = float(multiplier) if multiplier is not None else None if scalar is None else float(scalar) ** -0.5
    return dict(scale=scale, window=layer_window(config, layer_idx), sinks=bool(config.get("attention_sinks", False)),
                softcap=positive_field(config, "attn_logit_softcapping"), alibi=config.position_embedding_type == "alibi")


SUBLAYER_NORMS = ("pre", "pre_and_post", "post")


class DecoderLayer(nn.Module):
    """One decoder layer. Its shape comes from checkpoint config fields:

    * default: pre-norm, sequential — ``h += attn(ln1(h)); h += mlp(ln2(h))`` (LLaMA, GPT-2);
    * ``parallel_residual``: attention and MLP both read the layer's input —
      ``h + attn(ln1(h)) + mlp(ln2(h))`` (GPT-NeoX, Falcon-40B's ``ln_attn``/``ln_mlp``);
    * ``parallel_residual`` + ``shared_layernorm``: one norm feeds both —
      ``h + attn(ln1(h)) + mlp(ln1(h))``, no ``post_layernorm`` (GPT-J, Phi-2, Falcon-7B);
    * ``norm_after_residual``: post-norm — ``h = ln1(h + attn(h)); h = ln2(h + mlp(h))`` (OPT-350m);
    * ``sublayer_norms`` ``pre_and_post``: each block's output normalised too, before its residual
      add — ``h += post(attn(ln1(h))); h += post_ff(mlp(pre_ff(h)))`` (Gemma 2/3, GLM-4);
      ``post``: only those output norms — ``h += post(attn(h)); h += post_ff(mlp(h))`` (OLMo 2/3,
      EXAONE 4). ``post_layernorm`` is then the attention output's norm, not the MLP input's;
    * ``residual_multiplier``: each block's output scaled before its residual add (Granite).
    """

    native_decode_shape = True  # kiln.models.native_decode computes exactly this class (not subclasses)

    def __init__(self, model_cls: type, config: PretrainedConfig, layer_idx: int,
                 rotary: RotaryEmbedding | None, engine_layout: bool):
        super().__init__()
        dtype, tp = torch_dtype(config.dtype), config.mapping
        shard = dict(dtype=dtype, tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        self.parallel_residual = bool(config.get("parallel_residual", False))
        self.norm_after_residual = bool(config.get("norm_after_residual", False))
        self.sublayer_norms = config.get("sublayer_norms", model_cls.sublayer_norms)
        self.residual_multiplier = positive_field(config, "residual_multiplier")
        shared_norm = bool(config.get("shared_layernorm", False))
        if self.sublayer_norms not in SUBLAYER_NORMS:
            raise ConfigError(f"config field 'sublayer_norms' must be one of {SUBLAYER_NORMS}, "
                              f"got {self.sublayer_norms!r}")
        if shared_norm and not self.parallel_residual:
            raise ConfigError("shared_layernorm (one norm for attention and MLP) needs parallel_residual")
        if self.norm_after_residual and self.parallel_residual:
            raise ConfigError("norm_after_residual (post-norm) cannot be combined with parallel_residual")
        if self.sublayer_norms != "pre" and (self.parallel_residual or self.norm_after_residual):
            raise ConfigError(f"sublayer_norms {self.sublayer_norms!r} needs sequential pre-norm layers "
                              "(no parallel_residual, no norm_after_residual)")
        self.input_layernorm = None if self.sublayer_norms == "post" else model_cls.make_norm(config, dtype)
        qk_norm_class = model_cls.norm_class if issubclass(model_cls.norm_class, RmsNorm) else RmsNorm
        self.attention = Attention(
            layer_idx, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_size, qkv_bias=config.get("attn_bias", False),
            dense_bias=config.get("dense_bias", config.get("attn_bias", False)), rotary=rotary,
            source_transposed=model_cls.source_transposed,
            qk_norm_eps=config.norm_epsilon if config.get("qk_norm", False) else None,
            qk_layernorm=bool(config.get("qk_layernorm", False)), qk_norm_class=qk_norm_class,
            qk_norm_whole=bool(config.get("qk_norm_whole", False)), **attention_settings(config, layer_idx), **shard)
        self.post_layernorm = None if shared_norm else model_cls.make_norm(config, dtype)
        if self.sublayer_norms != "pre":
            self.pre_feedforward_layernorm = (model_cls.make_norm(config, dtype)
                                              if self.sublayer_norms == "pre_and_post" else None)
            self.post_feedforward_layernorm = model_cls.make_norm(config, dtype)
        self.mlp = model_cls.make_mlp(config, layer_idx, engine_layout)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        if self.norm_after_residual:  # OPT-350m: each norm is applied to the residual sum
            hidden = self.input_layernorm(hidden + self.attention(hidden, positions, metadata, kv_cache))
            return self.post_layernorm(hidden + self.mlp(hidden, metadata.lora))
        normed = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        attended = self.attention(normed, positions, metadata, kv_cache)
        if self.parallel_residual:  # attention and MLP both read the layer's input
            mlp_in = normed if self.post_layernorm is None else self.post_layernorm(hidden)
            return hidden + attended + self.mlp(mlp_in, metadata.lora)
        if self.sublayer_norms == "pre":
            hidden = hidden + self._scaled(attended)
            return hidden + self._scaled(self.mlp(self.post_layernorm(hidden), metadata.lora))
        hidden = hidden + self._scaled(self.post_layernorm(attended))
        mlp_in = hidden if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(hidden)
        return hidden + self._scaled(self.post_feedforward_layernorm(self.mlp(mlp_in, metadata.lora)))

    def _scaled(self, block_output: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier
        return block_output if m is None else block_output * m


class Transformer(nn.Module):
    def __init__(self, model_cls: type, config: PretrainedConfig, engine_layout: bool):
        super().__init__()
        mapping, dtype = config.mapping, torch_dtype(config.dtype)
        self.layer_ids = list(mapping.pp_layers(config.num_hidden_layers))
        # OPT-350m: token embeddings narrower than the layers, projected in and out (replicated).
        embedding_dim = config.get("embedding_dim") or config.hidden_size
        projected = embedding_dim != config.hidden_size
        if mapping.is_first_pp_rank:
            parallel = config.use_parallel_embedding
            if projected:
                self.project_in = Linear(embedding_dim, config.hidden_size, bias=False, dtype=dtype)
            self.vocab_embedding = PromptTuningEmbedding(
                config.vocab_size, embedding_dim, dtype=dtype,
                tp_size=mapping.tp_size if parallel else 1, tp_rank=mapping.tp_rank if parallel else 0,
                sharding_dim=config.embedding_sharding_dim)
            if config.get("embedding_layernorm", False):  # BLOOM: normalise the embeddings first
                self.ln_embed = LayerNorm(config.hidden_size, config.norm_epsilon, dtype=dtype)
            if config.position_embedding_type == "learned_absolute":
                if not config.max_position_embeddings:
                    raise ConfigError("learned_absolute positions need max_position_embeddings")
                self.position_embedding = Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        if config.position_embedding_type not in ("learned_absolute", "alibi", "rope_gpt_neox", "rope"):
            raise ConfigError(
                f"position_embedding_type {config.position_embedding_type!r} is not one of "
                "['learned_absolute', 'rope_gpt_neox', 'alibi']")
        rotaries = layer_rotaries(config)
        # The rotary most layers share (the native decode step takes models whose layers all use it).
        self.rotary = rotaries[-1] if rotaries else None
        # Keyed by the global layer index, so a pipeline stage's names match the checkpoint's.
        self.layers = nn.ModuleDict({
            str(i): model_cls.decoder_layer(model_cls, config, i, rotaries[i] if rotaries else None, engine_layout)
            for i in self.layer_ids})
        if mapping.is_last_pp_rank:
            if config.get("final_norm", True):  # OPT-350m (post-norm layers) has none
                self.ln_f = model_cls.make_norm(config, dtype)
            if projected:
                self.project_out = Linear(config.hidden_size, embedding_dim, bias=False, dtype=dtype)

    def embed(self, input_ids: torch.Tensor, prompts: PromptStep | None = None) -> torch.Tensor:
        """Token embeddings at the layers' width (through ``project_in`` where narrower); virtual
        tokens from the step's prompt-tuning tables (``prompts``)."""
        if prompts is None:
            hidden = self.vocab_embedding(input_ids)
        else:
            hidden = self.vocab_embedding(input_ids, prompts.table, prompts.tasks, prompts.task_vocab_size)
        return self.project_in(hidden) if hasattr(self, "project_in") else hidden

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output to the lm_head's input: ``ln_f`` and ``project_out``, where present."""
        if hasattr(self, "ln_f"):
            hidden = self.ln_f(hidden)
        return self.project_out(hidden) if hasattr(self, "project_out") else hidden
