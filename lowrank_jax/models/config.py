"""The decoder's architecture: :class:`LlamaConfig`, plain Llama by default, with each checkpoint
family's differences (Llama 3.x, Mistral, Qwen2/3, Gemma 2/3, Phi-3) as optional features.

:mod:`lowrank_jax.models.llama` builds the one decoder from it; :mod:`lowrank_jax.models.families`
translates HF ``config.json`` files to and from it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax

from pallas_kernels.rope import RopeFrequencies, rope_frequencies

#: MLP activations the core implements (HF ``hidden_act`` names): SwiGLU and Gemma's GeGLU.
HIDDEN_ACTS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass
class LlamaConfig:
    """Architecture of the decoder.

    ``projection`` is ``"dense"`` or ``"factorized"``; factorized layers get rank
    ``round(rank_ratio · min(in, out))`` (at least 1). LoRA is added afterwards with
    :func:`lowrank_jax.nn.apply_lora`. ``attention`` names an implementation registered in
    :mod:`lowrank_jax.attention`, or gives one name per layer (a tuple of ``n_layers`` names,
    e.g. from :func:`lowrank_jax.attention.register_sale_per_layer` for
    per-layer SALE thresholds; the layers are then unrolled instead of scanned).

    The checkpoint families (Llama 3.x, Mistral, Qwen2/3, Gemma 2/3, Phi-3) are features of
    this one core, all off by default (plain Llama): ``family`` is the HF ``model_type`` the
    model is saved as; ``rope_scaling`` (a HF dict: ``linear``, ``llama3``, ``longrope``),
    ``partial_rotary_factor`` and ``original_max_seq_len`` shape the RoPE frequencies, and
    ``rope_local_theta`` is the base of sliding-window layers (Gemma 3); ``qkv_bias`` /
    ``o_bias`` add projection biases (Qwen2); ``qk_norm`` RMS-normalizes each head of q and k
    before RoPE (Qwen3, Gemma 3); ``norm_offset=1`` makes every norm ``(1 + w)`` (Gemma);
    ``embed_scale`` multiplies embeddings by ``sqrt(d_model)``; ``hidden_act`` is the MLP gate
    (``silu`` or ``gelu_pytorch_tanh``); ``sandwich_norms`` adds Gemma 2's norms around the
    attention and MLP outputs; ``attn_logit_softcap``, ``final_logit_softcap`` and
    ``query_pre_attn_scalar`` (score scale ``s^-1/2``) are Gemma 2's; ``sliding_window`` with
    ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per layer; every layer slides
    when unset) are the local-attention layers. Layers that differ (window, RoPE base) run
    unrolled (:attr:`uniform_layers`). ``token_ids`` keeps a loaded folder's
    ``bos/eos/pad_token_id`` so that saving writes them back.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int | None = None
    d_ff: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    projection: str = "dense"
    rank_ratio: float = 0.25
    attention: str | tuple[str, ...] = "reference"
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    family: str = "llama"
    rope_scaling: dict | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    original_max_seq_len: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    token_ids: dict | None = None

    def __post_init__(self):
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "max_seq_len"):
            value = getattr(self, key)
            least = 0 if key == "n_layers" else 1  # n_layers=0: the embedding-only shell
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and value >= least):
                raise ValueError(f"{key}={value!r} must be "
                                 f"{'an integer >= 0' if least == 0 else 'a positive integer'}.")
        for key in ("rope_theta", "norm_eps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} must be > 0.")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; pick "
                    f"n_heads dividing d_model (or set head_dim explicitly)."
                )
            self.head_dim = self.d_model // self.n_heads
        if not (isinstance(self.head_dim, numbers.Integral) and self.head_dim >= 1):
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive integer.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}."
            )
        if self.projection not in ("dense", "factorized"):
            raise ValueError(
                f"projection={self.projection!r} is unknown; use 'dense' or 'factorized' "
                "(add LoRA with lowrank_jax.nn.apply_lora)."
            )
        if not 0.0 < self.rank_ratio <= 1.0:
            raise ValueError(f"rank_ratio={self.rank_ratio} must lie in (0, 1].")
        if isinstance(self.attention, list):  # e.g. read back from JSON / YAML
            self.attention = tuple(self.attention)
        if isinstance(self.attention, tuple) and len(self.attention) != self.n_layers:
            raise ValueError(
                f"attention has {len(self.attention)} per-layer names but n_layers="
                f"{self.n_layers}; give one name per layer or a single name for all."
            )
        self._check_family_features()

    def _check_family_features(self):
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not implemented; use one of "
                             f"{sorted(HIDDEN_ACTS)}.")
        if isinstance(self.layer_types, list):
            self.layer_types = tuple(self.layer_types)
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries but n_layers="
                                 f"{self.n_layers}; give one per layer.")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types: {unknown} are not implemented; use "
                                 f"{' / '.join(LAYER_TYPES)}.")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types names sliding_attention layers but "
                                 "sliding_window is None; set the window size.")
        if self.sliding_window is not None and not (
                isinstance(self.sliding_window, numbers.Integral) and self.sliding_window >= 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer "
                             "or None.")
        for key in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                    "rope_local_theta"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key}={value!r} must be > 0 or None.")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must lie in "
                             "(0, 1].")
        self.rope_for(0)  # refuses an unknown rope_scaling type or a bad rotary size now

    def layer_type(self, layer: int) -> str:
        """``"sliding_attention"`` or ``"full_attention"`` for decoder layer ``layer``."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def window_for(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: full causal attention)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def rope_for(self, layer: int) -> RopeFrequencies:
        """The RoPE frequencies of layer ``layer`` (local base on Gemma 3's sliding layers)."""
        local = self.rope_local_theta is not None and self.layer_type(layer) == "sliding_attention"
        return _rope_frequencies(
            self.head_dim, self.rope_local_theta if local else self.rope_theta,
            None if local or not self.rope_scaling else tuple(sorted(
                (k, tuple(v) if isinstance(v, list) else v)
                for k, v in self.rope_scaling.items())),
            self.partial_rotary_factor, self.max_seq_len, self.original_max_seq_len)

    def kv_compression_blockers(self) -> list[str]:
        """The features the compressed KV caches (:mod:`lowrank_jax.kv`) do not implement: they
        re-rotate keys with plain RoPE of base ``rope_theta`` and attend over the whole prefix
        with the default score scale. Empty for plain-RoPE families (Llama 2, Mistral without a
        window, Qwen2/3, Gemma 1)."""
        out = []
        if self.rope_scaling:
            out.append(f"rope_scaling={self.rope_scaling.get('rope_type')!r}")
        if self.partial_rotary_factor != 1.0:
            out.append(f"partial_rotary_factor={self.partial_rotary_factor}")
        if self.rope_local_theta is not None:
            out.append("rope_local_theta (per-layer RoPE bases)")
        if any(self.window_for(i) is not None for i in range(self.n_layers)):
            out.append(f"sliding_window={self.sliding_window}")
        if self.attn_logit_softcap is not None:
            out.append(f"attn_logit_softcap={self.attn_logit_softcap}")
        if self.query_pre_attn_scalar is not None and \
                self.query_pre_attn_scalar != self.head_dim:
            out.append(f"query_pre_attn_scalar={self.query_pre_attn_scalar}")
        return out

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer runs the same computation (so the layers may be scanned)."""
        if not isinstance(self.attention, str):
            return False
        return len({(self.layer_type(i)) for i in range(self.n_layers)}) <= 1

    def attention_for(self, layer: int) -> str:
        """The attention implementation name of decoder layer ``layer``."""
        return self.attention if isinstance(self.attention, str) else self.attention[layer]

    def rank_for(self, in_features: int, out_features: int) -> int:
        return max(1, int(round(self.rank_ratio * min(in_features, out_features))))


@functools.lru_cache(maxsize=64)
def _rope_frequencies(head_dim, theta, scaling, partial, max_len, original) -> RopeFrequencies:
    return rope_frequencies(head_dim, theta, dict(scaling) if scaling else None,
                            partial_rotary_factor=partial, max_position_embeddings=max_len,
                            original_max_position_embeddings=original)


__all__ = ["HIDDEN_ACTS", "LAYER_TYPES", "LlamaConfig"]
