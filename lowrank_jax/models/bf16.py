"""bf16 weights for CPU serving: half the bytes per decoded token, fp32 arithmetic.

Decoding one token reads every weight once, so on a CPU its time is set by memory bandwidth.
Storing the projections in bf16 halves those bytes, but XLA:CPU handles the bf16 dtype itself
slowly: a bf16 matvec (or a bf16 → fp32 ``convert`` feeding a dot) ran about 10× slower than the
fp32 matvec on this project's 2-core AMD EPYC (DERIVED: ``docs/results/bench.md``). The trick
here avoids the bf16 dtype inside the compiled step: the kernel is kept as the **bit patterns**
of its bf16 values (``uint16``), and widened exactly to fp32 by an integer shift,

.. math:: \\mathrm{fp32}(w) = \\mathrm{bitcast}_{\\mathrm{fp32}}(\\mathrm{uint32}(b) \\ll 16),

feeding an ordinary fp32 dot, so every product and sum is fp32. (The multiply-and-reduce form
of a batch-1 matvec, ``sum(x[:, None] * W, axis=0)``, was fast alone but 25× slower inside the
scanned decoder: XLA:CPU materialized the broadcast ``x``; MEASURED on a SmolLM2-shaped 8-layer
model, 629 ms vs 23 ms per decode step for the widened dot.)

:func:`bf16_weights` swaps every dense projection of a model for :class:`Bf16Linear` through
the model's extension point :func:`~lowrank_jax.models.llama.replace_projections` (the same
decoder, no second forward). The embedding (and the tied LM head) stay fp32.

Example::

    >>> from flax import nnx
    >>> from lowrank_jax.models.llama import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
    ...                   d_ff=32)
    >>> served = bf16_weights(Llama(cfg, rngs=nnx.Rngs(0)))
    >>> type(served.layers[0].mlp.up_proj).__name__, served.layers[0].mlp.up_proj.bits.dtype
    ('Bf16Linear', dtype('uint16'))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.models.llama import Llama, replace_projections


def to_bf16_bits(w) -> np.ndarray:
    """The bf16 bit patterns (``uint16``) of ``w``, rounded to nearest even like ``astype``."""
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(w, jnp.float32)
                                                   .astype(jnp.bfloat16), jnp.uint16))


def widen_bf16_bits(bits):
    """fp32 values of bf16 bit patterns (``uint16``): exact, and fusible by XLA:CPU."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


class Bf16Linear(nnx.Module):
    """``y = x @ W`` (no bias) with ``W [in, out]`` stored as bf16 bits, computed in fp32.

    For inference: the ``uint16`` kernel has no gradient. Built from a dense kernel with
    :meth:`from_kernel` (or by :func:`bf16_weights`).
    """

    def __init__(self, bits):
        bits = np.asarray(bits)
        if bits.dtype != np.uint16 or bits.ndim != 2:
            raise ValueError(f"bits has dtype {bits.dtype} and shape {bits.shape}; pass a 2-D "
                             "uint16 array (use Bf16Linear.from_kernel for an fp32 kernel).")
        self.bits = nnx.Param(jnp.asarray(bits))

    @classmethod
    def from_kernel(cls, kernel) -> "Bf16Linear":
        return cls(to_bf16_bits(kernel))

    def __call__(self, x):
        return (x.astype(jnp.float32) @ widen_bf16_bits(self.bits[...])).astype(x.dtype)


def bf16_weights(model: Llama) -> Llama:
    """A copy of ``model`` whose dense projections (``nnx.Linear``) hold bf16 bits.

    Args:
        model: a decoder computing in fp32 (``cfg.dtype == "float32"``); factorized or LoRA
            projections are kept as they are.

    Returns:
        The served copy (the input model is unchanged).
    """
    if str(model.cfg.dtype) != "float32":
        raise ValueError(f"model computes in {model.cfg.dtype}; bf16_weights keeps fp32 "
                         "arithmetic, so load the model with dtype='float32'.")
    served = nnx.clone(model)

    def make(layer, name, current):
        if type(current) is nnx.Linear and current.bias is None:
            return Bf16Linear.from_kernel(current.kernel[...])
        return None

    if not replace_projections(served, make):
        raise ValueError("model has no dense nnx.Linear projections to store in bf16.")
    return served


__all__ = ["Bf16Linear", "bf16_weights", "to_bf16_bits", "widen_bf16_bits"]
