"""UniSVQ: 2-bit (or 3-, 4-bit) weights as an affine image of the integer lattice ``{0,1,2,3}⁴``.

A weight ``W [m, n]`` (``y = W x``) is stored as

.. math::
    W ≈ \\mathrm{diag}(s_{out})\\, H_m^\\top C\\, H_n\\, \\mathrm{diag}(s_{in}),\\qquad
    C_{i,4g:4g+4} = A z_{i,g} + b,\\; z_{i,g} ∈ \\{0,1,2,3\\}^4

with block-diagonal Hadamards ``H``, one ``A [4,4]``, ``b [4]`` per matrix, and one ``uint8`` code
per 4 weights (``2 + 16(m+n+20)/(mn)`` bits per weight). The 3-bit variant
(``UniSVQConfig(bits=3)``) uses ``z ∈ {0..7}⁴`` (4096 codewords, one 12-bit code per 4 weights,
``uint16`` in memory, a 12-bit stream on disk: ``3 + 16(m+n+20)/(mn)`` bits per weight); the
4-bit variant (``bits=4``) uses ``z ∈ {0..15}⁴`` (65536 codewords, one ``uint16`` code per 4
weights, ``4 + 16(m+n+20)/(mn)``). The digit width is explicit metadata of the weight
(:attr:`UniSVQWeight.bits`), since ``uint16`` holds both 3- and 4-bit codes. The pipeline:

1. randomized Hadamard transform (random signs folded into ``s_in``/``s_out``) + RMS scaling;
2. LDLQ (Hessian-aware rounding, GPTQ/QuIP#-style) with the calibration Hessian ``E[x xᵀ]``,
   followed by ``tune_iters`` passes of block coordinate descent;
3. block-wise fine-tuning of the float parameters on the block output error
   (:func:`finetune_block`; the model-level driver is :mod:`lowrank_jax.quantize`).

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
    Tseng et al, `QuIP#: Even Better LLM Quantization with Hadamard Incoherence and Lattice
    Codebooks <https://arxiv.org/abs/2402.04396>`_, 2024.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, UInt

from lowrank_jax.core.loop import run_steps
from lowrank_jax.core.step import make_step

from lowrank_jax.quant.lattice import (  # noqa: F401 (re-exported: the public lattice API)
    GAUSSIAN_STEP_3BIT,
    GAUSSIAN_STEP_4BIT,
    LATTICE_BITS,
    LATTICE_SIGMA,
    all_digits,
    check_lattice_bits,
    code_dtype,
    decode_grouped,
    initial_lattice,
    lattice_sigma,
    make_grid,
    nearest_codeword,
    random_orthogonal,
    refit_lattice,
    round_to_lattice,
)
from lowrank_jax.quant.rounding import (  # noqa: F401 (re-exported: the rotated-quantizer toolkit)
    block_ldl,
    hessian,
    inverse_rht,
    ldlq,
    ldlq_quantize,
    proxy_loss,
    random_signs,
    rht,
    rotate_problem,
)
from lowrank_jax.quant.packing import unisvq_bits_per_weight
from pallas_kernels.lattice_matmul.reference import (
    block_hadamard,
    code_bits,
    dequantize_reference,
    hadamard_block_size,
)


@dataclasses.dataclass(frozen=True)
class UniSVQConfig:
    """Settings of :func:`quantize_linear` and :func:`finetune_block`.

    Attributes:
        hadamard_block: largest Hadamard block; the block used for a dim is the largest power of
            two ``≤ hadamard_block`` dividing it (DERIVED, see ``hadamard_block_size``).
        rotation: ``"random"`` (a fixed random orthogonal ``O``: the tuneable codebook) or
            ``"identity"`` (the plain codebook = the uniform 2-bit grid per coordinate).
        damp: Hessian damping, ``damp · mean(diag H) · I`` is added.
        tune_iters: passes of block coordinate descent after LDLQ.
        use_hessian: ``False`` gives plain nearest-codeword rounding (the ablation).
        finetune_steps: Adam steps per block (0 = no fine-tuning).
        lr_scale: learning rate of ``s_in``/``s_out``; lr_affine: of ``A``/``b``.
        finetune_batch: calibration sequences per Adam step.
        seed: seed of the Hadamard signs and of ``O``.
        bits: bits per lattice digit, 2 (``{0..3}⁴``, 256 codewords), 3 (``{0..7}⁴``, 4096) or
            4 (``{0..15}⁴``, 65536).
        affine_groups: ``G`` contiguous row groups of the rotated weight, each with its own
            ``A_g [4,4]``, ``b_g [4]`` (:func:`quantize_linear_grouped`; 1 = one per matrix).
            ``G > 1`` weights are dense-dequantized (:func:`dequantize`): the lattice kernel
            and :class:`~lowrank_jax.quant.layers.QuantizedLinear` take one ``A``, ``b``.
        lattice_refit: closed-form refits of ``A_g``, ``b_g`` to the codes
            (:func:`refit_lattice`), with an exhaustive re-rounding between two refits
            (0 = the lattice stays ``step·O``, scaled per group, until block fine-tuning).
    """

    hadamard_block: int = 128
    rotation: str = "random"
    damp: float = 1e-2
    tune_iters: int = 10
    use_hessian: bool = True
    finetune_steps: int = 50
    lr_scale: float = 5e-4
    lr_affine: float = 5e-5
    finetune_batch: int = 4
    seed: int = 0
    bits: int = 2
    affine_groups: int = 1
    lattice_refit: int = 0

    def __post_init__(self):
        check_lattice_bits(self.bits)
        if self.affine_groups < 1 or self.lattice_refit < 0:
            raise ValueError(
                f"affine_groups={self.affine_groups} must be ≥ 1 and "
                f"lattice_refit={self.lattice_refit} ≥ 0."
            )
        if self.rotation not in ("random", "identity"):
            raise ValueError(f"rotation={self.rotation!r} must be 'random' or 'identity'.")
        if self.tune_iters < 0 or self.finetune_steps < 0:
            raise ValueError(
                f"tune_iters={self.tune_iters} and finetune_steps={self.finetune_steps} "
                "must be ≥ 0."
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UniSVQWeight:
    """A quantized matrix ``[m, n]``; array fields are pytree leaves, block sizes and the digit
    width ``bits`` are static metadata (``bits=None`` infers 2 from ``uint8`` codes, 3 from
    ``uint16``: the historical layouts; 4-bit codes must say ``bits=4``).

    ``affine [G, 4, 4]`` and ``offset [G, 4]`` (from :func:`quantize_linear_grouped`) give each of
    ``G`` contiguous row groups of the rotated weight its own lattice; :func:`dequantize` reads
    both layouts, the lattice kernel only the per-matrix one."""

    codes: UInt[Array, "m q"]
    scale_in: Float[Array, " n"]
    scale_out: Float[Array, " m"]
    affine: Float[Array, "*g 4 4"]
    offset: Float[Array, "*g 4"]
    block_in: int = dataclasses.field(metadata=dict(static=True), default=128)
    block_out: int = dataclasses.field(metadata=dict(static=True), default=128)
    bits: int | None = dataclasses.field(metadata=dict(static=True), default=None)

    def __post_init__(self):
        if self.bits is None:  # resolved once; unflatten always passes the stored value
            self.bits = code_bits(self.codes)
        else:
            self.bits = code_bits(self.codes, int(self.bits))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 4

    @property
    def groups(self) -> int:
        """Row groups with their own ``A``, ``b`` (1 for the per-matrix layout)."""
        return 1 if self.affine.ndim == 2 else int(self.affine.shape[0])

    def bits_per_weight(self) -> float:
        """:func:`~lowrank_jax.quant.packing.unisvq_bits_per_weight` plus ``20·16`` bits (fp16
        ``A_g``, ``b_g``) for every group after the first."""
        m, n = self.shape
        return unisvq_bits_per_weight(m, n, bits=self.bits) + 16 * 20 * (self.groups - 1) / (m * n)


def quantize_linear(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    key: Array | None = None,
) -> UniSVQWeight:
    """RHT + RMS scale + LDLQ of one matrix ``W [out, in]`` (``y = W x``).

    Args:
        weight: ``[m, n]``, both divisible by 4.
        h: calibration Hessian ``E[x xᵀ]`` of the **unrotated** inputs ``[n, n]`` (or ``None``).
        cfg: :class:`UniSVQConfig`.
        key: PRNG key of the signs and ``O`` (default ``PRNGKey(cfg.seed)``).

    Returns:
        A :class:`UniSVQWeight`; :func:`dequantize` gives the dense approximation.

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
        >>> q = quantize_linear(w, None, UniSVQConfig(hadamard_block=8))
        >>> dequantize(q).shape
        (8, 16)
    """
    m, n = weight.shape
    if m % 4 or n % 4:
        raise ValueError(f"weight shape {weight.shape}: both dims must be divisible by 4.")
    key = jax.random.PRNGKey(cfg.seed) if key is None else key
    block_out = hadamard_block_size(m, cfg.hadamard_block)
    block_in = hadamard_block_size(n, cfg.hadamard_block)
    if h is not None and h.shape != (n, n):
        raise ValueError(f"hessian shape {h.shape} does not match the weight's n={n}.")
    use_h = h is not None and cfg.use_hessian
    if cfg.affine_groups > 1 or cfg.lattice_refit > 0:
        q = quantize_linear_grouped(weight, h, cfg, key=key)
        if q.groups == 1:  # one group: the per-matrix layout the kernel reads
            q = dataclasses.replace(q, affine=q.affine[0], offset=q.offset[0])
        return q
    arrays = _quantize_core(weight.astype(jnp.float32), h if use_h else None, key, cfg,
                            block_in, block_out)
    return UniSVQWeight(*arrays, block_in, block_out, cfg.bits)


def quantize_linear_grouped(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    groups: int | None = None,
    key: Array | None = None,
) -> UniSVQWeight:
    """UniSVQ with one lattice ``A_g``, ``b_g`` per group of ``m/G`` contiguous rotated rows.

    Same RHT, RMS scale and LDLQ as :func:`quantize_linear`; group ``g`` starts from its own
    scaled lattice ``A_g = r_g·step·O``, ``b_g = r_g·b`` with ``r_g`` the RMS of its rotated rows
    (LDLQ treats rows independently, so this is LDLQ of ``W_r,g / r_g`` on the shared lattice).
    Then ``cfg.lattice_refit`` rounds of :func:`refit_lattice` (Hessian-weighted least squares of
    every ``A_g``, ``b_g`` given the codes), with an exhaustive LDLQ re-rounding onto the refitted
    lattices between two refits. Rows of one output Hadamard block are mixed by the rotation, so
    groups that follow the blocks (``G = m / block_out``) follow the rotated weight's scales.
    Storage: ``20·16`` more bits per extra group (:meth:`UniSVQWeight.bits_per_weight`).

    Args:
        weight: ``[m, n]``, both divisible by 4, ``m`` divisible by ``groups``.
        h: calibration Hessian of the unrotated inputs ``[n, n]`` (or ``None``).
        cfg: :class:`UniSVQConfig` (``affine_groups`` unless ``groups`` is given).
        groups: number of row groups ``G``.
        key: PRNG key of the signs and ``O`` (default ``PRNGKey(cfg.seed)``).

    Returns:
        A :class:`UniSVQWeight` with ``affine [G, 4, 4]``, ``offset [G, 4]``.

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
        >>> q = quantize_linear_grouped(w, None, UniSVQConfig(hadamard_block=8), groups=2)
        >>> q.affine.shape, dequantize(q).shape
        ((2, 4, 4), (8, 16))
    """
    m, n = weight.shape
    groups = cfg.affine_groups if groups is None else int(groups)
    if m % 4 or n % 4:
        raise ValueError(f"weight shape {weight.shape}: both dims must be divisible by 4.")
    if groups < 1 or m % groups:
        raise ValueError(f"groups={groups} must be ≥ 1 and divide the weight's m={m} rows.")
    if cfg.lattice_refit > 1 and cfg.bits > 3:
        raise ValueError("lattice_refit > 1 re-rounds exhaustively over 16^bits codewords; "
                         f"bits={cfg.bits} has 65536: use lattice_refit ≤ 1.")
    if h is not None and h.shape != (n, n):
        raise ValueError(f"hessian shape {h.shape} does not match the weight's n={n}.")
    key = jax.random.PRNGKey(cfg.seed) if key is None else key
    block_out = hadamard_block_size(m, cfg.hadamard_block)
    block_in = hadamard_block_size(n, cfg.hadamard_block)
    use_h = h is not None and cfg.use_hessian
    arrays = _grouped_core(weight.astype(jnp.float32), h if use_h else None, key, cfg,
                           block_in, block_out, groups)
    return UniSVQWeight(*arrays, block_in, block_out, cfg.bits)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _grouped_core(weight, h, key, cfg: UniSVQConfig, block_in: int, block_out: int,
                  groups: int):
    m, n = weight.shape
    rows = m // groups
    k_rot = jax.random.split(key, 3)[2]
    w_rot, w_scale, s_in, s_out, h_rot = rotate_problem(weight, h, key, block_in, block_out)
    rotation = random_orthogonal(k_rot) if cfg.rotation == "random" else None
    a0, b0 = initial_lattice(rotation, cfg.bits)
    r = jnp.sqrt(jnp.mean(w_rot.reshape(groups, rows * n) ** 2, axis=1))
    r = jnp.where(r > 0, r, 1.0)
    target = w_rot / jnp.repeat(r, rows)[:, None]
    lower = None
    if h_rot is None:
        codes = round_to_lattice(target.reshape(m, n // 4, 4), a0, b0, cfg.bits)
        codes = codes.astype(code_dtype(cfg.bits))
    else:
        lower, _ = block_ldl(h_rot)
        codes, _ = ldlq(target, h_rot, lower, tune_iters=cfg.tune_iters, lattice=(a0, b0),
                        bits=cfg.bits)
    affine = r[:, None, None] * a0[None]
    offset = r[:, None] * b0[None]
    for i in range(cfg.lattice_refit):
        if i > 0:
            codes = _round_groups(w_rot, h_rot, lower, affine, offset, cfg.tune_iters, cfg.bits)
        affine, offset = refit_lattice(w_rot, h_rot, codes, affine, offset, bits=cfg.bits)
    return codes, s_in, s_out * w_scale, affine, offset


def _round_groups(w_rot, h_rot, lower, affine, offset, tune_iters: int, bits: int):
    """LDLQ (or nearest codeword, ``h_rot=None``) of each row group onto its own lattice."""
    groups = affine.shape[0]
    m, n = w_rot.shape
    grids = jax.vmap(lambda a, b: make_grid(a, b, bits))(affine, offset)
    w_g = w_rot.reshape(groups, m // groups, n)
    if h_rot is None:
        codes = jax.vmap(lambda w, g: nearest_codeword(w.reshape(-1, n // 4, 4), g))(w_g, grids)
    else:
        codes = jax.vmap(
            lambda w, g: ldlq(w, h_rot, lower, g, tune_iters=tune_iters, bits=bits)[0])(w_g, grids)
    return codes.reshape(m, n // 4).astype(code_dtype(bits))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _quantize_core(weight, h, key, cfg: UniSVQConfig, block_in: int, block_out: int):
    m, n = weight.shape
    k_rot = jax.random.split(key, 3)[2]
    w_rot, w_scale, s_in, s_out, h_rot = rotate_problem(weight, h, key, block_in, block_out)
    rotation = random_orthogonal(k_rot) if cfg.rotation == "random" else None
    affine, offset = initial_lattice(rotation, cfg.bits)
    # A = step·O is scaled orthogonal before fine-tuning, so the nearest of the 16^bits codewords
    # is an exact coordinate rounding (round_to_lattice): no search over the codebook. For 2 bits
    # this equals the exhaustive search over the 256 codewords (up to float ties; tested) and
    # makes LDLQ's rounding O(4) instead of O(256) per 4-vector.
    if h is None:
        codes = round_to_lattice(w_rot.reshape(m, n // 4, 4), affine, offset, cfg.bits)
        codes = codes.astype(code_dtype(cfg.bits))
    else:
        lower, _ = block_ldl(h_rot)
        codes, _ = ldlq(w_rot, h_rot, lower, tune_iters=cfg.tune_iters,
                        lattice=(affine, offset), bits=cfg.bits)
    return codes, s_in, s_out * w_scale, affine, offset


def dequantize(w: UniSVQWeight) -> Float[Array, "m n"]:
    """Dense fp32 ``[m, n]`` of a :class:`UniSVQWeight` (the reference weight; per-matrix or
    per-group ``A``, ``b``)."""
    if w.affine.ndim == 3:
        c = decode_grouped(w.codes, w.affine, w.offset, w.bits)
        c = block_hadamard(c, w.block_in)  # C Hn
        c = block_hadamard(c.T, w.block_out, transpose=True).T  # Hmᵀ C Hn
        return (w.scale_out[:, None].astype(jnp.float32) * c
                * w.scale_in[None, :].astype(jnp.float32))
    return dequantize_reference(
        w.codes, w.scale_in, w.scale_out, w.affine, w.offset,
        block_in=w.block_in, block_out=w.block_out, bits=w.bits,
    )


def _all_scale_labels(params):
    return jax.tree.map(lambda _: "scale", params)


def _make_tx(labels, lr_scale: float, lr_affine: float):
    return optax.multi_transform(
        {"scale": optax.adam(lr_scale), "affine": optax.adam(lr_affine)}, labels
    )


def _mse(block_fn, params, frozen, x, y):
    out = block_fn(params, frozen, x)
    return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


@functools.partial(jax.jit, static_argnums=(0,))
def _val_mse(block_fn, params, frozen, x, y):
    return _mse(block_fn, params, frozen, x, y)


@functools.lru_cache(maxsize=64)
def _block_step(block_fn, labels, lr_scale, lr_affine):
    """The fine-tuning step of ``block_fn`` (:func:`~lowrank_jax.core.step.make_step` on the
    MSE), one compiled step per block function and learning rates, as a static jit argument
    would give."""
    return make_step(functools.partial(_mse, block_fn), _make_tx(labels, lr_scale, lr_affine))


def finetune_block(
    block_fn: Callable[[Any, Any, Array], Array],
    params: Any,
    calib_in: Array,
    calib_out: Array,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    frozen: Any = None,
    labels: Callable[[Any], Any] | None = None,
    val_fraction: float = 0.25,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Any, dict]:
    """Minimize ``MSE(block_fn(params, frozen, X), Y)`` with Adam over the float parameters.

    .. math::
        \\min_{s_{in}, s_{out}, A, b}\\; \\| \\mathrm{block}_q(X) - \\mathrm{block}_{fp}(X) \\|^2

    The integer codes live in ``frozen`` (or in ``block_fn``) and never change. Two learning
    rates: leaves labelled ``"scale"`` use ``cfg.lr_scale``, ``"affine"`` use ``cfg.lr_affine``.
    The parameters with the best MSE on a held-out slice of the calibration sequences are
    returned (the code's keep-best rule, checked 5 times per run).

    Args:
        block_fn: ``(params, frozen, x [b, ...]) -> y``; pure, differentiable in ``params``, and
            hashable (it is a static jit argument: reuse one object to reuse the compilation).
        params: trainable float pytree.
        calib_in, calib_out: FP block inputs/outputs ``[N, ...]`` (first axis = sequences).
        cfg: steps, learning rates, batch, seed.
        frozen: non-trained pytree passed through to ``block_fn``.
        labels: hashable callable ``params -> pytree of "scale" | "affine"`` (default: all scale).
        val_fraction: fraction of sequences held out for model selection.
        progress: optional callback ``(step, train_mse)``.

    Returns:
        ``(best_params, {"val_mse_before", "val_mse_after", "steps"})``.

    Example::

        >>> import jax.numpy as jnp
        >>> fn = lambda p, f, x: x * p["s"]
        >>> x = jnp.ones((8, 3))
        >>> p, info = finetune_block(fn, {"s": jnp.ones(3)}, x, 2 * x,
        ...                          UniSVQConfig(finetune_steps=20, lr_scale=0.1))
        >>> info["val_mse_after"] < info["val_mse_before"]
        True
    """
    n_seq = calib_in.shape[0]
    n_val = max(1, int(round(n_seq * val_fraction))) if n_seq > 1 else 0
    train_x, train_y = calib_in[: n_seq - n_val], calib_out[: n_seq - n_val]
    val_x, val_y = (calib_in[n_seq - n_val:], calib_out[n_seq - n_val:]) if n_val else (
        calib_in, calib_out)
    labels = _all_scale_labels if labels is None else labels
    state = _make_tx(labels, cfg.lr_scale, cfg.lr_affine).init(params)
    best = params
    best_val = before = float(_val_mse(block_fn, params, frozen, val_x, val_y))
    batch = max(1, min(cfg.finetune_batch, train_x.shape[0]))
    rng = np.random.default_rng(cfg.seed)

    def batches(t):
        rows = np.sort(rng.choice(train_x.shape[0], size=batch, replace=False))
        return frozen, train_x[rows], train_y[rows]

    def keep_best(p):
        nonlocal best, best_val
        v = float(_val_mse(block_fn, p, frozen, val_x, val_y))
        if v < best_val:
            best, best_val = p, v
        return v

    def report(run):
        if progress is not None:
            progress(run.step - 1, run.loss)

    # keep-best fine-tuning: a non-finite step is skipped, the best checked parameters returned
    run_steps(_block_step(block_fn, labels, cfg.lr_scale, cfg.lr_affine), params, state,
              batches, steps=cfg.finetune_steps, nonfinite="skip", what="unisvq block fine-tune",
              evaluate=keep_best, eval_every=max(1, cfg.finetune_steps // 5),
              on_step=report)
    return best, {"val_mse_before": before, "val_mse_after": best_val,
                  "steps": cfg.finetune_steps}


__all__ = [
    "GAUSSIAN_STEP_3BIT",
    "GAUSSIAN_STEP_4BIT",
    "LATTICE_BITS",
    "LATTICE_SIGMA",
    "UniSVQConfig",
    "UniSVQWeight",
    "all_digits",
    "block_ldl",
    "check_lattice_bits",
    "code_dtype",
    "decode_grouped",
    "dequantize",
    "finetune_block",
    "hessian",
    "initial_lattice",
    "inverse_rht",
    "lattice_sigma",
    "ldlq",
    "ldlq_quantize",
    "make_grid",
    "nearest_codeword",
    "proxy_loss",
    "quantize_linear",
    "quantize_linear_grouped",
    "random_orthogonal",
    "random_signs",
    "refit_lattice",
    "rht",
    "rotate_problem",
    "round_to_lattice",
]
