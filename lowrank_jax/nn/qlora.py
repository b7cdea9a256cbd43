"""QLoRA's training-state accounting; the layer itself is :class:`lowrank_jax.nn.lora.QLoRALinear`.

A LoRA adapter on a frozen quantized projection is the one adapter body
(:class:`~lowrank_jax.nn.lora.LoRA`) over a base registered without a dense kernel: RTN 4-bit
(``RTNLinear``), NF4 (``NF4Linear``), UniSVQ 2-bit (``QuantizedLinear``) and
:class:`~lowrank_jax.quant.QuantizedProjection` of any layout register themselves in
:mod:`lowrank_jax.quant` with :func:`~lowrank_jax.nn.register_projection`, so this package never
imports ``quant``. Quantize a model's projections with
:func:`lowrank_jax.quant.quantize_projections`; merge with
:func:`lowrank_jax.nn.merge_adapters`.

References:
    Dettmers et al, `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from lowrank_jax.nn.lora import QLoRALinear


def _nbytes(tree) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def memory_bytes(model: nnx.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes the training state holds: ``trainable`` (``LoRAParam``), ``frozen`` (everything
    else of the model: codes, scales, dense weights), ``optimizer`` (the state of an
    ``nnx.Optimizer``, or an optax state: ``tx.init(...)``) and ``total``.

    Example::

        >>> from lowrank_jax.models.presets import preset_model
        >>> memory_bytes(preset_model("tiny"))["trainable"]
        0
    """
    trainable = _nbytes(nnx.state(model, nnx.LoRAParam))
    frozen = _nbytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    if isinstance(optimizer, nnx.Optimizer):
        optimizer = nnx.state(optimizer, nnx.OptState)
    opt = 0 if optimizer is None else _nbytes(optimizer)
    return {"trainable": trainable, "frozen": frozen, "optimizer": opt,
            "total": trainable + frozen + opt}


__all__ = ["QLoRALinear", "memory_bytes"]
