"""Fused projections for serving: one matmul for q/k/v and one for gate/up.

Decoding one token at batch 1 is a chain of matrix-vector products, and on XLA:CPU each dot has
a fixed cost besides its bytes: 30 separate SmolLM2-sized ``[576, 1536]`` matvecs ran at
17 GB/s, the same bytes as one ``[576, 46080]`` matvec at 22 GB/s (MEASURED, minimum of 15
interleaved rounds, ``docs/results/bench.md``). :func:`fuse_projections` concatenates the
kernels of the projections that read the same input — ``q_proj``, ``k_proj``, ``v_proj`` and
``gate_proj``, ``up_proj`` — once, at load time, so a decoder layer runs 4 dots instead of 7:

.. math:: [q \\; k \\; v] = x\\,[W_q \\; W_k \\; W_v], \\qquad
          [g \\; u] = x\\,[W_g \\; W_u]

The projections keep their module names: each becomes a :class:`FusedPart` that holds the
*shared* concatenated kernel (one ``nnx.Param`` referenced by all parts of the group, stored
once) and its column range, so ``model.layers[i].self_attn.k_proj(x)`` still returns ``k``.
The decoder asks the group for all outputs at once through
:func:`lowrank_jax.models.llama.project` (one forward for every model: no second decoder).
Same fp32 arithmetic per output column, so greedy tokens are those of the unfused model
(``tests/models/test_fused.py``). Groups whose members are not all plain bias-free
``nnx.Linear`` (or all :class:`~lowrank_jax.models.bf16.Bf16Linear`) stay as they are, so LoRA,
factorized or quantized projections are untouched.

Example::

    >>> from flax import nnx
    >>> from lowrank_jax.models.llama import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
    ...                   d_ff=32)
    >>> served = fuse_projections(Llama(cfg, rngs=nnx.Rngs(0)))
    >>> attn = served.layers[0].self_attn
    >>> attn.q_proj.kernel[...].shape, (attn.k_proj.start, attn.k_proj.stop)
    ((16, 32), (16, 24))
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowrank_jax.models.bf16 import Bf16Linear, widen_bf16_bits
from lowrank_jax.models.llama import Llama

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class FusedPart(nnx.Module):
    """Columns ``[start, stop)`` of a kernel ``[in, total]`` shared with the other parts of its
    group (fp32, or bf16 bit patterns as ``uint16`` widened exactly to fp32)."""

    def __init__(self, kernel: nnx.Param, start: int, stop: int):
        if not 0 <= start < stop <= kernel[...].shape[-1]:
            raise ValueError(f"columns [{start}, {stop}) do not lie in the kernel's "
                             f"{kernel[...].shape[-1]} columns; give 0 <= start < stop <= it.")
        self.kernel = kernel
        self.start, self.stop = start, stop

    def _matmul(self, x):
        w = self.kernel[...]
        if w.dtype == jnp.uint16:
            return (x.astype(jnp.float32) @ widen_bf16_bits(w)).astype(x.dtype)
        return x @ w.astype(x.dtype)

    def __call__(self, x):
        """This projection alone (the whole group's matmul, then its columns)."""
        return self._matmul(x)[..., self.start:self.stop]

    def joint(self, x, modules):
        """All outputs of ``modules`` from one matmul when they are the parts of this part's
        group, in column order and covering it; else ``None``."""
        if not all(isinstance(m, FusedPart) and m.kernel is self.kernel for m in modules):
            return None
        bounds = [(m.start, m.stop) for m in modules]
        total = self.kernel[...].shape[-1]
        if bounds[0][0] != 0 or bounds[-1][1] != total or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            return None
        y = self._matmul(x)
        return [y[..., a:b] for a, b in bounds]


def _kernel(module):
    if type(module) is nnx.Linear and module.bias is None:
        return module.kernel[...]
    if type(module) is Bf16Linear:
        return module.bits[...]
    return None


def fuse_projections(model: Llama) -> Llama:
    """A copy of ``model`` whose q/k/v and gate/up projections share one kernel per group.

    Args:
        model: the decoder; a group is fused when all its members are bias-free ``nnx.Linear``
            or all :class:`~lowrank_jax.models.bf16.Bf16Linear` (apply
            :func:`~lowrank_jax.models.bf16.bf16_weights` first for bf16 weights).

    Returns:
        The served copy (the input model is unchanged); the concatenation is done once here.
    """
    served = nnx.clone(model)
    fused = 0
    for layer in served.layers:
        for block_name, names in GROUPS:
            block = getattr(layer, block_name)
            kernels = [_kernel(getattr(block, name)) for name in names]
            if any(k is None for k in kernels) or len({k.dtype for k in kernels}) != 1:
                continue
            shared = nnx.Param(jnp.concatenate(kernels, axis=-1))
            start = 0
            for name, k in zip(names, kernels):
                setattr(block, name, FusedPart(shared, start, start + k.shape[-1]))
                start += k.shape[-1]
            fused += 1
    if not fused:
        raise ValueError("model has no q/k/v or gate/up group of plain dense (or bf16-bits) "
                         "projections to fuse; fuse before adding LoRA or quantizing.")
    return served


__all__ = ["FusedPart", "fuse_projections"]
