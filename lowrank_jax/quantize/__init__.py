"""The quantize application: whole models quantized, fine-tuned, saved and loaded back.

It sits above the model core; the quantizers of one matrix and the quantized layers stay in
:mod:`lowrank_jax.quant`, one floor below. By concern:

- :mod:`~lowrank_jax.quantize.pipeline`: :func:`quantize_model` (calibrate through the shared
  forward and capture, quantize each projection, fine-tune block by block), its accounting;
- :mod:`~lowrank_jax.quantize.e2e`: :func:`finetune_end_to_end`, UniSVQ's end-to-end stage;
- :mod:`~lowrank_jax.quantize.folder`: :func:`save_quantized` / :func:`load_quantized`, the
  folder format the hub reads;
- :mod:`~lowrank_jax.quantize.qlora_base`: :func:`quantize_base`, the frozen quantized base of
  QLoRA fine-tuning, saved by :func:`lowrank_jax.hub.save_model`.

Perplexity is the package's one :func:`lowrank_jax.models.perplexity`.
"""

from lowrank_jax.quantize.e2e import finetune_end_to_end
from lowrank_jax.quantize.folder import (
    FORMAT_VERSION,
    is_quantized_folder,
    load_quantized,
    save_quantized,
)
from lowrank_jax.quantize.pipeline import (
    QUANT_METHODS,
    UNISVQ_BITS,
    calibration_tokens,
    model_bits_per_weight,
    quantize_model,
)
from lowrank_jax.quantize.qlora_base import QUANTIZE_METHODS, quantize_base

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHODS",
    "QUANTIZE_METHODS",
    "UNISVQ_BITS",
    "calibration_tokens",
    "finetune_end_to_end",
    "is_quantized_folder",
    "load_quantized",
    "model_bits_per_weight",
    "quantize_base",
    "quantize_model",
    "save_quantized",
]
