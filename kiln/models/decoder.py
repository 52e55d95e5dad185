"""The shared decoder: per-layer attention settings from the config (windows, soft-caps,
layer types), ``DecoderLayer`` and the ``Transformer`` stack that
:class:`kiln.models.base.DecoderModelForCausalLM` holds as ``transformer``."""
from __future__ import annotations

import torch
from torch import nn

from kiln.config import PretrainedConfig
from kiln.dtypes import torch_dtype
from kiln.errors import ConfigError
from kiln.layers.activation import get_activation
from kiln.layers.attention import Attention
from kiln.layers.embedding import Embedding, PromptStep, PromptTuningEmbedding
from kiln.layers.linear import Linear
from kiln.layers.normalization import LayerNorm, RmsNorm
from kiln.layers.rotary import RotaryEmbedding


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Layers keeping a recurrent state instead of K/V (hybrid models; kiln.models.hybrid).
RECURRENT_LAYER_TYPES = ("conv", "linear_attention", "mamba")
# Layers with a feed-forward block only (an MLP or experts): no K/V and no state (Nemotron-H's;
# kiln.models.nemotron_h).
FEED_FORWARD_LAYER_TYPES = ("mlp", "moe")
LAYER_TYPES = ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES + FEED_FORWARD_LAYER_TYPES


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
        if layer_type(config, layer_idx) != "sliding_attention":  # full attention, or a recurrent layer
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


# The config fields one layer may set apart from the rest (``layer_overrides``).
LAYER_OVERRIDES = ("head_size", "num_key_value_heads", "intermediate_size", "value_from_key", "kv_source")


def layer_field(config: PretrainedConfig, layer_idx: int, name: str):
    """Layer ``layer_idx``'s value of config field ``name``: its entry in ``layer_overrides``
    (a list of one dict per layer, each holding some of ``LAYER_OVERRIDES``: Gemma 4's full
    layers have wider heads and fewer KV heads), else the config's own field.

    ``value_from_key``: the layer's values are its key projection (before the key norm and
    rotary; Gemma 4's ``attention_k_eq_v``); ``kv_source``: an earlier layer whose keys and
    values (and KV cache) this layer reads instead of projecting its own (Gemma 4's
    ``num_kv_shared_layers``).
    """
    overrides = config.get("layer_overrides")
    if overrides is None:
        return config.get(name)
    if (not isinstance(overrides, list) or len(overrides) != config.num_hidden_layers
            or any(not isinstance(o, dict) or set(o) - set(LAYER_OVERRIDES) for o in overrides)):
        raise ConfigError(f"config field 'layer_overrides' must list, for each of the {config.num_hidden_layers} "
                          f"layers, a dict of some of {LAYER_OVERRIDES}; got {overrides!r}")
    layer = overrides[layer_idx]
    return layer[name] if name in layer else config.get(name)


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

    def rotary_of(settings: dict, head_size: int) -> RotaryEmbedding:
        # rotary_dim (GPT-J) exactly, or a fraction of the (layer's) head (rotary_pct)
        dim = settings.get("rotary_dim") or int(head_size * settings.get("rotary_pct", 1.0))
        key = repr((dim, settings.get("rotary_base", 10000.0), settings.get("rotary_scaling")))
        if key not in shared:
            shared[key] = RotaryEmbedding(dim, settings.get("rotary_base", 10000.0), config.max_position_embeddings,
                                          settings.get("rotary_scaling"))
        return shared[key]

    fields = ("rotary_dim", "rotary_pct", "rotary_base", "rotary_scaling")
    default = {name: config.get(name) for name in fields if config.get(name) is not None}
    layers = [None if i in nope else rotary_of({**default, **overrides.get(layer_type(config, i), {})},
                                                 layer_field(config, i, "head_size"))
              for i in range(config.num_hidden_layers)]
    return [*layers, rotary_of(default, config.head_size)]


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
        kv_source = layer_field(config, layer_idx, "kv_source")
        if kv_source is not None and not (isinstance(kv_source, int) and 0 <= kv_source < layer_idx):
            raise ConfigError(f"config field 'layer_overrides' gives layer {layer_idx} kv_source {kv_source!r}; "
                              "it must be an earlier layer's index")
        self.attention = Attention(
            layer_idx, config.hidden_size, config.num_attention_heads,
            layer_field(config, layer_idx, "num_key_value_heads"),
            layer_field(config, layer_idx, "head_size"), qkv_bias=config.get("attn_bias", False),
            dense_bias=config.get("dense_bias", config.get("attn_bias", False)), rotary=rotary,
            source_transposed=model_cls.source_transposed,
            qk_norm_eps=config.norm_epsilon if config.get("qk_norm", False) else None,
            qk_layernorm=bool(config.get("qk_layernorm", False)), qk_norm_class=qk_norm_class,
            qk_norm_whole=bool(config.get("qk_norm_whole", False)), v_norm=bool(config.get("v_norm", False)),
            value_from_key=bool(layer_field(config, layer_idx, "value_from_key")), kv_source=kv_source,
            output_gate=bool(config.get("attn_output_gate", False)),
            **attention_settings(config, layer_idx), **shard)
        self.post_layernorm = None if shared_norm else model_cls.make_norm(config, dtype)
        if self.sublayer_norms != "pre":
            self.pre_feedforward_layernorm = (model_cls.make_norm(config, dtype)
                                              if self.sublayer_norms == "pre_and_post" else None)
            self.post_feedforward_layernorm = model_cls.make_norm(config, dtype)
        self.mlp = model_cls.make_mlp(config, layer_idx, engine_layout)
        # Gemma 4's per-layer input (``per_layer_input_size``): after the MLP block, the layer adds
        # norm(proj(act(gate(h)) * its slice of the step's per-layer inputs)) (replicated over ranks).
        self.per_layer_input_size = config.get("per_layer_input_size")
        if self.per_layer_input_size:
            size = self.per_layer_input_size
            self.per_layer_input_gate = Linear(config.hidden_size, size, bias=False, dtype=dtype)
            self.per_layer_projection = Linear(size, config.hidden_size, bias=False, dtype=dtype)
            self.post_per_layer_input_norm = model_cls.make_norm(config, dtype)
            self.per_layer_act = get_activation(config.hidden_act)
        # Gemma 4: the layer's output times a learned scalar (``layer_scalar``, residual included).
        self.layer_scalar = (nn.Parameter(torch.empty(1, dtype=dtype), requires_grad=False)
                             if config.get("layer_scalar", False) else None)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        hidden = self._blocks(hidden, positions, metadata, kv_cache)
        if self.per_layer_input_size:
            if metadata.layer_inputs is None:
                raise RuntimeError("this model's layers take per-layer inputs; the step has none "
                                   "(DecoderModelForCausalLM.prepare_layer_inputs)")
            index = self.attention.layer_idx
            gated = self.per_layer_act(self.per_layer_input_gate(hidden)) * metadata.layer_inputs[:, index]
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden if self.layer_scalar is None else hidden * self.layer_scalar

    def _blocks(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, kv_cache) -> torch.Tensor:
        """The attention and MLP blocks with their norms and residual adds (see the class docstring)."""
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
        # Gemma 4's per-layer inputs (PLE), made once a step before the first layer (first stage only).
        self.per_layer_input_size = config.get("per_layer_input_size")
        if self.per_layer_input_size:
            if mapping.pp_size > 1:
                raise ConfigError("per-layer inputs (config field 'per_layer_input_size') are made before the "
                                  "first layer and read by every layer: pipeline parallelism is not supported")
            size, layers = self.per_layer_input_size, config.num_hidden_layers
            self.embed_tokens_per_layer = Embedding(config.get("per_layer_vocab_size") or config.vocab_size,
                                                    layers * size, dtype=dtype)
            self.per_layer_model_projection = Linear(config.hidden_size, layers * size, bias=False, dtype=dtype)
            self.per_layer_projection_norm = model_cls.norm_class(size, config.norm_epsilon, dtype=dtype)
        rotaries = layer_rotaries(config)
        # The rotary most layers share (the native decode step takes models whose layers all use it).
        self.rotary = rotaries[-1] if rotaries else None
        # Keyed by the global layer index, so a pipeline stage's names match the checkpoint's.
        self.layers = nn.ModuleDict({
            str(i): model_cls.decoder_layer(model_cls, config, i, rotaries[i] if rotaries else None, engine_layout)
            for i in self.layer_ids})
        for layer in self.layers.values():  # the layers whose K/V later layers read keep them each step
            source = getattr(getattr(layer, "attention", None), "kv_source", None)
            if source is not None:
                if config.quantization.kv_cache_quant_algo is not None:
                    # The reading layer writes its source's K/V again, with its own scales.
                    raise ConfigError("a quantized KV cache (kv_cache_quant_algo) is not supported with layers that "
                                      "read another layer's KV cache (Gemma 4's num_kv_shared_layers)")
                if str(source) not in self.layers:
                    raise ConfigError(f"layer {layer.attention.layer_idx} reads layer {source}'s KV cache "
                                      "(kv_source), which is on another pipeline stage")
                producer = self.layers[str(source)].attention
                if getattr(producer, "kv_source", None) is not None:
                    raise ConfigError(f"layer {layer.attention.layer_idx}'s kv_source {source} reads another "
                                      "layer's KV itself")
                if layer.attention.window != producer.window:
                    raise ConfigError(f"layer {layer.attention.layer_idx} reads layer {source}'s KV cache "
                                      "(kv_source) but has another sliding window")
                producer.kv_consumed = True
        if mapping.is_last_pp_rank:
            if config.get("final_norm", True):  # OPT-350m (post-norm layers) has none
                self.ln_f = model_cls.make_norm(config, dtype)
            if projected:
                self.project_out = Linear(config.hidden_size, embedding_dim, bias=False, dtype=dtype)

    def layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs ``[tokens, layers, size]`` from the token ids and the first
        layer's input ``embeds``: (norm(projection(embeds) / sqrt(hidden)) + the tokens' per-layer
        embeddings * sqrt(size)) / sqrt(2), each rounded to the model dtype as transformers does."""
        size, tokens = self.per_layer_input_size, input_ids.shape[0]
        table = self.embed_tokens_per_layer.weight
        own = self.embed_tokens_per_layer(input_ids) * torch.tensor(size ** 0.5, dtype=table.dtype)
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(-1, size)).view(tokens, -1, size)
        return (projected + own.view(tokens, -1, size)) * 2.0 ** -0.5

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
