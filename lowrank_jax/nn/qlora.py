"""QLoRA: a LoRA adapter on a frozen quantized projection, dequantized on the fly.

:class:`QLoRALinear` wraps any *linear-like* base module (``[..., in] → [..., out]`` with
``in_features`` / ``out_features``): RTN 4-bit with per-group scales (``RTNLinear``), NF4 as QLoRA
defines it (``NF4Linear``) and UniSVQ 2-bit (``QuantizedLinear``, whose forward runs through the
``lattice_matmul`` kernel API, never forming ``W``). The base keeps its codes and scales; only
``lora_a`` / ``lora_b`` (``nnx.LoRAParam``) train with ``wrt=nnx.LoRAParam``.

Each built-in quantized type is registered with :func:`lowrank_jax.nn.inject.register_linear_like`
together with how to read its dense weight and how to re-quantize a dense weight the same way, so
:func:`~lowrank_jax.nn.apply_lora` wraps it and :mod:`lowrank_jax.nn.merge` can merge into it.

.. math:: y = \\mathrm{base}(x) + s\\,(x A) B,\\qquad s = \\alpha / r

References:
    Dettmers et al, `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023; Hu et al,
    `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.nn.factorized import check_rank
from lowrank_jax.nn.inject import LinearLike, register_linear_like
from lowrank_jax.nn.lora import default_a_initializer, default_b_initializer, lora_scaling


class QLoRALinear(nnx.Module):
    """A frozen quantized ``base`` plus a LoRA adapter: ``y = base(x) + s · dropout(x) A B``.

    Same adapter names, layout and scale as :class:`~lowrank_jax.nn.LoRALinear` (``lora_a``
    ``[in, r]``, ``lora_b`` ``[r, out]``, ``s = alpha / r``), so PEFT export / import and
    :func:`~lowrank_jax.nn.lora_layers` treat both alike. The adapter cannot be folded into
    integer codes in place: merge with :func:`lowrank_jax.nn.merge.merge_adapters` (into fp, exact,
    or into a re-quantized base, with its error reported).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
        >>> base = NF4Linear(nf4_quantize(jax.random.normal(jax.random.PRNGKey(0), (8, 64))))
        >>> layer = QLoRALinear(base, rank=4, rngs=nnx.Rngs(0))
        >>> bool(jnp.allclose(layer(jnp.ones((2, 64))), base(jnp.ones((2, 64)))))
        True

    Args:
        base: a registered linear-like module (kept frozen: its arrays are not ``LoRAParam``).
        rank, alpha, use_rslora, dropout: as :class:`~lowrank_jax.nn.LoRALinear`.
        init: ``"standard"`` (A he-uniform, B zero) or ``"gaussian"``; PiSSA / OLoRA rewrite the
            base weight and are refused on a quantized base.
        param_dtype: dtype of the adapter factors (fp32 default).
    """

    def __init__(
        self,
        base: nnx.Module,
        *,
        rank: int,
        alpha: float | None = None,
        use_rslora: bool = False,
        dropout: float = 0.0,
        init: str = "standard",
        param_dtype: Any = jnp.float32,
        a_initializer=default_a_initializer,
        b_initializer=default_b_initializer,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        check_rank(rank, self.in_features, self.out_features, "QLoRALinear: ")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"QLoRALinear: dropout={dropout} must lie in [0, 1).")
        self.base = base
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.param_dtype = param_dtype
        self.merged = False
        if init == "standard":
            a = a_initializer(rngs.params(), (self.in_features, rank), param_dtype)
        elif init == "gaussian":
            a = jax.random.normal(rngs.params(), (self.in_features, rank), param_dtype) / rank
        else:
            raise ValueError(
                f"QLoRALinear: init={init!r} is not available on a quantized base (PiSSA / "
                "OLoRA rewrite the base weight); use 'standard' or 'gaussian', or merge into fp "
                "first."
            )
        self.lora_a = nnx.LoRAParam(a)
        self.lora_b = nnx.LoRAParam(
            b_initializer(rngs.params(), (rank, self.out_features), param_dtype))
        self.lora_dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else nnx.data(None)

    def delta(self) -> Float[Array, "in out"]:
        """The adapter's dense update ``s · A B``."""
        return self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def base_weight(self) -> Float[Array, "out in"]:
        """The base's dequantized fp32 weight ``[out, in]`` (``y = x Wᵀ``)."""
        return linear_like_of(self.base).dense(self.base)

    def merge(self) -> None:
        raise ValueError(
            "QLoRALinear.merge: an adapter cannot be folded into integer codes in place; use "
            "lowrank_jax.nn.merge.merge_adapters(model, target='fp' | 'quantized')."
        )

    def unmerge(self) -> None:
        raise ValueError("QLoRALinear.unmerge: a QLoRA adapter is never merged in place.")

    def __call__(self, inputs: Float[ArrayLike, "... in"], *, deterministic: bool | None = None):
        out = self.base(inputs)
        x = jnp.asarray(inputs)
        if self.lora_dropout is not None:
            x = self.lora_dropout(x, deterministic=deterministic)
        a, b = self.lora_a[...], self.lora_b[...]
        h = (x.astype(a.dtype) @ a) @ b
        return (out + self.scaling * h.astype(out.dtype)).astype(out.dtype)


def linear_like_of(module: nnx.Module) -> LinearLike:
    """The registry entry of ``module``'s type (clear error for an unregistered type)."""
    from lowrank_jax.nn.inject import LINEAR_LIKE

    entry = LINEAR_LIKE.get(type(module))
    if entry is None:
        raise ValueError(
            f"{type(module).__name__} is not a registered linear-like module; register it with "
            "lowrank_jax.nn.inject.register_linear_like(cls, ...)."
        )
    return entry


def _wrap(base, **kwargs) -> QLoRALinear:
    return QLoRALinear(base, **kwargs)


def _register_builtins() -> None:
    from lowrank_jax.quant.layers import QuantizedLinear, RTNLinear
    from lowrank_jax.quant.nf4 import NF4Linear, nf4_dequantize, nf4_quantize
    from lowrank_jax.quant.rtn import rtn_dequantize, rtn_quantize
    from lowrank_jax.quant.unisvq import UniSVQConfig, dequantize, quantize_linear

    def rtn_requant(layer, w):
        return RTNLinear(rtn_quantize(w, layer.bits, layer.group_size))

    def nf4_requant(layer, w):
        return NF4Linear(nf4_quantize(w, layer.block_size, double_quant=layer.double_quant))

    def unisvq_requant(layer, w):
        cfg = UniSVQConfig(hadamard_block=max(layer.block_in, layer.block_out))
        q = quantize_linear(w, None, cfg)
        return QuantizedLinear(q, mode=layer.mode, implementation=layer.implementation)

    register_linear_like(RTNLinear, LinearLike(
        wrap=_wrap, dense=lambda m: rtn_dequantize(m.weight()), requantize=rtn_requant,
        method="rtn"), QLoRALinear)
    register_linear_like(NF4Linear, LinearLike(
        wrap=_wrap, dense=lambda m: nf4_dequantize(m.weight()), requantize=nf4_requant,
        method="nf4"), QLoRALinear)
    register_linear_like(QuantizedLinear, LinearLike(
        wrap=_wrap, dense=lambda m: dequantize(m.weight()), requantize=unisvq_requant,
        method="unisvq"), QLoRALinear)


_register_builtins()

QUANTIZE_METHODS = ("nf4", "rtn4", "unisvq2")


def quantize_base(model, method: str, *, calib_tokens=None, layers=None,
                  double_quant: bool = False, cfg=None) -> dict:
    """Quantize the projections of a dense Llama ``model`` (in place) for QLoRA.

    Args:
        model: a dense :class:`~lowrank_jax.models.Llama`.
        method: ``"nf4"`` (QLoRA's NF4, 64-blocks), ``"rtn4"`` (RTN 4-bit, groups of 64) or
            ``"unisvq2"`` (UniSVQ 2-bit: the full pipeline with ``calib_tokens`` [n, t]; without
            them, Hessian-free nearest-codeword lattice rounding, seconds instead of minutes).
        layers: decoder blocks to quantize (default all).
        double_quant: NF4 double quantization of the absmaxes.
        cfg: a :class:`~lowrank_jax.quant.unisvq.UniSVQConfig` for the calibrated UniSVQ
            pipeline (default ``UniSVQConfig()``).

    Returns:
        ``{"method", "quantized": n_projections}``.
    """
    from lowrank_jax.models.llama import replace_projections
    from lowrank_jax.quant.layers import QuantizedLinear, dense_weight
    from lowrank_jax.quant.nf4 import nf4_quantize_model
    from lowrank_jax.quant.pipeline import quantize_model
    from lowrank_jax.quant.unisvq import UniSVQConfig, quantize_linear

    if method not in QUANTIZE_METHODS:
        raise ValueError(f"quantize: method={method!r} is unknown; use one of "
                         f"{', '.join(QUANTIZE_METHODS)}.")
    if method == "nf4":
        done = nf4_quantize_model(model, double_quant=double_quant, layers=layers)
    elif method == "rtn4":
        quantize_model(model, None, method="rtn", bits=4, group_size=64, layers=layers,
                       progress=False)
        done = [p for p, m in nnx.iter_modules(model) if type(m).__name__ == "RTNLinear"]
    elif calib_tokens is not None:
        quantize_model(model, calib_tokens, method="unisvq", bits=2, layers=layers,
                       cfg=UniSVQConfig() if cfg is None else cfg, progress=False)
        done = [p for p, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]
    else:
        done = replace_projections(
            model, lambda _i, _n, lin: QuantizedLinear(
                quantize_linear(dense_weight(lin), None, UniSVQConfig())), layers=layers)
    return {"method": method, "quantized": len(done)}


def save_quantized_base(model, source: str, folder) -> str:
    """Write the quantized ``model`` (no adapters yet) as a quantized folder that ``--model``
    reads (:func:`lowrank_jax.quant.io.save_quantized`: NF4, RTN and UniSVQ layouts), with the
    tokenizer of ``source`` (the model name it was loaded from); a byte-level model (vocab 256,
    e.g. the ``tiny`` preset) gets the byte-tokenizer marker instead. Returns the folder."""
    import json
    import os

    from lowrank_jax.io.outputs import atomic_write_text
    from lowrank_jax.models.hub import load_model, save_model
    from lowrank_jax.models.presets import PRESETS
    from lowrank_jax.train.structure import BYTE_TOKENIZER_FILE

    if any(isinstance(m, QLoRALinear) for _, m in nnx.iter_modules(model)):
        raise ValueError("save_quantized_base: the model already holds adapters; save the base "
                         "before apply_lora (or merge with lowrank_jax.nn.merge first).")
    tokenizer = None if source in PRESETS else load_model(source)[1]
    save_model(model, folder, tokenizer=tokenizer)
    if tokenizer is None and model.cfg.vocab_size == 256:
        atomic_write_text(os.path.join(os.fspath(folder), BYTE_TOKENIZER_FILE),
                          json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    return os.fspath(folder)


def _nbytes(tree) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def memory_bytes(model: nnx.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes the training state holds: ``trainable`` (``LoRAParam``), ``frozen`` (everything
    else of the model: codes, scales, dense weights), ``optimizer`` (its state) and ``total``.

    Example::

        >>> from lowrank_jax.models.presets import preset_model
        >>> memory_bytes(preset_model("tiny"))["trainable"]
        0
    """
    trainable = _nbytes(nnx.state(model, nnx.LoRAParam))
    frozen = _nbytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    opt = 0 if optimizer is None else _nbytes(nnx.state(optimizer, nnx.OptState))
    return {"trainable": trainable, "frozen": frozen, "optimizer": opt,
            "total": trainable + frozen + opt}


__all__ = ["QUANTIZE_METHODS", "QLoRALinear", "linear_like_of", "memory_bytes",
           "quantize_base", "save_quantized_base"]
