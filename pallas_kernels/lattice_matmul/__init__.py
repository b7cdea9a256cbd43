"""UniSVQ lattice matmul: fused 2- or 3-bit unpack + (affine decode | affine fold) + matmul."""

from pallas_kernels.lattice_matmul.api import (
    IMPLEMENTATIONS,
    MODES,
    BlockSizes,
    code_matmul,
    lattice_matmul,
)
from pallas_kernels.lattice_matmul.reference import (
    block_hadamard,
    code_matmul_reference,
    decode_codes,
    dequantize_reference,
    fold_activations,
    hadamard_block_size,
    hadamard_matrix,
    lattice_matmul_reference,
    unpack_codes,
)

__all__ = [
    "BlockSizes",
    "IMPLEMENTATIONS",
    "MODES",
    "block_hadamard",
    "code_matmul",
    "code_matmul_reference",
    "decode_codes",
    "dequantize_reference",
    "fold_activations",
    "hadamard_block_size",
    "hadamard_matrix",
    "lattice_matmul",
    "lattice_matmul_reference",
    "unpack_codes",
]
