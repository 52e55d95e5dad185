"""Batch-1 decode through one native call for LLaMA-shaped models.

Decoding layer by layer from Python costs ~15 Python calls per layer; on a small model that
is as much as the arithmetic of a few tokens. ``NativeDecodeStep`` hands every layer to
``kiln.kernels.decode_step``, which runs the same kernels in the same order (so the result
is the same, bit for bit). It applies to a model only when every layer is exactly the
shape that kernel computes: an RMSNorm of its own before attention and before the MLP
(sequential, pre-norm: not OPT's post-norm nor a parallel layer), a fused qkv projection
with rotate-half rotary (or none) and per-head q/k RMSNorms (Qwen3) or none, plain causal
attention or a sliding window (no soft-capping, no ALiBi), a fused SiLU-gated MLP or, in bf16
engines, a mixture of experts with weight-only quantized experts and an un-gated shared expert
or none (Qwen3-MoE, Mixtral, DeepSeek-V2: the router, routing and experts call of
kiln.layers.moe); or DeepSeek-V2's latent attention in its absorbed form (one latent cache row a
token); one rank, fp32 or bf16 weights
(or, in bf16 engines, weight-only int8/4-bit codes with AWQ's input multiply, FP8,
W4A8_AWQ and SmoothQuant W8A8), a KV cache of the model dtype or a quantized one
(INT8, FP8: the step writes the codes with the layer's scales, as the attention backend does,
and reads them through the matching kernel);
any other model (Gemma 2, BLOOM...), the PyTorch attention backend, steps with a
prompt chunk and steps of more tokens than its matmuls are best at
(``NativeDecodeStep.max_tokens``) take the layer-by-layer path. Where the final norm is an
RMSNorm and the LM head a linear the step takes (no soft-capping), the same call goes on to
the logits (``DecoderModelForCausalLM.decode_logits``): a batch-1 step is then one native
call between the token embedding and the argmax. A step under LoRA adapters
(``AttentionMetadata.lora``) hands the step's adapters to the same call: each adapter's
modules are gathered once (``B`` transposed, each over its own output columns) and each token
names its adapter.
"""
from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn.functional as F

from kiln import kernels
from kiln.layers.attention import Attention
from kiln.layers.lora import LoraStep
from kiln.layers.mla import MultiHeadLatentAttention
from kiln.layers.mlp import GatedMLP
from kiln.layers.moe import MixtureOfExperts
from kiln.layers.normalization import RmsNorm

UNLIMITED = 1 << 62
# A quantized linear's parameters the native step reads as codes or float32 scales.
QUANTIZED_PARAMETERS = ("weight", "weights_scaling_factor", "weights_offset", "prequant_scaling_factor",
                        "activation_scaling_factor")


def supports_native_decode(model) -> bool:
    """Whether ``model``'s layers are all of the shape ``decode_step`` computes."""
    t = model.transformer
    dtype = t.vocab_embedding.weight.dtype if hasattr(t, "vocab_embedding") else None
    if (dtype not in (torch.float32, torch.bfloat16) or model.config.mapping.world_size != 1
            or hasattr(t, "position_embedding") or kernels.native_library() is None):
        return False
    # The shared decoder layer (and DeepSeek-V2's) declares itself fit (a family's own layer
    # class, a subclass, computes something else and does not inherit the declaration).
    if not all(type(layer).__dict__.get("native_decode_shape", False) for layer in t.layers.values()):
        return False
    first = next(iter(t.layers.values())).attention
    scale, qk_eps = first.scale, _qk_norm_eps(first)
    if qk_eps is None:
        return False
    for layer in t.layers.values():
        attn, mlp = layer.attention, layer.mlp
        experts = _experts_supported(mlp, dtype)
        if not (type(layer.input_layernorm) is RmsNorm
                and type(layer.post_layernorm) is RmsNorm
                and (experts or (type(mlp) is GatedMLP and mlp.fused and mlp.act is F.silu))
                and attn.rotary is t.rotary and attn.scale == scale
                and (_latent_supported(attn) if type(attn) is MultiHeadLatentAttention
                     else _attention_supported(layer, qk_eps))):
            return False
        if any(p.device.type != "cpu" or not p.is_contiguous() for p in layer.parameters()):
            return False
        modules = [module for module in attn.modules() if module is not getattr(attn, "sinks", None)]  # (float32)
        modules += [layer.input_layernorm, layer.post_layernorm, *([] if experts else mlp.modules())]
        if not all(_module_supported(module, dtype) for module in modules):
            return False
        if layer.input_layernorm.eps != layer.post_layernorm.eps:
            return False
    return True


def _attention_supported(layer, qk_eps: float) -> bool:
    """Whether the step computes ``layer``'s (ordinary) attention and residual shape: q/k norms
    like the first layer's, pre-norm and sequential, no soft-capping or ALiBi (each layer's
    sliding window and attention sinks are passed on)."""
    attn = layer.attention
    return (type(attn) is Attention and _qk_norm_eps(attn) == qk_eps
            and (attn.sinks is None or attn.sinks.weight.dtype == torch.float32)
            and not layer.parallel_residual and not layer.norm_after_residual and layer.sublayer_norms == "pre"
            and layer.residual_multiplier is None and getattr(layer, "layer_scalar", None) is None
            and not getattr(layer, "per_layer_input_size", None) and attn.kv_source is None
            and attn.v_norm_eps is None and attn.softcap is None and attn.alibi_slopes is None)


def _latent_supported(attn: MultiHeadLatentAttention) -> bool:
    """Whether the step computes latent attention ``attn``: an engine's absorbed layout, one
    epsilon for its norms."""
    norms = [attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora_rank else [])
    return attn.kv_b_proj.engine_layout and len({norm.eps for norm in norms}) == 1 and all(
        type(norm) is RmsNorm for norm in norms)


def _qk_norm_eps(attn: Attention) -> float | None:
    """The epsilon of ``attn``'s per-head q/k RMSNorms (0.0 without q/k norms; None: norms the
    step does not compute, such as OLMo 2's over the whole projection)."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # (any attention class)
    if q_norm is None and k_norm is None:
        return 0.0
    if (type(q_norm) is not RmsNorm or type(k_norm) is not RmsNorm or attn.qk_norm_whole or q_norm.eps != k_norm.eps):
        return None
    return q_norm.eps


def _experts_supported(mlp, dtype: torch.dtype) -> bool:
    """Whether the step's experts block computes ``mlp``: a bf16 model's mixture of experts
    (one rank) routed by the plain softmax top-k (times a factor: ``routing_scale``), whose
    experts and shared expert (un-gated) the native experts call reads and whose router is a
    contiguous bf16 weight."""
    if not isinstance(mlp, MixtureOfExperts) or dtype != torch.bfloat16 or mlp.tp_size != 1:
        return False
    if mlp.routing_scale() is None or (mlp.shared_expert is not None and (
            mlp.shared_expert_gate is not None or mlp.native_shared() is None)):
        return False
    router = mlp.router
    return (router.weight.dtype == dtype and router.weight.is_contiguous()
            and (router.bias is None or (router.bias.dtype == dtype and router.bias.is_contiguous()))
            and mlp.native_experts() is not None)


def supports_native_head(model) -> bool:
    """Whether ``decode_step`` can go on to ``model``'s logits: a final RMSNorm, no projection
    after it, no soft-capping, and an LM head of a kind the step's linears take."""
    t = model.transformer
    head = getattr(model, "lm_head", None)
    if (head is None or type(getattr(t, "ln_f", None)) is not RmsNorm or hasattr(t, "project_out")
            or model.final_logit_softcap is not None or model.logits_scaling is not None):
        return False
    dtype = t.vocab_embedding.weight.dtype
    return (all(p.device.type == "cpu" and p.is_contiguous() for p in (*head.parameters(), t.ln_f.weight))
            and t.ln_f.weight.dtype == dtype and _module_supported(head, dtype))


def _module_supported(module, dtype: torch.dtype) -> bool:
    """Whether the step's linears take ``module``'s parameters (float ones of the model dtype)."""
    if getattr(module, "act_quant", False) and not kernels.w8a8_supported(dtype, module.weight):
        return False  # SmoothQuant W8A8: the native int8 kernel takes bf16 and tiling shapes
    quantized = getattr(module, "quant_bits", None) is not None or getattr(module, "fp8", False)
    if quantized and not (module.tile_order and dtype == torch.bfloat16):
        return False
    quantized = quantized or getattr(module, "act_quant", False)
    floats = [p for name, p in module.named_parameters(recurse=False)
              if not (quantized and name in QUANTIZED_PARAMETERS)
              and name != "kv_cache_scaling_factor"]  # float32 KV cache scales: read as such
    return all(p.dtype == dtype for p in floats)


class NativeDecodeStep:
    """``decode_step`` bound to one model and one KV cache (pointers gathered once)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        t = model.transformer
        layers = list(t.layers.values())
        first = layers[0].attention
        k_cache = kv_caches[0][0]
        self.dtype = t.vocab_embedding.weight.dtype  # the model's (the cache may hold codes)
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, MixtureOfExperts)]
        latent = type(first) is MultiHeadLatentAttention
        self.dims = kernels.DecoderDims(
            hidden=model.config.hidden_size, heads=first.num_heads, kv_heads=first.num_kv_heads,
            head_size=first.v_head if latent else first.head_size,
            rot_dim=t.rotary.rotary_dim if t.rotary is not None else 0,
            inter=max((mlp.proj.in_features for mlp in dense), default=0), block_size=k_cache.shape[2], max_blocks=0,
            eps=layers[0].input_layernorm.eps, scale=first.scale,
            kv_kind=0 if k_cache.dtype == self.dtype else kernels.KV_KINDS[k_cache.dtype],
            qk_eps=_qk_norm_eps(first))
        self.weights = (kernels.DecoderLayerWeights * len(layers))()
        # What the layers' ``moe`` and ``mla`` pointers point at.
        self._experts: list[kernels.MoeBlockWeights] = []
        self._latents: list[kernels.LatentAttentionWeights] = []
        packed_everywhere = True
        for entry, layer, (k, v) in zip(self.weights, layers, kv_caches):
            packed_everywhere &= self._gather_layer(entry, layer, k, v)
        # The final norm and LM head too, when the step can compute them: the caller then gets
        # logits from the one call (see ``__call__``).
        self.head: kernels.DecoderHead | None = None
        if supports_native_head(model):
            self.head = kernels.DecoderHead(norm=t.ln_f.weight.data_ptr(), eps=t.ln_f.eps,
                                            linear=_linear_weights(model.lm_head), vocab=model.config.vocab_size)
            self.dims.head_width = model.lm_head.out_features
            self._head_packed = _packed(model.lm_head, self.head.linear)
        # How many tokens a step may have: any number on AMX tiles or quantized weights; fp32
        # up to the skinny GEMM's limit (MKL wins beyond); bf16 without AMX one (oneDNN wins).
        if self.dtype == torch.bfloat16:
            self.max_tokens = UNLIMITED if packed_everywhere else 1
        else:
            self.max_tokens = kernels.SKINNY_MAX_ROWS
        if self._experts:  # the experts call's rows; with a shared expert, the rows it joins the call for
            shared = any(block.has_shared for block in self._experts)
            self.max_tokens = min(self.max_tokens, kernels.SHARED_MAX_ROWS if shared else kernels.MOE_MAX_ROWS)
        if latent:  # the absorbed products' skinny GEMM (beyond it the Python path multiplies otherwise)
            self.max_tokens = min(self.max_tokens, kernels.SKINNY_MAX_ROWS)
        self.rotary = t.rotary
        self.scratch = torch.empty(0, dtype=self.dtype)
        # Set to a float64 [3] tensor to accumulate seconds in linears / attention / the rest.
        self.profile: torch.Tensor | None = None
        # What the gathered pointers depend on: the cache tensors and the weights' storage (all
        # weights are assigned together, at load).
        self._kv_caches, self._cache_ptr = kv_caches, k_cache.data_ptr()
        self._weight = first.dense.weight
        self._weight_ptr = self._weight.data_ptr()
        self._no_rotary = torch.zeros(1, dtype=torch.float32)
        # Each layer's four linears as LoRA sees them (None: experts, which hold no LoRA modules).
        self._linears = [(getattr(layer.attention, "qkv", None), layer.attention.dense, *(
            (None, None) if isinstance(layer.mlp, MixtureOfExperts) else (layer.mlp.fused_fc, layer.mlp.proj)))
            for layer in layers]
        self._widest_input = max(linear.in_features for linears in self._linears for linear in linears if linear)
        # Each adapter's LoraLinear array (and the tensors it points at), while the adapter lives.
        self._lora_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _gather_layer(self, entry: kernels.DecoderLayerWeights, layer, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Fill ``entry`` with ``layer``'s pointers (and its cache's); whether every linear of the
        layer takes any number of rows (``_packed``)."""
        attn, mlp = layer.attention, layer.mlp
        entry.input_norm = layer.input_layernorm.weight.data_ptr()
        entry.post_norm = layer.post_layernorm.weight.data_ptr()
        entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        entry.window = getattr(attn, "window", None) or 0
        scales = getattr(attn, "kv_cache_scaling_factor", None)  # float32 [K, V]: a quantized cache's
        entry.kv_scales = scales.data_ptr() if self.dims.kv_kind else None
        if getattr(attn, "q_norm", None) is not None:
            entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
        if getattr(attn, "sinks", None) is not None:
            entry.sinks = attn.sinks.weight.data_ptr()
        packed, linears = True, [("dense", attn.dense)]
        if type(attn) is MultiHeadLatentAttention:
            self._latents.append(_latent_weights(attn))
            entry.mla = ctypes.addressof(self._latents[-1])
            packed = all(_packed(linear, _linear_weights(linear)) for linear in _latent_linears(attn))
        else:
            linears.append(("qkv", attn.qkv))
        if isinstance(mlp, MixtureOfExperts):  # any rows up to MOE_MAX_ROWS (the router: the skinny GEMM)
            self._experts.append(kernels.moe_block_weights(
                mlp.router.weight, mlp.router.bias, mlp.top_k, mlp.normalize_top_k, mlp.routing_scale(),
                mlp.native_experts(), mlp.native_shared() if mlp.shared_expert is not None else None))
            entry.moe = ctypes.addressof(self._experts[-1])
        else:
            linears += [("fused_fc", mlp.fused_fc), ("proj", mlp.proj)]
        for field, linear in linears:
            setattr(entry, field, _linear_weights(linear))
            packed &= _packed(linear, getattr(entry, field))
        return packed

    def is_for(self, kv_caches: list) -> bool:
        """Whether the gathered pointers still hold for these caches (and the model's weights)."""
        return (kv_caches is self._kv_caches and kv_caches[0][0].data_ptr() == self._cache_ptr
                and self._weight.data_ptr() == self._weight_ptr)

    def computes_logits(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens can end with the logits (``__call__(logits=True)``)."""
        return self.head is not None and (num_tokens == 1 or self.dtype != torch.bfloat16 or self._head_packed)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, metadata, logits: bool = False) -> torch.Tensor:
        """Every layer on the step's tokens (one per sequence); ``hidden`` ``[m, hidden]`` is
        updated in place and returned, or with ``logits`` (where ``computes_logits``), the
        float32 logits ``[m, vocab_size]`` of the final norm and LM head."""
        st = metadata.backend_state
        tables = st["decode_blocks"]
        self.dims.max_blocks = tables.shape[1]
        if self.rotary is not None:
            cos, sin = metadata.rotary_cos_sin(self.rotary, positions)
        else:
            cos = sin = self._no_rotary
        hidden = hidden.contiguous()
        needed = kernels.decode_step_scratch_size(self.dims, hidden.shape[0])
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(needed, dtype=self.dtype)
        out = torch.empty(hidden.shape[0], self.head.vocab, dtype=torch.float32) if logits else None
        step = metadata.lora
        lora_weights = self._lora_weights(step, hidden.shape[0]) if step is not None else None
        kernels.decode_step(hidden, self.weights, self.dims, cos, sin, metadata.slot_mapping, st["decode_tokens"],
                            tables, st["decode_lens"], self.scratch, self.profile, self.head if logits else None, out,
                            lora_weights)
        return out if logits else hidden

    def _lora_weights(self, step: LoraStep, num_tokens: int) -> kernels.LoraStepWeights:
        """The step's adapters for ``decode_step`` (kept alive on the returned struct)."""
        token_adapter = torch.full((num_tokens,), -1, dtype=torch.int64)
        tables = []
        for i, (adapter, rows) in enumerate(step.groups):
            token_adapter[rows] = i
            tables.append(self._lora_table(adapter))
        pointers = (ctypes.c_void_p * len(tables))(*(ctypes.addressof(table) for table, _, _ in tables))
        widest = self._widest_input + max(work for _, _, work in tables)
        weights = kernels.LoraStepWeights(ctypes.addressof(pointers), len(tables), token_adapter.data_ptr(),
                                          num_tokens * widest)
        weights._keep = (pointers, token_adapter, tables)
        return weights

    def _lora_table(self, adapter) -> tuple:
        """(``LoraLinear`` array ``[num_layers][4][LORA_SLOTS]``, the tensors it points at, the
        largest rank + widest module) for ``adapter``: each module with its own columns."""
        if adapter not in self._lora_tables:
            slots = kernels.LORA_SLOTS
            table = (kernels.LoraLinear * (4 * slots * len(self._linears)))()
            tensors, work = [], 0
            for layer, linears in enumerate(self._linears):
                for which, linear in enumerate(linears):
                    if linear is None:
                        continue
                    present = [(t, adapter.weights[t.layer, t.module_id]) for t in linear.lora_targets
                               if (t.layer, t.module_id) in adapter.weights]
                    for slot, (target, (a, b, magnitude)) in enumerate(present):
                        if target.rows is not None:  # this linear's rows of the module (kiln.layers.lora)
                            b, magnitude = b[target.rows], None if magnitude is None else magnitude[target.rows]
                        bt = b.t().contiguous()
                        tensors += [a, bt, magnitude]
                        table[(4 * layer + which) * slots + slot] = kernels.LoraLinear(
                            a.data_ptr(), bt.data_ptr(), magnitude.data_ptr() if magnitude is not None else None,
                            a.shape[0], target.start, target.stop - target.start)
                        work = max(work, a.shape[0] + target.stop - target.start)
            self._lora_tables[adapter] = (table, tensors, work)
        return self._lora_tables[adapter]


def _latent_linears(attn: MultiHeadLatentAttention) -> list:
    """A latent attention layer's projections before attention (q's one or two, kv_a)."""
    q = [attn.q_a_proj, attn.q_b_proj] if attn.q_lora_rank else [attn.q_proj]
    return [*q, attn.kv_a_proj_with_mqa]


def _latent_weights(attn: MultiHeadLatentAttention) -> kernels.LatentAttentionWeights:
    """A latent attention layer's pointers and widths for ``decode_step``."""
    q_lora, up = attn.q_lora_rank, attn.kv_b_proj
    return kernels.LatentAttentionWeights(
        q_a=_linear_weights(attn.q_a_proj) if q_lora else kernels.LinearWeights(),
        q_b=_linear_weights(attn.q_b_proj if q_lora else attn.q_proj), kv_a=_linear_weights(attn.kv_a_proj_with_mqa),
        q_a_norm=attn.q_a_layernorm.weight.data_ptr() if q_lora else None,
        kv_norm=attn.kv_a_layernorm.weight.data_ptr(), keys=up.keys.data_ptr(), values=up.values.data_ptr(),
        q_lora=q_lora or 0, kv_lora=attn.kv_lora_rank, nope=attn.nope, rope=attn.rope, v_head=attn.v_head,
        eps=attn.kv_a_layernorm.eps)


def _packed(linear, weights: kernels.LinearWeights) -> bool:
    """Whether the step's kernels take ``linear`` at any number of rows (bf16 without a packed
    copy: one row only)."""
    return bool(linear.quant_bits or linear.fp8 or linear.act_quant or weights.packed)


def _linear_weights(linear) -> kernels.LinearWeights:
    """A linear layer's pointers: its weight (codes when quantized), bias, tile-packed copy, and
    a quantized layer's scales, offsets, AWQ multiplier and static FP8 activation scale."""
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    act_scale = getattr(linear, "activation_scaling_factor", None)
    extras = dict(prequant=ptr(getattr(linear, "prequant_scaling_factor", None)),
                  act_scale=float(act_scale) if act_scale is not None else 0.0)
    if linear.act_quant:
        return kernels.LinearWeights(ptr(linear.weight), ptr(linear.bias), None, 0, 0,
                                     ptr(linear.weights_scaling_factor), None, fp8=0, w8a8=1, **extras)
    if linear.fp8:
        return kernels.LinearWeights(ptr(linear.weight), ptr(linear.bias), None, 0, 0,
                                     ptr(linear.weights_scaling_factor), None, fp8=1, **extras)
    if linear.quant_bits:
        scales = linear.weights_scaling_factor
        return kernels.LinearWeights(ptr(linear.weight), ptr(linear.bias), None,
                                     kernels.quant_bits_arg(linear.quant_bits, linear.codebook, linear.super_scales),
                                     kernels.quant_kernel_group(scales, linear.group_size), ptr(scales),
                                     ptr(getattr(linear, "weights_offset", None)), fp8=0, **extras)
    packed = linear.packed_weight() if linear.weight.dtype == torch.bfloat16 else None
    plain = None if linear.tile_order else linear.weight  # an engine's bf16 weight is in tiles only
    return kernels.LinearWeights(ptr(plain), ptr(linear.bias), ptr(packed), 0, 0, None, None)


def native_decode_for(model, kv_caches, metadata) -> NativeDecodeStep | None:
    """The model's native decode step for this step, or None when the step or model is not one
    it runs: one token for each sequence (at most ``max_tokens`` of them), the native attention
    backend, a supported model."""
    if metadata.num_tokens != metadata.num_seqs or getattr(metadata.backend, "name", None) != "native":
        return None
    cached = getattr(model, "_native_decode", None)
    if cached is None and not supports_native_decode(model):
        cached = model._native_decode = False  # decided once per model
    if cached is False:
        return None
    if cached is None or not cached.is_for(kv_caches):
        cached = NativeDecodeStep(model, kv_caches)
        model._native_decode = cached
    return cached if metadata.num_tokens <= cached.max_tokens else None
