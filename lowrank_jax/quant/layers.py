"""Quantized linear layers: :class:`QuantizedLinear` (UniSVQ lattice codes through the
``lattice_matmul`` kernel) and :class:`RTNLinear` (round-to-nearest baseline). They plug into a
Llama through :func:`lowrank_jax.models.llama.replace_projections` (extension point (b))."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from lowrank_jax.quant.packing import rtn_bits_per_weight, unisvq_bits_per_weight
from lowrank_jax.nn.projection import register_projection
from lowrank_jax.quant.rtn import RTNWeight, rtn_dequantize, rtn_quantize
from lowrank_jax.quant.unisvq import UniSVQConfig, UniSVQWeight, dequantize, quantize_linear
from pallas_kernels.lattice_matmul.api import lattice_matmul
from pallas_kernels.lattice_matmul.reference import block_hadamard, code_bits


class QuantCodes(nnx.Variable):
    """Frozen integer codes of a quantized layer (never trained)."""


class QuantScale(nnx.Param):
    """Per-channel float scales ``s_in`` / ``s_out`` (fine-tuned, lr ``lr_scale``)."""


class LatticeParam(nnx.Param):
    """The lattice transform ``A [4,4]`` and ``b [4]`` (fine-tuned, lr ``lr_affine``)."""


class QuantizedLinear(nnx.Module):
    """A bias-free linear layer whose weight is UniSVQ-quantized; ``y = x Wᵀ`` via the kernel API
    (2-bit ``uint8`` or 3-/4-bit ``uint16`` codes, the same kernel; ``bits`` says which).

    .. math::
        W = \\mathrm{diag}(s_{out}) H_m^\\top C H_n \\mathrm{diag}(s_{in}),\\quad
        C_{i,4g:4g+4} = A z_{i,g} + b

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from lowrank_jax.quant.unisvq import quantize_linear, UniSVQConfig
        >>> w = quantize_linear(jax.random.normal(jax.random.PRNGKey(0), (8, 16)), None,
        ...                     UniSVQConfig(hadamard_block=8))
        >>> QuantizedLinear.from_weight(w)(jnp.ones((2, 16))).shape
        (2, 8)

    Args:
        weight: a :class:`UniSVQWeight` (``[out, in]``).
        mode: ``"fold"`` or ``"dequant"`` (see ``pallas_kernels.lattice_matmul``).
        implementation: ``"auto"`` | ``"pallas"`` | ``"xla"``.
    """

    def __init__(self, weight: UniSVQWeight, *, mode: str = "fold",
                 implementation: str = "auto"):
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.block_in, self.block_out = int(weight.block_in), int(weight.block_out)
        self.mode, self.implementation = mode, implementation
        self.bits = code_bits(weight.codes, weight.bits)  # explicit digit width (2, 3 or 4)
        self.codes = QuantCodes(jnp.asarray(weight.codes))
        self.scale_in = QuantScale(jnp.asarray(weight.scale_in, jnp.float32))
        self.scale_out = QuantScale(jnp.asarray(weight.scale_out, jnp.float32))
        self.affine = LatticeParam(jnp.asarray(weight.affine, jnp.float32))
        self.offset = LatticeParam(jnp.asarray(weight.offset, jnp.float32))

    @classmethod
    def from_weight(cls, weight: UniSVQWeight, **kwargs) -> "QuantizedLinear":
        return cls(weight, **kwargs)

    def weight(self) -> UniSVQWeight:
        return UniSVQWeight(self.codes[...], self.scale_in[...], self.scale_out[...],
                            self.affine[...], self.offset[...], self.block_in, self.block_out,
                            self.bits)

    def bits_per_weight(self) -> float:
        return unisvq_bits_per_weight(self.out_features, self.in_features, bits=self.bits)

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        return lattice_matmul(
            x, self.codes[...], self.scale_in[...], self.scale_out[...], self.affine[...],
            self.offset[...], block_in=self.block_in, block_out=self.block_out, mode=self.mode,
            implementation=self.implementation, bits=self.bits,
        )


class RTNLinear(nnx.Module):
    """A bias-free linear layer holding group-wise RTN codes; dequantizes on the fly (baseline)."""

    def __init__(self, weight: RTNWeight):
        self.out_features, self.in_features = (int(s) for s in weight.codes.shape)
        self.bits, self.group_size = int(weight.bits), int(weight.group_size)
        self.zero_point = str(weight.zero_point)
        self.codes = QuantCodes(jnp.asarray(weight.codes, jnp.uint8))
        self.scale = QuantScale(jnp.asarray(weight.scale, jnp.float32))
        self.zero = QuantScale(jnp.asarray(weight.zero, jnp.float32))

    def weight(self) -> RTNWeight:
        return RTNWeight(self.codes[...], self.scale[...], self.zero[...], self.bits,
                         self.group_size, self.zero_point)

    def bits_per_weight(self) -> float:
        return rtn_bits_per_weight(self.out_features, self.in_features, self.bits,
                                   self.group_size, zero_point=self.zero_point)

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        w = rtn_dequantize(self.weight())
        return jnp.einsum("...n,mn->...m", x.astype(jnp.float32), w).astype(x.dtype)


class VQLinear(nnx.Module):
    """A bias-free linear layer holding k-means VQ codes (the VQ baseline of UniSVQ).

    Same rotated layout as :class:`QuantizedLinear`, but the 4-vector of code ``k`` is row ``k``
    of a free ``codebook [256, 4]`` (a gather) instead of ``A z + b``; the codebook is a
    :class:`LatticeParam` and fine-tunes like ``A``, ``b``.
    """

    def __init__(self, weight):
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.block_in, self.block_out = int(weight.block_in), int(weight.block_out)
        self.codes = QuantCodes(jnp.asarray(weight.codes, jnp.uint8))
        self.scale_in = QuantScale(jnp.asarray(weight.scale_in, jnp.float32))
        self.scale_out = QuantScale(jnp.asarray(weight.scale_out, jnp.float32))
        self.codebook = LatticeParam(jnp.asarray(weight.codebook, jnp.float32))

    def weight(self):
        from lowrank_jax.quant.kmeans_vq import VQWeight

        return VQWeight(self.codes[...], self.codebook[...], self.scale_in[...],
                        self.scale_out[...], self.block_in, self.block_out)

    def bits_per_weight(self) -> float:
        return self.weight().bits_per_weight()

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        lead, n = x.shape[:-1], x.shape[-1]
        x_rot = block_hadamard(x.reshape(-1, n).astype(jnp.float32) * self.scale_in[...],
                               self.block_in)
        table = self.codebook[...][self.codes[...].astype(jnp.int32)]  # m, n/4, 4 (gather)
        out = x_rot @ table.reshape(self.out_features, n).T
        y = block_hadamard(out, self.block_out, transpose=True) * self.scale_out[...]
        return y.astype(x.dtype).reshape(*lead, self.out_features)


def _fp16(x):
    return jnp.asarray(x, jnp.float32).astype(jnp.float16).astype(jnp.float32)


def round_floats_to_storage(layer) -> None:
    """Round the float parameters of a :class:`QuantizedLinear` / :class:`VQLinear` to fp16, so
    memory holds exactly what the folder stores."""
    names = ("scale_in", "scale_out") + (("codebook",) if isinstance(layer, VQLinear)
                                         else ("affine", "offset"))
    for name in names:
        getattr(layer, name).set_value(_fp16(getattr(layer, name)[...]))


def _rtn_requantize(layer: RTNLinear, matrix) -> RTNLinear:
    return RTNLinear(rtn_quantize(jnp.asarray(matrix, jnp.float32).T, layer.bits,
                                  layer.group_size, zero_point=layer.zero_point))


def _unisvq_requantize(layer: QuantizedLinear, matrix) -> QuantizedLinear:
    """Nearest-codeword UniSVQ (no calibration Hessians) with the layer's Hadamard block."""
    cfg = UniSVQConfig(hadamard_block=max(layer.block_in, layer.block_out))
    weight = quantize_linear(jnp.asarray(matrix, jnp.float32).T, None, cfg)
    return QuantizedLinear(weight, mode=layer.mode, implementation=layer.implementation)


# the quantized linears are projections of the protocol (lowrank_jax.nn.projection): apply_lora
# puts a QLoRALinear on them, merge_adapters merges into fp or re-quantizes with these
_LINEAR = dict(kernel=None, equation="...i,io->...o",
               shape=lambda m: (m.in_features, m.out_features))
register_projection(RTNLinear, dense=lambda m: rtn_dequantize(m.weight()).T,
                    requantize=_rtn_requantize, method="rtn", **_LINEAR)
register_projection(QuantizedLinear, dense=lambda m: dequantize(m.weight()).T,
                    requantize=_unisvq_requantize, method="unisvq", **_LINEAR)


def check_dense(linear) -> nnx.Linear:
    """``linear`` itself when it is a dense ``nnx.Linear``, the only projection a quantizer
    reads (its weight through :func:`lowrank_jax.nn.dense_matrix`); a clear error for any other
    layer (an adapted layer's ``dense_matrix`` would leave its adapter out)."""
    if not isinstance(linear, nnx.Linear):
        raise ValueError(
            f"quantize_model: found a {type(linear).__name__} projection; only dense nnx.Linear "
            "projections can be quantized (merge LoRA / load the dense model first)."
        )
    return linear


__all__ = ["LatticeParam", "QuantCodes", "QuantScale", "QuantizedLinear", "RTNLinear",
           "VQLinear", "check_dense", "round_floats_to_storage"]
