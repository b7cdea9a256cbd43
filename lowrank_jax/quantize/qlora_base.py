"""The model-level QLoRA base: quantize a dense Llama's projections (saved by ``hub.save_model``).

These are pipelines over a whole model (they call :mod:`lowrank_jax.quantize.pipeline` and the
NF4 model pass), so they sit above ``models``; the layer itself,
:class:`lowrank_jax.nn.qlora.QLoRALinear`, and the per-projection
:func:`~lowrank_jax.nn.qlora.quantize_projections` stay in :mod:`lowrank_jax.nn.qlora`.

Example::

    >>> from lowrank_jax.models.presets import preset_model
    >>> quantize_base(preset_model("tiny"), "rtn4")["method"]
    'rtn4'
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowrank_jax.models.llama import replace_projections
from lowrank_jax.nn.projection import dense_matrix
from lowrank_jax.quant.layers import QuantizedLinear, check_dense
from lowrank_jax.quant.nf4 import NF4_BLOCK, NF4Linear, nf4_quantize
from lowrank_jax.quantize.pipeline import quantize_model
from lowrank_jax.quant.unisvq import UniSVQConfig, quantize_linear

QUANTIZE_METHODS = ("nf4", "rtn4", "unisvq2")


def nf4_quantize_model(model, *, block_size: int = NF4_BLOCK, double_quant: bool = False,
                       layers=None) -> list[str]:
    """Replace every dense projection of a Llama ``model`` by an :class:`NF4Linear` (in place).

    Returns the replaced paths. Raises ``ValueError`` for a non-dense projection or an input
    dim the block size does not divide.
    """
    def make(_i, _name, lin):
        w = dense_matrix(check_dense(lin), jnp.float32).T  # [out, in]
        return NF4Linear(nf4_quantize(w, block_size, double_quant=double_quant))

    return replace_projections(model, make, layers=layers)


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
        def make_lattice(_i, _name, lin):
            w = dense_matrix(check_dense(lin), jnp.float32).T  # [out, in]
            return QuantizedLinear(quantize_linear(w, None, UniSVQConfig()))

        done = replace_projections(model, make_lattice, layers=layers)
    return {"method": method, "quantized": len(done)}


__all__ = ["QUANTIZE_METHODS", "nf4_quantize_model", "quantize_base"]
