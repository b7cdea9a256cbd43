"""K-FAC factors ``A = E[a aᵀ]`` and ``G = E[g gᵀ]`` for the dense layers of a Flax NNX model.

For a dense layer ``y = a K`` (Flax layout, ``K ∈ R^{d_in×d_out}``) the per-token gradient of a
loss is ``∂ℓ/∂K = a gᵀ`` with ``g = ∂ℓ/∂y``. K-FAC approximates the layer's Fisher / Gauss–Newton
block in C-order ``vec(K)`` by ``A ⊗ G`` with

.. math::

    A = \\frac{1}{N}\\sum_t a_t a_t^\\top, \\qquad G = \\frac{1}{N}\\sum_t g_t g_t^\\top,

over the ``N`` valid tokens, where ``g_t`` is the gradient of the **summed** token cross-entropy
(so each ``g_t`` is a per-token gradient, free of any ``1/N``).

How the statistics are captured (DERIVED, no kfac-jax): through the package's one capture
mechanism, :mod:`lowrank_jax.nn.capture`: for the duration of the estimate every targeted
``nnx.Linear`` records its input ``a`` and adds a zero *probe* tensor to its output. Parameter
paths and values are untouched. The loss is differentiated with ``jax.grad`` w.r.t. the probes,
which gives exactly ``g = ∂ℓ/∂y`` for every targeted layer in one backward pass. The per-batch
statistic is a pure function, jit-compiled once; batches are streamed from Python so only the
factors (fp32) stay in memory.

References:
    J. Martens, R. Grosse, *Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature*, 2015, https://arxiv.org/abs/1503.05671
    Z. Ikram et al., *CrispEdit: Low-Curvature Projections for Scalable Non-Destructive LLM
    Editing*, ICML 2026, https://arxiv.org/abs/2602.15823
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterable, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.core.losses import token_nll
from lowrank_jax.nn.capture import Recorder, module_path, named_modules, recording, tapped

Batch = Mapping[str, Any]  # {"inputs": ..., "labels": int [...], "mask": optional [...]}


class KFACFactor(NamedTuple):
    """The two Kronecker factors of one dense layer (fp32) and the token count behind them."""

    A: Float[Array, "d_in d_in"]  # E[a aᵀ] over valid tokens
    G: Float[Array, "d_out d_out"]  # E[g gᵀ], g = ∂(summed loss)/∂y per token
    n: Array  # shape=(), float32: number of valid tokens


#: K-FAC factors by module path (``"layers/3/mlp/down_proj"``).
KFACFactors = dict[str, KFACFactor]  # {module path "layers/3/mlp/down_proj": KFACFactor}


class KFACEigenbasis(NamedTuple):
    """Eigen-decompositions ``A = U_A diag(lam_A) U_Aᵀ``, ``G = U_G diag(lam_G) U_Gᵀ``."""

    U_A: Float[Array, "d_in d_in"]
    lam_A: Float[Array, " d_in"]
    U_G: Float[Array, "d_out d_out"]
    lam_G: Float[Array, " d_out"]


# ----------------------------------------------------------------------------------- layer taps


def dense_layer_paths(model: nnx.Module) -> list[str]:
    """Paths of every plain ``nnx.Linear`` in ``model`` (the layers K-FAC can target)."""
    return [module_path(p) for p, m in nnx.iter_modules(model) if type(m) is nnx.Linear]


def select_layers(
    model: nnx.Module, targets: str | Callable[[str], bool] | Sequence[str]
) -> list[str]:
    """Resolve ``targets`` (regex searched in the path, a predicate, or explicit paths) to paths.

    Raises:
        ValueError: when nothing matches; the message lists the available dense layer paths.
    """
    available = dense_layer_paths(model)
    if isinstance(targets, str):
        chosen = [p for p in available if re.search(targets, p)]
    elif callable(targets):
        chosen = [p for p in available if targets(p)]
    else:
        missing = [t for t in targets if t not in available]
        if missing:
            chosen = []
        else:
            chosen = list(targets)
    if not chosen:
        shown = ", ".join(available[:16]) + (" ..." if len(available) > 16 else "")
        raise ValueError(
            f"targets={targets!r} matches no nnx.Linear layer of the model; pass a regex or "
            f"paths from the available dense layers: {shown or '(none)'}"
        )
    return chosen


@contextlib.contextmanager
def tapped_layers(model: nnx.Module, paths: Sequence[str]):
    """Temporarily make the ``nnx.Linear`` layers at ``paths`` report to a capture recorder.

    Inside the context, ``nnx.split(model)`` yields a graphdef whose targeted layers record
    inputs and accept output probes (see :func:`layer_statistics`); this is
    :func:`lowrank_jax.nn.capture.tapped` restricted to plain dense layers. Restored on exit.
    """
    modules = named_modules(model)
    for name in paths:
        if type(modules.get(name)) is not nnx.Linear:
            raise ValueError(
                f"paths entry {name!r} is not a plain nnx.Linear; available: "
                f"{dense_layer_paths(model)[:16]}"
            )
    with tapped(model, paths):
        yield model


# ------------------------------------------------------------------------------ the statistics


def default_logits_fn(model: nnx.Module, inputs: Array) -> Array:
    """``model(inputs)``, taking the first element when the model returns a tuple (Llama)."""
    out = model(inputs)
    return out[0] if isinstance(out, tuple) else out


def lm_batch(tokens: Int[Array, "b t"], pad_id: int | None = None) -> dict[str, Array]:
    """Next-token batch: inputs ``tokens[:, :-1]``, labels ``tokens[:, 1:]``, mask off padding.

    The last position has no label and is dropped, as in the reference code.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must have shape [batch, t>=2], got {tokens.shape}.")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.ones(labels.shape, jnp.float32)
    if pad_id is not None:
        mask = (labels != pad_id).astype(jnp.float32) * (inputs != pad_id).astype(jnp.float32)
    return {"inputs": inputs, "labels": labels, "mask": mask}


def layer_statistics(
    graphdef: Any,
    state: Any,
    batch: Batch,
    key: Array | None,
    *,
    paths: Sequence[str],
    fisher: Literal["empirical", "sampled"] = "empirical",
    logits_fn: Callable[[nnx.Module, Array], Array] = default_logits_fn,
    dtype=jnp.float32,
) -> dict[str, KFACFactor]:
    """Unnormalised sums ``Σ_t m_t a_t a_tᵀ``, ``Σ_t m_t g_t g_tᵀ`` and ``Σ_t m_t`` for one batch.

    Pure and jit-able: ``graphdef, state`` come from ``nnx.split`` of a model inside
    :func:`tapped_layers`. ``fisher="empirical"`` differentiates the summed cross-entropy of the
    true labels; ``"sampled"`` draws labels from the model's softmax (needs ``key``) so that
    ``E[g gᵀ]`` is an unbiased estimate of the Gauss–Newton output factor.

    Returns:
        ``{path: KFACFactor(A_sum, G_sum, n)}`` (sums, not means).
    """
    labels = batch["labels"]
    mask = batch.get("mask")
    mask = jnp.ones(labels.shape, dtype) if mask is None else jnp.asarray(mask, dtype)

    def run(probes):
        model = nnx.merge(graphdef, state)
        with recording(Recorder(probes=probes)) as rec:
            logits = logits_fn(model, batch["inputs"]).astype(jnp.float32)
        return logits, {p: rec.inputs[p][0] for p in probes}

    def shapes():
        model = nnx.merge(graphdef, state)
        with recording(Recorder(keep_inputs=False, keep_outputs=True)) as rec:
            logits_fn(model, batch["inputs"])
        return {p: rec.outputs[p][0] for p in paths}

    out_shapes = jax.eval_shape(shapes)
    probes = {p: jnp.zeros(out_shapes[p].shape, jnp.float32) for p in paths}

    if fisher == "sampled":
        if key is None:
            raise ValueError("fisher='sampled' needs a PRNG key: pass rng=jax.random.key(0).")
        logits, _ = run({p: jax.lax.stop_gradient(v) for p, v in probes.items()})
        labels = jax.random.categorical(key, jax.lax.stop_gradient(logits), axis=-1)

    def loss(probes):
        logits, inputs = run(probes)
        nll = token_nll(logits, labels)
        return jnp.sum(nll * mask), inputs

    grads, inputs = jax.grad(loss, has_aux=True)(probes)
    m = mask.reshape(-1)
    stats = {}
    for p in paths:
        a = inputs[p].astype(dtype)
        a = a.reshape(-1, a.shape[-1]) * m[:, None]
        g = grads[p].astype(dtype)
        g = g.reshape(-1, g.shape[-1]) * m[:, None]  # m ∈ {0,1}: m² = m
        stats[p] = KFACFactor(a.T @ a, g.T @ g, jnp.sum(m))
    return stats


def estimate_kfac_factors(
    model: nnx.Module,
    batches: Iterable[Batch],
    *,
    targets: str | Callable[[str], bool] | Sequence[str],
    fisher: Literal["empirical", "sampled"] = "empirical",
    rng: Array | None = None,
    logits_fn: Callable[[nnx.Module, Array], Array] = default_logits_fn,
    dtype=jnp.float32,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> KFACFactors:
    """K-FAC factors ``A = E[a aᵀ]``, ``G = E[g gᵀ]`` of the targeted dense layers.

    .. math::

        A = \\frac{1}{N}\\sum_t m_t a_t a_t^\\top, \\quad
        G = \\frac{1}{N}\\sum_t m_t g_t g_t^\\top, \\quad
        g_t = \\partial \\Big(\\sum_s m_s\\,\\mathrm{CE}_s\\Big) / \\partial y_t.

    Batches are streamed: one jit-compiled statistic per batch, summed in ``dtype`` (fp32), so
    memory holds only the factors. Biases are ignored (CrispEdit edits kernels only).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
        ...                   d_ff=32)
        >>> model = Llama(cfg, rngs=nnx.Rngs(0))
        >>> batch = lm_batch(jnp.arange(18).reshape(2, 9) % 32)
        >>> f = estimate_kfac_factors(model, [batch], targets="down_proj")
        >>> f["layers/0/mlp/down_proj"].A.shape, f["layers/0/mlp/down_proj"].G.shape
        ((32, 32), (16, 16))

    Args:
        model: an NNX model whose targeted layers are plain ``nnx.Linear``.
        batches: iterable of ``{"inputs", "labels", "mask"?}`` (see :func:`lm_batch`).
        targets: regex searched in module paths, a predicate on paths, or explicit paths.
        fisher: ``"empirical"`` (true labels; reference-code default) or ``"sampled"`` (labels
            drawn from the model; unbiased for the Gauss–Newton factor).
        rng: PRNG key, required for ``"sampled"``.
        logits_fn: ``(model, inputs) -> logits [..., vocab]``.
        dtype: accumulation dtype (fp32; fp64 in tests with x64).
        progress: optional wrapper for the batch iterator (e.g. ``tqdm``).

    Returns:
        ``{path: KFACFactor}`` with means over the valid tokens.

    Raises:
        ValueError: unknown ``fisher``, missing ``rng``, no matching layer, or no valid token.
    """
    if fisher not in ("empirical", "sampled"):
        raise ValueError(f"fisher={fisher!r} is unknown; use 'empirical' or 'sampled'.")
    if fisher == "sampled" and rng is None:
        raise ValueError("fisher='sampled' needs rng=jax.random.key(seed).")
    paths = select_layers(model, targets)
    sums: dict[str, KFACFactor] | None = None
    with tapped_layers(model, paths):
        graphdef, state = nnx.split(model)
        step = jax.jit(
            lambda st, b, k: layer_statistics(
                graphdef, st, b, k, paths=paths, fisher=fisher, logits_fn=logits_fn, dtype=dtype
            )
        )
        it = batches if progress is None else progress(batches)
        for i, batch in enumerate(it):
            key = None if rng is None else jax.random.fold_in(rng, i)
            stats = step(state, dict(batch), key)
            sums = stats if sums is None else jax.tree.map(jnp.add, sums, stats)
    if sums is None:
        raise ValueError("batches is empty: give at least one capability batch.")
    out = {}
    for p, s in sums.items():
        n = float(s.n)
        if n <= 0:
            raise ValueError(f"no valid (unmasked) token for layer {p!r}; check the batch masks.")
        out[p] = KFACFactor(s.A / n, s.G / n, s.n)
    return out


def combine_factors(
    factor_list: Sequence[KFACFactors], weights: Sequence[float] | None = None
) -> KFACFactors:
    """n-weighted mean of the A's and, separately, of the G's (the reference code's rule).

    An approximation (DERIVED note): a sum of Kronecker products is not the Kronecker product of
    the summed factors.
    """
    if not factor_list:
        raise ValueError("factor_list is empty: give at least one KFACFactors.")
    keys = set(factor_list[0])
    for f in factor_list[1:]:
        if set(f) != keys:
            raise ValueError(f"factor sets cover different layers: {sorted(keys)} vs {sorted(f)}.")
    out = {}
    for k in factor_list[0]:
        ws = [float(f[k].n) for f in factor_list] if weights is None else list(weights)
        total = sum(ws)
        A = sum(w * f[k].A for w, f in zip(ws, factor_list)) / total
        G = sum(w * f[k].G for w, f in zip(ws, factor_list)) / total
        out[k] = KFACFactor(A, G, sum(f[k].n for f in factor_list))
    return out


def add_damping(factors: KFACFactors, damping: float) -> KFACFactors:
    """Tikhonov damping split over the factors: ``A + √λ·I``, ``G + √λ·I`` (λ = ``damping``).

    Not used by CrispEdit's projector (which thresholds eigenvalue products); offered for
    preconditioning uses of the factors.
    """
    if damping < 0:
        raise ValueError(f"damping={damping} must be >= 0.")
    s = float(np.sqrt(damping))
    return {
        k: KFACFactor(f.A + s * jnp.eye(f.A.shape[0], dtype=f.A.dtype),
                      f.G + s * jnp.eye(f.G.shape[0], dtype=f.G.dtype), f.n)
        for k, f in factors.items()
    }


@functools.partial(jax.jit, static_argnames=("eig_floor",))
def eigenbasis(factor: KFACFactor, *, eig_floor: float = 0.0) -> KFACEigenbasis:
    """``eigh`` of both factors (fp32 at least), eigenvalues clamped at ``eig_floor``.

    Columns of ``U`` stay paired with their (ascending) eigenvalues.
    """
    dt = jnp.promote_types(factor.A.dtype, jnp.float32)
    A = factor.A.astype(dt)
    G = factor.G.astype(dt)
    lam_A, U_A = jnp.linalg.eigh(0.5 * (A + A.T))
    lam_G, U_G = jnp.linalg.eigh(0.5 * (G + G.T))
    return KFACEigenbasis(U_A, jnp.maximum(lam_A, eig_floor), U_G, jnp.maximum(lam_G, eig_floor))
