"""Weight quantization: UniSVQ 2-bit lattice codes, the RTN baseline, packing and accounting."""

from lowrank_jax.quant.packing import (
    codes_to_words,
    pack_bits,
    pack_codes,
    rtn_bits_per_weight,
    unisvq_bits_per_weight,
    unpack_bits,
    unpack_codes,
    vq_bits_per_weight,
    words_to_codes,
)
from lowrank_jax.quant.kmeans_vq import VQWeight, kmeans_vq_weight, vq_dequantize
from lowrank_jax.quant.rtn import (
    SUPPORTED_BITS,
    ZERO_POINTS,
    RTNWeight,
    rtn_dequantize,
    rtn_quantize,
)
from lowrank_jax.quant.projections import (
    QuantizedProjection,
    quantize_matrix,
    quantize_projections,
)
from lowrank_jax.quant.scalar_ldlq import sq_bits_per_weight, sq_ldlq_quantize
from lowrank_jax.quant.lattice import initial_lattice, make_grid, nearest_codeword
from lowrank_jax.quant.rounding import hessian, inverse_rht, ldlq, ldlq_quantize, proxy_loss, rht
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    UniSVQWeight,
    dequantize,
    finetune_block,
    quantize_linear,
)

__all__ = [
    "QuantizedProjection",
    "quantize_matrix",
    "quantize_projections",
    "RTNWeight",
    "SUPPORTED_BITS",
    "UniSVQConfig",
    "UniSVQWeight",
    "VQWeight",
    "ZERO_POINTS",
    "codes_to_words",
    "dequantize",
    "finetune_block",
    "hessian",
    "initial_lattice",
    "inverse_rht",
    "kmeans_vq_weight",
    "ldlq",
    "ldlq_quantize",
    "make_grid",
    "nearest_codeword",
    "pack_bits",
    "pack_codes",
    "proxy_loss",
    "quantize_linear",
    "rht",
    "rtn_bits_per_weight",
    "rtn_dequantize",
    "rtn_quantize",
    "sq_bits_per_weight",
    "sq_ldlq_quantize",
    "unisvq_bits_per_weight",
    "unpack_bits",
    "unpack_codes",
    "vq_bits_per_weight",
    "vq_dequantize",
    "words_to_codes",
]
