"""Quantized Llama models: one import for the layers, the pipeline and the folder format.

The code is split by concern: :mod:`lowrank_jax.quant.layers` (``QuantizedLinear``,
``RTNLinear``), :mod:`lowrank_jax.quant.pipeline` (``quantize_model``: calibrate through the
shared forward and capture, quantize, fine-tune block by block) and :mod:`lowrank_jax.quant.io`
(``save_quantized`` / ``load_quantized``). Perplexity is the package's one
:func:`lowrank_jax.models.perplexity`.
"""

from lowrank_jax.quant.io import FORMAT_VERSION, is_quantized_folder, load_quantized, save_quantized
from lowrank_jax.quant.layers import (
    LatticeParam,
    QuantCodes,
    QuantizedLinear,
    QuantScale,
    RTNLinear,
    VQLinear,
)
from lowrank_jax.quant.pipeline import METHODS, UNISVQ_BITS, model_bits_per_weight, quantize_model

__all__ = [
    "FORMAT_VERSION",
    "LatticeParam",
    "METHODS",
    "QuantCodes",
    "QuantScale",
    "QuantizedLinear",
    "RTNLinear",
    "UNISVQ_BITS",
    "VQLinear",
    "is_quantized_folder",
    "load_quantized",
    "model_bits_per_weight",
    "quantize_model",
    "save_quantized",
]
