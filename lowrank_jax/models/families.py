"""The HF checkpoint families as features of the one decoder core: ``config.json`` ↔ LlamaConfig.

Llama (incl. 3.x RoPE scaling), Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3 (text) and Phi-3 are one
:class:`~lowrank_jax.models.llama.Llama` with different :class:`LlamaConfig` features
(``specs/hf_architectures.md``). This module reads a ``config.json`` in both formats
transformers writes:

- transformers 4: ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq`` for Gemma 3),
  ``torch_dtype``;
- transformers 5: ``rope_parameters`` (``rope_theta`` and the scaling inside; for Gemma 3 one
  dict per layer type, ``{"sliding_attention": {...}, "full_attention": {...}}``), ``dtype``.

Every field is either implemented, known to leave the logits unchanged (token ids, dropout,
cache flags, ...), or refused by name: a field this module does not know raises a
``ValueError`` naming it, never dropped silently. The tensor-name side (fused Phi-3
projections, the Gemma 3 multimodal ``language_model`` prefix) is :func:`hf_tensor_names`,
:func:`split_fused` and :func:`fuse_for_family`.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from lowrank_jax.models.llama import HIDDEN_ACTS, LlamaConfig

#: ``model_type`` values the core loads, and the HF class each saves as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
GEMMA = ("gemma", "gemma2", "gemma3_text")

# Fields that do not change the logits (ids, dropout at inference, bookkeeping).
_NO_EFFECT = {
    "transformers_version", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop", "architectures",
    "model_type", "torch_dtype", "dtype", "_name_or_path", "pretraining_tp", "cache_implementation",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_return_dict",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward",
    "pruned_heads", "cross_attention_hidden_size", "bad_words_ids", "_attn_implementation",
    "_attn_implementation_autoset", "use_bfloat16", "tf_legacy_loss", "torch_compile",
    "initializer_factor", "auto_map", "base_model_tp_plan", "base_model_pp_plan",
    # generation defaults some old configs carry
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "max_new_tokens", "output_router_logits",
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Fields this module reads (each checked or translated below).
_READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "hidden_act", "hidden_activation", "rope_theta",
    "rope_scaling", "rope_parameters", "rope_local_base_freq", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "sliding_window_pattern", "_sliding_window_pattern", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor",
    "original_max_position_embeddings", "use_bidirectional_attention", "quantization_config",
}


def _refuse(source: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{source}: {field}={value!r} is not implemented by the model core ({why}); "
                      "the checkpoint would load with wrong logits, so it is refused.")


def text_config(hf: Mapping[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The text-model config: ``hf`` itself, or a Gemma 3 multimodal folder's ``text_config``."""
    hf = dict(hf)
    if hf.get("model_type") == "gemma3" or "text_config" in hf:
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"{source}: model_type={hf.get('model_type')!r} has no text_config; "
                             "only the text model of a multimodal folder loads.")
        text = dict(text)
        text.setdefault("model_type", "gemma3_text")
        if "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return text
    return hf


def _rope_settings(hf, family, source):
    """``(theta, scaling, local_theta, partial, original_ctx)`` from either config format."""
    params = hf.get("rope_parameters")
    partial = hf.get("partial_rotary_factor")
    original = hf.get("original_max_position_embeddings")
    local_theta = hf.get("rope_local_base_freq")
    if isinstance(params, Mapping) and set(params) & {"full_attention", "sliding_attention"}:
        unknown = set(params) - {"full_attention", "sliding_attention"}
        if unknown:
            raise _refuse(source, "rope_parameters", sorted(unknown), "unknown layer types")
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local and (local.get("rope_type") or "default") != "default":
            raise _refuse(source, "rope_parameters.sliding_attention", local,
                          "only plain RoPE on sliding layers")
        if local.get("rope_theta") is not None:
            local_theta = local["rope_theta"]
        params = full
    if isinstance(params, Mapping) and params:
        params = dict(params)
        theta = params.pop("rope_theta", None)
        partial = params.pop("partial_rotary_factor", partial)
        if (params.get("rope_type") == "longrope" and original is None
                and params.get("original_max_position_embeddings") is not None):
            original = params["original_max_position_embeddings"]
        scaling = params
    else:
        theta = None
        scaling = dict(hf.get("rope_scaling") or {})
    if theta is None:
        theta = hf.get("rope_theta")
    if theta is None:
        theta = 10000.0
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind == "default":
        scaling = None
    elif kind not in ("linear", "llama3", "longrope"):
        raise _refuse(source, "rope_scaling.rope_type", kind,
                      "implemented: default, linear, llama3, longrope")
    if family == "gemma3_text" and local_theta is None:
        local_theta = 10000.0
    return float(theta), scaling, local_theta, float(partial or 1.0), original


def _layer_types(hf, family, n_layers, window):
    types = hf.get("layer_types")
    if window is None:
        if types and "sliding_attention" in types:
            return None, None  # sliding layers without a window: transformers runs them full
        return None, None
    if types:
        return tuple(types), window
    if family == "gemma2":
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(n_layers)), window
    if family == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(n_layers)), window
    if family in ("qwen2", "qwen3"):
        first = int(hf.get("max_window_layers") or 0)
        return tuple("sliding_attention" if i >= first else "full_attention"
                     for i in range(n_layers)), window
    return None, window  # Mistral, Phi-3: every layer slides


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> LlamaConfig:
    """Translate a HF ``config.json`` (transformers 4 or 5 format) into a :class:`LlamaConfig`.

    Args:
        hf: the parsed ``config.json``.
        source: where it came from (named in error messages).

    Returns:
        A dense :class:`LlamaConfig` in float32 whose ``family`` is the ``model_type``.

    Raises:
        ValueError: naming the first field the core does not implement.

    Example::

        >>> cfg = config_from_hf({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        ...     "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 12,
        ...     "intermediate_size": 32, "rope_parameters": {"rope_theta": 1e6}})
        >>> cfg.family, cfg.head_dim, cfg.qk_norm, cfg.rope_theta
        ('qwen3', 12, True, 1000000.0)
    """
    hf = text_config(hf, source=source)
    family = hf.get("model_type")
    archs = hf.get("architectures") or []
    if family not in SUPPORTED_MODEL_TYPES:
        if family is None and "LlamaForCausalLM" in archs:
            family = "llama"
        else:
            raise ValueError(
                f"{source}: model_type={family!r} (architectures={archs}) is not a supported "
                f"family; supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}.")
    unknown = sorted(k for k in hf if k not in _NO_EFFECT and k not in _READ)
    if unknown:
        raise ValueError(
            f"{source}: field {unknown[0]!r} (={hf[unknown[0]]!r}) is not implemented by the model "
            f"core and not known to leave the logits unchanged; refused rather than ignored"
            f"{f' (also: {unknown[1:]})' if len(unknown) > 1 else ''}.")
    if hf.get("quantization_config"):
        raise _refuse(source, "quantization_config", hf["quantization_config"],
                      "load an unquantized folder")
    if hf.get("mlp_bias"):
        raise _refuse(source, "mlp_bias", True, "the MLP has no biases")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(source, "use_bidirectional_attention", True, "causal decoders only")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or (
        "gelu_pytorch_tanh" if family in GEMMA else "silu")
    if act not in HIDDEN_ACTS:
        field = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
        raise _refuse(source, field, act, f"implemented: {sorted(HIDDEN_ACTS)}")
    theta, scaling, local_theta, partial, original = _rope_settings(hf, family, source)
    if partial != 1.0 and family != "phi3":
        raise _refuse(source, "partial_rotary_factor", partial, "Phi-3 only")
    try:
        n_heads = int(hf["num_attention_heads"])
        d_model = int(hf["hidden_size"])
        n_layers = int(hf["num_hidden_layers"])
        window = hf.get("sliding_window")
        if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
            window = None
        if family in ("llama", "gemma"):
            window = None  # their HF classes never slide
        layer_types, window = _layer_types(hf, family, n_layers, window)
        attention_bias = bool(hf.get("attention_bias"))
        gemma = family in GEMMA
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings") or 2048),
            rope_theta=theta,
            norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            family=family,
            rope_scaling=scaling,
            rope_local_theta=None if local_theta is None else float(local_theta),
            partial_rotary_factor=partial,
            original_max_seq_len=None if original is None else int(original),
            qkv_bias=attention_bias or family == "qwen2",
            o_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            hidden_act=act,
            sandwich_norms=family in ("gemma2", "gemma3_text"),
            attn_logit_softcap=_positive(hf.get("attn_logit_softcapping")),
            final_logit_softcap=_positive(hf.get("final_logit_softcapping")),
            query_pre_attn_scalar=_positive(hf.get("query_pre_attn_scalar")),
            sliding_window=None if window is None else int(window),
            layer_types=layer_types,
            token_ids={k: hf[k] for k in _TOKEN_IDS if hf.get(k) is not None} or None,
        )
    except KeyError as err:
        raise ValueError(f"{source}: required field {err.args[0]!r} is missing.") from None


def _positive(value):
    return None if value in (None, 0) else float(value)


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """The HF ``config.json`` of ``cfg`` for its family (transformers-4 field names, which both
    transformers 4 and 5 read; inverse of :func:`config_from_hf`)."""
    family = cfg.family
    if family not in ARCHITECTURES:
        raise ValueError(f"LlamaConfig.family={family!r} is unknown; use one of "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": cfg.hidden_act,
        "torch_dtype": cfg.param_dtype,
        # the folder's token ids; None rather than the class default (Phi-3's pad id 32000
        # would not fit a small vocabulary)
        **{k: None for k in _TOKEN_IDS}, **(cfg.token_ids or {}),
    }
    if family in ("llama", "qwen3", "gemma", "gemma2", "gemma3_text"):
        out["attention_bias"] = bool(cfg.o_bias)
    if family == "llama":
        out["mlp_bias"] = False
    if family in GEMMA:
        out["hidden_activation"] = cfg.hidden_act
    if family in ("gemma2", "gemma3_text"):
        scalar = cfg.query_pre_attn_scalar  # an int in HF's (strictly typed) config
        out["query_pre_attn_scalar"] = (int(scalar) if scalar is not None
                                        and float(scalar).is_integer() else scalar)
        out["attn_logit_softcapping"] = cfg.attn_logit_softcap
        out["final_logit_softcapping"] = cfg.final_logit_softcap
    if family == "gemma3_text":
        out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    if family == "phi3":
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
        out["original_max_position_embeddings"] = cfg.original_max_seq_len or cfg.max_seq_len
    window = cfg.sliding_window
    out["sliding_window"] = window
    if family in ("qwen2", "qwen3"):
        out["use_sliding_window"] = window is not None
        if window is not None:
            types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
            first = types.index("sliding_attention")
            if types != ["full_attention"] * first + ["sliding_attention"] * (len(types) - first):
                raise ValueError(f"{family} slides the layers from max_window_layers on; "
                                 f"layer_types={types} cannot be saved as {family}.")
            out["max_window_layers"] = first
    if cfg.layer_types is not None or family in ("gemma2", "gemma3_text"):
        out["layer_types"] = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    _check_saveable(cfg, out)
    return out


def _check_saveable(cfg: LlamaConfig, out: Mapping[str, Any]) -> None:
    """Refuse saving a feature the family's HF class does not have (it would load wrong)."""
    family = cfg.family
    back = config_from_hf(out, source=f"config_to_hf(family={family!r})")
    for key in ("qkv_bias", "o_bias", "qk_norm", "norm_offset", "embed_scale", "hidden_act",
                "sandwich_norms", "attn_logit_softcap", "final_logit_softcap",
                "query_pre_attn_scalar", "partial_rotary_factor", "rope_local_theta"):
        if getattr(back, key) != getattr(cfg, key):
            raise ValueError(
                f"LlamaConfig.{key}={getattr(cfg, key)!r} cannot be saved as family={family!r} "
                f"(its HF class has {key}={getattr(back, key)!r}); set LlamaConfig.family to the "
                "family that has this feature.")
    mine = [cfg.window_for(i) for i in range(cfg.n_layers)]
    theirs = [back.window_for(i) for i in range(cfg.n_layers)]
    if mine != theirs:
        raise ValueError(f"the sliding windows {mine} cannot be saved as family={family!r} "
                         f"(it would read {theirs}).")


def hf_tensor_names(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names of ``cfg`` (unfused, e.g. Phi-3's q/k/v separately) and shapes."""
    d, hd, ff = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    per_layer = {
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
        "mlp.down_proj.weight": (d, ff),
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
    }
    if cfg.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = (d,)
    if cfg.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.sandwich_norms:
        per_layer.update({"pre_feedforward_layernorm.weight": (d,),
                          "post_feedforward_layernorm.weight": (d,)})
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


# Gemma 3 multimodal folders: the text model under these prefixes (transformers 4, 5).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def text_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """HF text-model names for ``tensors``: the ``language_model`` prefix of a multimodal Gemma 3
    folder removed and its vision tower / projector left out (plain folders pass unchanged)."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in tensors):
        return dict(tensors)
    out = {}
    for key, value in tensors.items():
        if key.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def split_fused(cfg: LlamaConfig, tensors: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Phi-3's fused ``qkv_proj`` (rows q, k, v) and ``gate_up_proj`` (gate half first) split
    into the core's separate projections (other tensors pass unchanged, lazily)."""
    q, kv, ff = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    out = dict(tensors)
    for key in list(tensors):
        if key.endswith(".self_attn.qkv_proj.weight"):
            fused = np.asarray(_value(out.pop(key)))
            if fused.shape[0] != q + 2 * kv:
                raise ValueError(f"{source}: tensor {key!r} has {fused.shape[0]} rows; "
                                 f"q+k+v need {q + 2 * kv} from the config.")
            base = key[: -len("qkv_proj.weight")]
            out[base + "q_proj.weight"] = fused[:q]
            out[base + "k_proj.weight"] = fused[q:q + kv]
            out[base + "v_proj.weight"] = fused[q + kv:]
        elif key.endswith(".mlp.gate_up_proj.weight"):
            fused = np.asarray(_value(out.pop(key)))
            if fused.shape[0] != 2 * ff:
                raise ValueError(f"{source}: tensor {key!r} has {fused.shape[0]} rows; "
                                 f"gate+up need {2 * ff} from the config.")
            base = key[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = fused[:ff], fused[ff:]
    return out


def fuse_for_family(cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors as ``cfg.family``'s HF class names them (Phi-3: fused qkv / gate_up)."""
    if cfg.family != "phi3":
        return tensors
    out = dict(tensors)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [out.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"], axis=0)
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + "mlp.gate_proj.weight"), out.pop(p + "mlp.up_proj.weight")], axis=0)
    return out


def _value(value):
    return value() if callable(value) else value


__all__ = ["ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf",
           "fuse_for_family", "hf_tensor_names", "split_fused", "text_config", "text_tensors"]
