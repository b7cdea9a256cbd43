"""Quantize every projection of a :class:`~lowrank_jax.models.llama.Llama`, layer by layer.

``quantize_model`` walks the decoder blocks in order. For each block it runs the FP block on the
FP activations entering it, accumulates the input Hessian ``E[x xᵀ]`` of each projection (with
the package's one capture mechanism, :mod:`lowrank_jax.nn.capture`), replaces the 7 projections
by :class:`~lowrank_jax.quant.layers.QuantizedLinear` (UniSVQ) or
:class:`~lowrank_jax.quant.layers.RTNLinear` (through
:func:`~lowrank_jax.models.llama.replace_projections`), and (UniSVQ) fine-tunes the float
parameters on the block output error.

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from lowrank_jax.models.llama import (
    ATTENTION_PROJECTIONS,
    PROJECTIONS,
    Llama,
    embedding_scale,
    projections,
    replace_projections,
)
from lowrank_jax.nn.capture import capture
from lowrank_jax.nn.projection import dense_matrix
from lowrank_jax.quant.layers import (
    LatticeParam,
    QuantizedLinear,
    QuantScale,
    RTNLinear,
    VQLinear,
    check_dense,
    round_floats_to_storage,
)
from lowrank_jax.quant.rounding import hessian
from lowrank_jax.quant.rtn import check_bits, check_group_size, rtn_quantize
from lowrank_jax.quant.unisvq import UniSVQConfig, finetune_block, quantize_linear

QUANT_METHODS = ("unisvq", "rtn", "kmeans", "sq-ldlq")
CALIBRATED = ("unisvq", "kmeans", "sq-ldlq")  # methods that need calibration text
FINETUNED = ("unisvq", "kmeans")  # methods whose float parameters block fine-tuning trains
UNISVQ_BITS = (2, 3, 4)  # 2: z ∈ {0..3}⁴ (the paper); 3: {0..7}⁴ (4096); 4: {0..15}⁴ (65536)
METHOD_BITS = {"unisvq": UNISVQ_BITS, "rtn": (2, 3, 4, 8), "kmeans": (2,), "sq-ldlq": (2,)}


class _BlockApply:
    """Hashable ``(params, frozen, x) -> block(x)`` for one decoder-block structure, so the jitted
    fine-tuning step compiles once for all blocks with the same graph (and layer index: it picks
    the layer's window and RoPE base when the layers differ, e.g. Gemma 2/3)."""

    def __init__(self, graph, layer_idx: int = 0):
        self.graph, self.layer_idx = graph, layer_idx

    def __hash__(self):  # GraphDef holds an unhashable LlamaConfig; equality decides
        return hash((type(self.graph).__name__, self.layer_idx))

    def __eq__(self, other):
        return (isinstance(other, _BlockApply) and self.graph == other.graph
                and self.layer_idx == other.layer_idx)

    def __call__(self, params, frozen, x):
        block = nnx.merge(self.graph, params[0], params[1], frozen)
        return block(x, layer_idx=self.layer_idx)[0]


def _scale_affine_labels(params):
    return (jax.tree.map(lambda _: "scale", params[0]),
            jax.tree.map(lambda _: "affine", params[1]))


def _layer_outputs(layer, x: Array, chunk: int, layer_idx: int = 0) -> Array:
    """The decoder block applied to ``x`` in chunks of ``chunk`` sequences (positions 0..t-1)."""
    return jnp.concatenate([layer(x[s:s + chunk], layer_idx=layer_idx)[0]
                            for s in range(0, x.shape[0], chunk)])


def _capture_hessians(layer, x: Array, chunk: int,
                      layer_idx: int = 0) -> tuple[Array, dict[str, Array]]:
    """FP block output and ``E[x xᵀ]`` (undamped) of the input of every projection."""
    sums: dict[str, list] = {}

    def sink(path, inp, _):
        x2 = inp.reshape(-1, inp.shape[-1]).astype(jnp.float32)
        acc = sums.setdefault(path.rsplit("/", 1)[-1], [0.0, 0])
        acc[0] = acc[0] + x2.T @ x2
        acc[1] += x2.shape[0]

    paths = [f"{'self_attn' if p in ATTENTION_PROJECTIONS else 'mlp'}/{p}" for p in PROJECTIONS]
    with capture(layer, paths, keep_inputs=False, sink=sink):
        y = _layer_outputs(layer, x, chunk, layer_idx)
    return y, {name: total / count for name, (total, count) in sums.items()}


def _damped(h: Array, damp: float) -> Array:
    return h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(h.shape[0])


def quantize_model(
    model: Llama,
    calib_tokens: Int[Array, "n t"] | None,
    *,
    method: str = "unisvq",
    bits: int = 2,
    group_size: int | None = 64,
    zero_point: str = "integer",
    cfg: UniSVQConfig = UniSVQConfig(),
    layers: list[int] | None = None,
    sq_group_size: int = 192,
    keep_unfinetuned: bool = False,
    chunk: int = 8,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replace the projections of ``model`` (in place) by quantized layers; return a report.

    Args:
        model: a dense :class:`Llama`.
        calib_tokens: ``[n_seq, seq_len]`` int token ids (required for UniSVQ: Hessians and
            block fine-tuning; ignored by RTN).
        method: ``"unisvq"`` (2, 3 or 4 bits), ``"rtn"`` (2, 3, 4 or 8 bits), ``"kmeans"`` (2-bit
            k-means VQ baseline, a :class:`VQLinear`, fine-tuned like UniSVQ) or ``"sq-ldlq"``
            (the scalar 2-bit baseline of :mod:`lowrank_jax.quant.scalar_ldlq`, simulated: the
            dequantized weight stays in a dense layer; no fine-tuning, as GPTQ).
        bits: bits per weight of the codes.
        group_size: RTN group size (must divide every input dim); ignored by UniSVQ.
        zero_point: RTN form, ``"integer"`` (standard) or ``"float"`` (see :mod:`..rtn`).
        cfg: :class:`UniSVQConfig`.
        layers: indices of the blocks to quantize (default: all; ``--quick`` uses a subset).
        sq_group_size: ``"sq-ldlq"`` input coordinates per fp16 scale.
        keep_unfinetuned: also return, under ``"unfinetuned"``, the float parameters of every
            block *before* its fine-tuning (``{layer: (scales, lattice)}`` states): the codes do
            not depend on fine-tuning (each block is calibrated on FP activations), so
            ``nnx.update(model.layers[i], *state)`` gives the no-fine-tuning model for free.
        chunk: sequences per forward chunk (memory bound).
        progress: show a tqdm bar per block.
        log: optional callable for one line per block.

    Returns:
        ``{"method", "bits", "bits_per_weight", "seconds", "blocks": [...]}`` where
        ``bits_per_weight`` averages over the quantized weights (exact, see ``packing``).

    Example::

        >>> report = quantize_model(model, tokens, method="rtn", bits=4)  # doctest: +SKIP
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {QUANT_METHODS}.")
    check_bits(bits, METHOD_BITS[method], where=f"bits (method={method})")
    if method == "unisvq" and cfg.bits != bits:
        cfg = dataclasses.replace(cfg, bits=bits)
    n_layers = len(model.layers)
    layers = list(range(n_layers)) if layers is None else sorted(set(layers))
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers={bad} out of range for a {n_layers}-layer model.")
    if method == "rtn":
        for i, _, _, w in projections(model):
            if i in layers:
                check_group_size(group_size, check_dense(w).in_features)
    if method in CALIBRATED:
        if calib_tokens is None or np.asarray(calib_tokens).size == 0:
            raise ValueError(
                "calib_tokens is missing: UniSVQ needs calibration text for its Hessians and "
                "block fine-tuning; pass token ids [n_seq, seq_len] (e.g. from corpus_text())."
            )
        calib_tokens = jnp.asarray(calib_tokens, jnp.int32)
        if calib_tokens.ndim != 2:
            raise ValueError(
                f"calib_tokens has shape {calib_tokens.shape}; expected [n_seq, seq_len]."
            )

    biased = [f"layers/{i}/{name}" for i, name, _, lin in projections(model)
              if getattr(lin, "bias", None) is not None]
    if biased:
        raise ValueError(
            f"quantize_model: {biased[0]} (and {len(biased) - 1} more) has a bias (e.g. Qwen2's "
            f"q/k/v), which the bias-free {method} layers would drop; quantize a model without "
            "projection biases.")
    start = time.perf_counter()
    blocks_report = []
    total_bits = total_weights = 0.0
    x = None
    unfinetuned = {}
    if method in CALIBRATED:
        x = model.embed_tokens(calib_tokens).astype(jnp.dtype(model.cfg.dtype))
        if embedding_scale(model.cfg) is not None:  # Gemma's sqrt(d), as the forward does
            x = x * jnp.asarray(embedding_scale(model.cfg), x.dtype)
    # the layer index picks each layer's window / RoPE base when the layers differ
    index = (lambda i: 0) if model.cfg.uniform_layers else (lambda i: i)
    iterator = range(max(layers) + 1 if layers else 0)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(layers), desc=f"quantize {method}-{bits}", unit="block")
    key = jax.random.PRNGKey(cfg.seed)
    for i in iterator:
        layer = model.layers[i]
        if i not in layers:
            if x is not None:
                x = _layer_outputs(layer, x, chunk, index(i))
            continue
        t0 = time.perf_counter()
        info: dict[str, Any] = {"layer": i}
        if method == "rtn":
            def to_rtn(_, __, linear):
                nonlocal total_bits, total_weights
                w = dense_matrix(check_dense(linear), jnp.float32).T  # [out, in]
                new = RTNLinear(rtn_quantize(w, bits, group_size, zero_point))
                total_bits += new.bits_per_weight() * new.codes[...].size
                total_weights += new.codes[...].size
                return new

            replace_projections(model, to_rtn, layers=[i])
        else:
            y, hessians = _capture_hessians(layer, x, chunk, index(i))
            info["seconds_calibrate"] = time.perf_counter() - t0
            def to_quantized(layer_index, proj, linear):
                nonlocal total_bits, total_weights
                w = dense_matrix(check_dense(linear), jnp.float32).T
                h = _damped(hessians[proj], cfg.damp)
                sub_key = jax.random.fold_in(key, 7 * layer_index + PROJECTIONS.index(proj))
                new = None
                if method == "kmeans":
                    from lowrank_jax.quant.kmeans_vq import kmeans_vq_weight

                    new = VQLinear(kmeans_vq_weight(w, h, cfg, key=sub_key))
                    bpw = new.bits_per_weight()
                elif method == "sq-ldlq":
                    from lowrank_jax.quant.scalar_ldlq import sq_ldlq_quantize

                    w_hat, bpw = sq_ldlq_quantize(w, h, cfg, group_size=sq_group_size,
                                                  key=sub_key)
                    linear.kernel.set_value(w_hat.T.astype(linear.kernel[...].dtype))
                else:
                    new = QuantizedLinear(quantize_linear(w, h, cfg, key=sub_key))
                    bpw = new.bits_per_weight()
                total_bits += bpw * w.size
                total_weights += w.size
                return new

            replace_projections(model, to_quantized, layers=[i])
            info["seconds_round"] = time.perf_counter() - t0 - info["seconds_calibrate"]
            if method in FINETUNED and keep_unfinetuned:
                _, scales, lattice, _ = nnx.split(layer, QuantScale, LatticeParam, ...)
                unfinetuned[i] = jax.tree.map(jnp.copy, (scales, lattice))
            if cfg.finetune_steps > 0 and method in FINETUNED:
                graph, scales, lattice, rest = nnx.split(layer, QuantScale, LatticeParam, ...)
                best, ft = finetune_block(_BlockApply(graph, index(i)), (scales, lattice), x, y,
                                          cfg, frozen=rest, labels=_scale_affine_labels)
                nnx.update(layer, best[0], best[1])
                info.update(ft)
            for j, _, _, lin in projections(model):
                if j == i and isinstance(lin, (QuantizedLinear, VQLinear)):
                    round_floats_to_storage(lin)
            x = y
        info["seconds"] = time.perf_counter() - t0
        blocks_report.append(info)
        if log is not None:
            log(json.dumps(info))
        if bar is not None:
            bar.update(1)
            if "val_mse_after" in info:
                bar.set_postfix(mse=f"{info['val_mse_before']:.2e}->{info['val_mse_after']:.2e}")
    if bar is not None:
        bar.close()
    return {
        "method": method,
        "bits": bits,
        "group_size": group_size if method == "rtn" else None,
        "zero_point": zero_point if method == "rtn" else None,
        "bits_per_weight": total_bits / max(total_weights, 1.0),
        "seconds": time.perf_counter() - start,
        "layers": layers,
        "blocks": blocks_report,
        **({"unfinetuned": unfinetuned} if keep_unfinetuned else {}),
    }


def unfinetuned_model(model: Llama, report: dict[str, Any]) -> Llama:
    """The no-fine-tuning model of a ``quantize_model(..., keep_unfinetuned=True)`` run.

    The codes do not depend on block fine-tuning, so a copy of the fine-tuned ``model`` with
    every block's float parameters set back to ``report["unfinetuned"]`` (and rounded to their
    fp16 storage, as the pipeline does) is the model ``finetune_steps=0`` gives, without
    quantizing twice. ``model`` is not changed.
    """
    m0 = nnx.clone(model)
    for i, state in report["unfinetuned"].items():
        nnx.update(m0.layers[i], *state)
    for _, _, _, lin in projections(m0):
        if isinstance(lin, (QuantizedLinear, VQLinear)):
            round_floats_to_storage(lin)
    return m0


def model_bits_per_weight(model: Llama) -> float:
    """Average stored bits per projection weight (dense projections count 16)."""
    bits = weights = 0.0
    for _, _, _, lin in projections(model):
        if isinstance(lin, (QuantizedLinear, RTNLinear, VQLinear)):
            size = lin.in_features * lin.out_features
            bits += lin.bits_per_weight() * size
        else:
            size = lin.kernel[...].size
            bits += 16 * size
        weights += size
    return bits / weights


# the module whose captured input is each projection's input (q, k, v share one; gate, up too)
SHARED_INPUT = {"q_proj": "self_attn/q_proj", "k_proj": "self_attn/q_proj",
                "v_proj": "self_attn/q_proj", "o_proj": "self_attn/o_proj",
                "gate_proj": "mlp/gate_proj", "up_proj": "mlp/gate_proj",
                "down_proj": "mlp/down_proj"}


@contextlib.contextmanager
def dequantized_projections(
    model: Llama, layers: list[int],
    quantize: Callable[[int, str, Array], tuple[Array, float]],
):
    """Simulated quantization: inside the ``with`` block, every dense projection of ``layers``
    holds the dense weight ``w_hat`` of ``quantize(layer, name, w [out, in]) -> (w_hat,
    bits_per_weight)``; the original kernels come back when the block ends.

    Yields:
        ``{(layer, name): (w, w_hat, bits_per_weight)}`` (filled before the block runs).
    """
    targets = [(i, name, lin) for i, name, _, lin in projections(model) if i in layers]
    originals = {(i, name): lin.kernel[...] for i, name, lin in targets}
    done = {}
    try:
        for i, name, lin in targets:
            w = dense_matrix(check_dense(lin), jnp.float32).T
            w_hat, bpw = quantize(i, name, w)
            done[(i, name)] = (w, w_hat, bpw)
            lin.kernel[...] = w_hat.T.astype(lin.kernel[...].dtype)
        yield done
    finally:
        for i, name, lin in targets:
            lin.kernel[...] = originals[(i, name)]


def calibration_hessians(model, tokens, paths, *, damp: float = 1e-2,
                         batch_size: int = 8) -> dict[str, Array]:
    """Damped input Hessians ``E[x xᵀ]`` of the modules at ``paths``, over ``tokens`` windows.

    The model runs on ``tokens [n, t]`` ``batch_size`` windows at a time; the inputs of every
    named module are captured (:func:`lowrank_jax.nn.capture.capture`) and reduced with
    :func:`lowrank_jax.quant.rounding.hessian` (damping ``damp · mean(diag)``).

    Args:
        model: any NNX model called as ``model(tokens)``.
        tokens: ``[n, t]`` token ids (e.g. :func:`calibration_tokens`).
        paths: module paths such as ``"layers/0/self_attn/q_proj"`` (q, k and v share one input).
        damp: relative diagonal damping; batch_size: windows per forward.

    Returns:
        ``{path: [in, in]}``.

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
        ...                           n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> h = calibration_hessians(model, np.zeros((3, 4), np.int32),
        ...                          ["layers/0/mlp/down_proj"])["layers/0/mlp/down_proj"]
        >>> h.shape, bool(jnp.allclose(h, h.T))
        ((16, 16), True)
    """
    with capture(model, list(paths)) as recorder:
        for i in range(0, len(tokens), batch_size):
            model(jnp.asarray(tokens[i:i + batch_size]))
    return {p: hessian(jnp.concatenate([x.reshape(-1, x.shape[-1]) for x in recorder.inputs[p]]),
                       damp=damp) for p in paths}


def calibration_tokens(tokenizer, text: str, n_seq: int, seq_len: int, seed: int = 0):
    """``[n_seq, seq_len]`` windows of the tokenized ``text`` at sorted random offsets."""
    if not text or not text.strip():
        raise ValueError("calibration text is empty; pass English text "
                         "(--calib-file on the command line).")
    ids = np.asarray(tokenizer.encode(text) if tokenizer is not None
                     else list(text.encode("utf-8")), np.int32)
    if len(ids) < n_seq * seq_len // 2 or len(ids) <= seq_len:
        raise ValueError(
            f"calibration text has {len(ids)} tokens, too few for `n_seq` {n_seq} × "
            f"`seq_len` {seq_len}; give longer calibration text or lower them."
        )
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(len(ids) - seq_len, size=n_seq, replace=len(ids) - seq_len < n_seq))
    return np.stack([ids[s:s + seq_len] for s in starts])


__all__ = ["CALIBRATED", "FINETUNED", "METHOD_BITS", "QUANT_METHODS", "SHARED_INPUT", "UNISVQ_BITS",
           "calibration_hessians", "calibration_tokens", "dequantized_projections",
           "model_bits_per_weight", "quantize_model", "unfinetuned_model"]
