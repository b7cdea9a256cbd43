"""End-to-end tuning of a quantized model's continuous parameters against the full-precision model.

After block-wise quantization (:func:`lowrank_jax.quantize.pipeline.quantize_model`) every block
was fitted to the FP block's output on *FP* inputs; errors still add up across blocks. This pass
(beyond the UniSVQ paper) tunes, on the calibration tokens, only what is continuous: the scales
``s_in``/``s_out``, the lattice ``A``/``b`` (or a VQ codebook, an RTN scale) and the RMSNorm
weights, to minimize the KL divergence from the FP model's next-token distribution:

.. math::
    \\min_{s, A, b, g}\\; \\mathbb{E}_t\\, \\mathrm{KL}\\big(p_{fp}(\\cdot \\mid x_{<t}) \\,\\|\\,
    p_q(\\cdot \\mid x_{<t})\\big)

The integer codes never change, so the bits per weight stay the same. Like
:func:`lowrank_jax.quant.unisvq.finetune_block`, the parameters with the lowest loss on a
held-out slice of the calibration sequences are kept.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Int

from lowrank_jax.core.loop import run_steps
from lowrank_jax.core.step import make_step
from lowrank_jax.models.llama import Llama, projections
from lowrank_jax.quant.layers import (
    LatticeParam,
    QuantizedLinear,
    QuantScale,
    VQLinear,
    round_floats_to_storage,
)


def _is_norm(path, value) -> bool:
    return isinstance(value, nnx.Param) and any(str(k).endswith("norm") for k in path)


def _kl(teacher_logits: Array, student_logits: Array) -> Array:
    """Mean over tokens of ``KL(softmax(teacher) ‖ softmax(student))``."""
    p_log = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    q_log = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1))


def finetune_end_to_end(
    model: Llama,
    reference: Llama,
    calib_tokens: Int[Array, "n t"],
    *,
    steps: int = 20,
    lr_scale: float = 1e-4,
    lr_affine: float = 1e-5,
    lr_norm: float = 1e-4,
    batch: int = 4,
    val_fraction: float = 0.25,
    seed: int = 0,
    cache_teacher: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tune ``model``'s scales, lattice/codebook floats and norms (in place) against ``reference``.

    Args:
        model: a quantized :class:`Llama` (after ``quantize_model``).
        reference: the full-precision model it was quantized from (the teacher; not changed).
        calib_tokens: ``[n_seq, seq_len]`` calibration token ids (at least 2 sequences: one
            quarter is held out to pick the best parameters).
        steps: Adam steps (0 = only measure the loss).
        lr_scale, lr_affine, lr_norm: learning rates of the scales (:class:`QuantScale`), the
            lattice ``A``/``b`` or VQ codebook (:class:`LatticeParam`), the RMSNorm weights.
        batch: calibration sequences per step.
        val_fraction: fraction of the sequences held out for model selection.
        seed: batch sampling seed.
        cache_teacher: run the reference once over the calibration tokens and keep its logits
            (fp32, ``n_seq·seq_len·vocab`` numbers: 0.8 GB for 32×128 tokens of a 49k vocab)
            instead of once per step and per check: the same loss, about a quarter less compute.
        log: optional callable for one line per check.

    Returns:
        ``{"val_kl_before", "val_kl_after", "steps", "seconds", "history"}`` (``history``:
        ``(step, val KL)`` at every check, step 0 before training).

    Example::

        >>> info = finetune_end_to_end(model_q, model_fp, tokens, steps=20)  # doctest: +SKIP
    """
    tokens = jnp.asarray(calib_tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[0] < 2:
        raise ValueError(f"calib_tokens has shape {tuple(tokens.shape)}; expected [n_seq, "
                         "seq_len] with n_seq ≥ 2 (a quarter is held out).")
    if steps < 0 or batch < 1:
        raise ValueError(f"steps={steps}, batch={batch}: need steps ≥ 0 and batch ≥ 1.")
    start = time.perf_counter()
    n_val = max(1, int(round(tokens.shape[0] * val_fraction)))
    train, val = tokens[:-n_val], tokens[-n_val:]
    graph, scales, lattice, norms, rest = nnx.split(model, QuantScale, LatticeParam, _is_norm, ...)
    params = (scales, lattice, norms)
    ref_graph, ref_state = nnx.split(reference)
    tx = optax.multi_transform(
        {"scale": optax.adam(lr_scale), "affine": optax.adam(lr_affine),
         "norm": optax.adam(lr_norm)},
        (jax.tree.map(lambda _: "scale", scales), jax.tree.map(lambda _: "affine", lattice),
         jax.tree.map(lambda _: "norm", norms)),
    )

    # the frozen states (codes, embeddings, the teacher) are jit arguments, not closed-over
    # constants: XLA would otherwise fold the 49152-row embedding at every compilation
    def teacher_logits(ref, x):
        return jax.lax.stop_gradient(nnx.merge(ref_graph, ref)(x)[0])

    def kl_to(p, frozen, x, teacher):
        return _kl(teacher, nnx.merge(graph, *p, frozen)(x)[0])

    def loss_fn(p, frozen, ref, x):
        return kl_to(p, frozen, x, teacher_logits(ref, x))

    size = min(batch, train.shape[0])
    if cache_teacher:  # the teacher never changes: run it once, in batches of the step's size
        forward = jax.jit(teacher_logits)
        train_t = jnp.concatenate([forward(ref_state, train[s:s + size])
                                   for s in range(0, train.shape[0], size)])
        val_t = jnp.concatenate([forward(ref_state, val[s:s + size])
                                 for s in range(0, val.shape[0], size)])

        step = make_step(kl_to, tx)
        val_fn = jax.jit(kl_to)

        def val_loss(p):
            return float(val_fn(p, rest, val, val_t))

        def run_step(p, state, rows):
            return step(p, state, rest, train[rows], train_t[rows])
    else:
        step = make_step(loss_fn, tx)
        val_fn = jax.jit(loss_fn)

        def val_loss(p):
            return float(val_fn(p, rest, ref_state, val))

        def run_step(p, state, rows):
            return step(p, state, rest, ref_state, train[rows])

    best = params
    best_val = before = val_loss(params)
    history = [(0, before)]
    rng = np.random.default_rng(seed)

    def batches(t):
        return (np.sort(rng.choice(train.shape[0], size=size, replace=False)),)

    def keep_best(p):
        nonlocal best, best_val
        v = val_loss(p)
        if v < best_val:
            best, best_val = p, v
        return v

    def report(run):
        if run.curve and run.curve[-1][0] == run.step:  # checked at this step
            history.append(run.curve[-1])
            if log is not None:
                log(f"e2e step {run.step}/{steps}: train KL {run.loss:.4f}, val KL "
                    f"{run.curve[-1][1]:.4f} ({time.perf_counter() - start:.0f}s)")

    # keep-best fine-tuning: a non-finite step is skipped, the best checked parameters returned
    run_steps(run_step, params, tx.init(params), batches, steps=steps, nonfinite="skip",
              what="e2e fine-tune", evaluate=keep_best, eval_every=max(1, steps // 5),
              on_step=report)
    nnx.update(model, *best)
    for _, _, _, lin in projections(model):
        if isinstance(lin, (QuantizedLinear, VQLinear)):
            round_floats_to_storage(lin)
    return {"val_kl_before": before, "val_kl_after": best_val, "steps": steps,
            "seconds": time.perf_counter() - start, "history": history}


__all__ = ["finetune_end_to_end"]
