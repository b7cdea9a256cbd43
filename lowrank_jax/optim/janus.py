"""Janus-LoRA: continual LoRA whose composite update stays out of past tasks' input subspace.

Three pieces, each usable alone:

* **Gradient Rectification (GR)** — :func:`scale_by_janus`, an optax transform that maps the LoRA
  gradients ``(g_a, g_b)`` to factor updates ``(Δa, Δb)`` whose composite ``Δa·b + a·Δb (+ Δa·Δb)``
  satisfies ``Vᵀ·ΔW = 0`` for the protected input basis ``V``; and :func:`orthogonality_clamp`,
  which re-imposes the constraints on the final deltas after Adam (an element-wise transform
  breaks linear constraints).
* **Online Estimation (OE)** — :class:`SubspaceMemory`, :func:`oe_accumulate`,
  :func:`oe_finalize`: a running input second moment per protected layer, expanded into the
  orthonormal basis at task end by the GPM energy criterion; no stored samples.
* **Decoupled Margin Loss (DML)** — :func:`decoupled_margin_loss`: pushes new-task features away
  from old-class prototypes.

Flax layout (kernel ``K [in, out]``, ``a = lora_a [in, r]``, ``b = lora_b [r, out]``, scale ``s``):
an input ``x`` in ``span(V)`` keeps its output when ``Vᵀ Δ(a b) = 0``; the sufficient linear
constraints are

.. math::  V^\\top \\Delta a = 0, \\qquad (V^\\top a)\\, \\Delta b = 0,

which also kill the second-order term, so they hold for finite steps.

GR in closed form ([DERIVED] from the paper's stated constraints; the paper's Sec. 3 equations were
not readable): with ``P = I − V Vᵀ``, ``Π = I_r − Q Qᵀ`` (``Q`` an orthonormal basis of the range of
``aᵀ V``), ``G_B = b bᵀ + δ_B I``, ``G_A = Π aᵀ a Π + δ_A I`` (``δ_A`` relative to ``tr(aᵀa)``):

.. math::
   \\Delta a = P\\, (g_a / s)\\, G_B^{-1}, \\qquad
   \\Delta b = Π G_A^{-1} Π\\, (g_b / s)\\, (I - b^\\top G_B^{-1} b)

(``precondition=False``: ``Δa = P g_a``, ``Δb = Π g_b``, also exactly safe). The composite is the
LoRA-Pro-style tangent projection of the safe full-weight step.

References:
    Chen et al, `JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning
    <https://arxiv.org/abs/2605.28495>`_, 2026; Liang & Li, `InfLoRA
    <https://arxiv.org/abs/2404.00228>`_, 2024; Saha et al, `GPM <https://arxiv.org/abs/2103.09762>`_,
    2021.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from lowrank_jax.optim.linalg import Numeric
from lowrank_jax.optim.linalg import gathered, with_sharding_of
from lowrank_jax.optim.factors import (
    PairFn,
    check_learning_rate,
    find_pairs,
    flatten_by_path,
    has_unmasked_leaves,
    path_str,
    unflatten_by_path,
)

def _check_basis(parent: str, basis, d_in: int):
    if basis.ndim != 2 or basis.shape[0] != d_in:
        raise ValueError(
            f"janus: protected basis for {parent!r} has shape {tuple(basis.shape)} but the layer "
            f"input width is {d_in}; pass V of shape [{d_in}, k]."
        )


# ---------------------------------------------------------------------------------------------
# Gradient rectification
# ---------------------------------------------------------------------------------------------


def _range_projector(m: Float[Array, "r k"], tol: Numeric) -> Float[Array, "r r"]:
    """``Π = I − Q Qᵀ`` with ``Q`` an orthonormal basis of ``range(m)``."""
    r = m.shape[0]
    if m.shape[1] == 0:
        return jnp.eye(r, dtype=m.dtype)
    u, s, _ = jnp.linalg.svd(m, full_matrices=False)
    keep = (s > tol * jnp.maximum(1.0, s.max(initial=0.0))).astype(m.dtype)
    return jnp.eye(r, dtype=m.dtype) - (u * keep[None, :]) @ u.T


def rectify_pair(
    g_a: Float[Array, "d r"],
    g_b: Float[Array, "r o"],
    a: Float[Array, "d r"],
    b: Float[Array, "r o"],
    basis: Float[Array, "d k"],
    *,
    scale: Numeric = 1.0,
    precondition: bool = True,
    eps_rel: Numeric = 1e-3,
    tol: Numeric = 1e-6,
):
    """Rectified ``(Δa, Δb)`` for one LoRA pair (same sign convention as gradients)."""
    f32 = jnp.float32
    g_a, g_b, a, b, v = (x.astype(f32) for x in (g_a, g_b, a, b, basis))
    d, r = a.shape
    proj_in = lambda x: x - v @ (v.T @ x)  # P x
    pi = _range_projector(a.T @ v, tol)
    if not precondition:
        return proj_in(g_a), pi @ g_b
    gram_b = b @ b.T
    gram_b = gram_b + (eps_rel * jnp.trace(gram_b) / r + 1e-12) * jnp.eye(r, dtype=f32)
    a_t = a @ pi
    gram_a = a_t.T @ a_t
    # damping scaled by the unprojected a: when Π ≈ 0 the Gram of Πa vanishes and would blow up
    gram_a = gram_a + (eps_rel * jnp.sum(a * a) / r + 1e-12) * jnp.eye(r, dtype=f32)
    delta_a = jnp.linalg.solve(gram_b, proj_in(g_a / scale).T).T  # P (g_a/s) G_B⁻¹
    gb = g_b / scale
    gb = gb - (gb @ b.T) @ jnp.linalg.solve(gram_b, b)  # (g_b/s)(I − bᵀ G_B⁻¹ b)
    delta_b = pi @ jnp.linalg.solve(gram_a, pi @ gb)
    return delta_a, delta_b


def clamp_pair(
    delta_a: Float[Array, "d r"],
    delta_b: Float[Array, "r o"],
    a: Float[Array, "d r"],
    basis: Float[Array, "d k"],
    *,
    tol: Numeric = 1e-6,
):
    """Clamped ``(P δa, Π δb)`` of one LoRA pair's final update (fp32), ``P = I − V Vᵀ``,
    ``Π = I − Q Qᵀ`` with ``Q`` a basis of ``range(aᵀ V)``.

    For inputs ``x`` in ``span(V)`` the layer's output ``x (a + δa)(b + δb)`` then equals
    ``x a b`` exactly: ``Vᵀ P δa = 0`` and ``(Vᵀ a) Π δb = 0``.

    Example::

        >>> import jax.numpy as jnp
        >>> da, db = clamp_pair(jnp.ones((4, 2)), jnp.ones((2, 3)), jnp.eye(4, 2), jnp.eye(4, 1))
        >>> da[0].tolist(), db[0].tolist()
        ([0.0, 0.0], [0.0, 0.0, 0.0])
    """
    v = basis.astype(jnp.float32)
    pi = _range_projector(a.astype(jnp.float32).T @ v, tol)
    da32 = delta_a.astype(jnp.float32)
    return da32 - v @ (v.T @ da32), pi @ delta_b.astype(jnp.float32)


def _for_each_pair(fn, updates, params, subspaces, pair_fn: PairFn | None = None):
    ups, order, treedef = flatten_by_path(updates)
    pars, _, _ = flatten_by_path(params)
    pairs = {path_str(pa[:-1]): (pa, pb)
             for pa, pb in find_pairs(updates, kinds=("lora",), pair_fn=pair_fn)}
    if not pairs and has_unmasked_leaves(updates):
        raise ValueError(
            f"janus: the tree has no LoRA factor pairs (leaves {[path_str(p) for p in order][:3]}"
            "); janus updates lora_a / lora_b pairs: apply_lora first, or pass the LoRA "
            "parameters only (nnx.Optimizer(..., wrt=nnx.LoRAParam)).")
    subspaces = subspaces or {}
    unknown = sorted(set(subspaces) - set(pairs))
    if unknown:
        raise ValueError(
            f"janus: subspaces given for {unknown[:3]} but no LoRA pair has that path; "
            f"pairs: {sorted(pairs)[:6]}"
        )
    out = dict(ups)
    for parent, (pa, pb) in pairs.items():
        if parent not in subspaces:
            continue
        basis = subspaces[parent]
        _check_basis(parent, basis, pars[pa].shape[0])
        # r×r solves and projections need whole factors: gather sharded ones (they are thin)
        da, db = fn(*(gathered(x) for x in (ups[pa], ups[pb], pars[pa], pars[pb], basis)))
        out[pa] = with_sharding_of(da.astype(ups[pa].dtype), ups[pa])
        out[pb] = with_sharding_of(db.astype(ups[pb].dtype), ups[pb])
    return unflatten_by_path(treedef, order, out)


def scale_by_janus(
    scale: Numeric = 1.0,
    *,
    precondition: bool = True,
    eps_rel: Numeric = 1e-3,
    tol: Numeric = 1e-6,
    pair_fn: PairFn | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Gradient Rectification: make each LoRA pair's composite update orthogonal to ``V``.

    Call as ``update(grads, state, params, subspaces={parent_path: V})`` where ``parent_path`` is
    the LoRA layer's path written with ``/`` (``"layers/0/self_attn/k_proj"``) and ``V`` is an
    orthonormal ``[in, k]`` basis (zero columns allowed: a fixed-shape basis with unused columns
    keeps ``jit`` from retracing). Pairs without a subspace pass through unchanged. The state is
    ``optax.EmptyState``.

    Recommended chain for LoRA leaves (never weight-decay protected factors), which is
    :func:`janus`::

        optax.chain(scale_by_janus(s), optax.scale_by_adam(), optax.scale_by_learning_rate(lr),
                    orthogonality_clamp())

    Args:
        scale: the LoRA scale ``s = alpha / rank`` (gradients are divided by it).
        precondition: use the Gram-preconditioned closed form (``False``: plain projections).
        eps_rel: relative damping of the ``r × r`` Gram matrices.
        tol: singular values of ``aᵀV`` below ``tol·max(1, σ_max)`` count as zero.
        pair_fn: the ``pair_fn`` of :mod:`lowrank_jax.optim.factors` (default
            ``find_pairs(params, kinds=("lora",))``).

    Returns:
        A :class:`optax.GradientTransformationExtraArgs`.

    Example::

        >>> import jax.numpy as jnp
        >>> params = {"l": {"lora_a": jnp.eye(4, 2), "lora_b": jnp.ones((2, 3))}}
        >>> v = jnp.eye(4, 1)  # protect input direction e_0
        >>> tx = scale_by_janus()
        >>> u, _ = tx.update(params, tx.init(params), params, subspaces={"l": v})
        >>> float(jnp.abs(v.T @ u["l"]["lora_a"]).max())
        0.0
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, subspaces=None, **extra):
        del extra
        if params is None:
            raise ValueError("scale_by_janus needs params: call update(grads, state, params, ...).")
        fn = lambda ga, gb, a, b, v: rectify_pair(  # noqa: E731
            ga, gb, a, b, v, scale=scale, precondition=precondition, eps_rel=eps_rel, tol=tol)
        return _for_each_pair(fn, updates, params, subspaces, pair_fn), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def janus(
    learning_rate: optax.ScalarOrSchedule,
    scale: Numeric = 1.0,
    *,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    mu_dtype: Any = None,
    precondition: bool = True,
    eps_rel: Numeric = 1e-3,
    tol: Numeric = 1e-6,
    pair_fn: PairFn | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Janus-LoRA's optimizer for LoRA leaves: rectify, Adam, step, clamp.

    ``chain(scale_by_janus(scale), scale_by_adam(b1, b2, eps, mu_dtype),
    scale_by_learning_rate(learning_rate), orthogonality_clamp())``; pass
    ``subspaces={parent_path: V}`` to ``update`` (it reaches the two Janus parts).

    Args:
        learning_rate: Adam's step size (float or schedule).
        scale: the LoRA scale ``s``.
        b1, b2, eps, mu_dtype: forwarded to ``optax.scale_by_adam``.
        precondition, eps_rel, tol, pair_fn: see :func:`scale_by_janus`.

    Returns:
        A :class:`optax.GradientTransformationExtraArgs`.

    Example::

        >>> import jax.numpy as jnp
        >>> params = {"l": {"lora_a": jnp.eye(4, 2), "lora_b": jnp.ones((2, 3))}}
        >>> tx = janus(0.1)
        >>> u, _ = tx.update(params, tx.init(params), params, subspaces={"l": jnp.eye(4, 1)})
        >>> float(jnp.abs(u["l"]["lora_a"][0]).max())
        0.0

    References:
        Chen et al, `JANUS-LoRA <https://arxiv.org/abs/2605.28495>`_, 2026.
    """
    check_learning_rate("janus", learning_rate)
    return optax.chain(
        scale_by_janus(scale, precondition=precondition, eps_rel=eps_rel, tol=tol,
                       pair_fn=pair_fn),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype),
        optax.scale_by_learning_rate(learning_rate),
        orthogonality_clamp(tol=tol, pair_fn=pair_fn),
    )


def orthogonality_clamp(
    *, tol: Numeric = 1e-6, pair_fn: PairFn | None = None
) -> optax.GradientTransformationExtraArgs:
    """Re-impose ``Vᵀ δa = 0`` and ``(Vᵀ a) δb = 0`` on the final deltas (``δa ← P δa``,
    ``δb ← Π δb``), using the pre-update ``params``. Put it last in the chain.

    Example::

        >>> import jax.numpy as jnp
        >>> params = {"l": {"lora_a": jnp.eye(4, 2), "lora_b": jnp.ones((2, 3))}}
        >>> tx = orthogonality_clamp()
        >>> u, _ = tx.update(params, tx.init(params), params, subspaces={"l": jnp.eye(4, 1)})
        >>> u["l"]["lora_a"][0].tolist()
        [0.0, 0.0]
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def clamp(da, db, a, b, v):
        del b
        return clamp_pair(da, db, a, v, tol=tol)

    def update_fn(updates, state, params=None, *, subspaces=None, **extra):
        del extra
        if params is None:
            raise ValueError("orthogonality_clamp needs params (the pre-update LoRA factors).")
        return _for_each_pair(clamp, updates, params, subspaces, pair_fn), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Online subspace estimation
# ---------------------------------------------------------------------------------------------


class SubspaceMemory(NamedTuple):
    """Protected basis of one input site, plus the running second moment of the current task.

    ``basis`` is ``[d, max_rank]`` with orthonormal leading ``rank`` columns and zeros after;
    ``covariance`` is the uncentred ``Σ x xᵀ`` and ``count`` the number of rows seen.
    """

    basis: Array  # [d, max_rank] fp32
    rank: Array  # () int32
    covariance: Array  # [d, d] fp32
    count: Array  # () fp32

    @classmethod
    def empty(cls, d: int, max_rank: int | None = None) -> "SubspaceMemory":
        k = d if max_rank is None else max_rank
        return cls(jnp.zeros((d, k), jnp.float32), jnp.zeros((), jnp.int32),
                   jnp.zeros((d, d), jnp.float32), jnp.zeros((), jnp.float32))


def oe_accumulate(memory: SubspaceMemory, inputs: Float[Array, "... d"]) -> SubspaceMemory:
    """Add a batch of layer inputs (any leading shape) to the running second moment."""
    x = inputs.reshape(-1, inputs.shape[-1]).astype(jnp.float32)
    if x.shape[1] != memory.covariance.shape[0]:
        raise ValueError(
            f"oe_accumulate: inputs have width {x.shape[1]} but the memory was built for "
            f"{memory.covariance.shape[0]}."
        )
    return memory._replace(covariance=memory.covariance + x.T @ x,
                           count=memory.count + x.shape[0])


def oe_finalize(memory: SubspaceMemory, threshold: Numeric) -> SubspaceMemory:
    """Task end: grow the basis until it holds ``threshold`` of the task's input energy (GPM).

    With ``C`` the task's second moment and ``P = I − V Vᵀ``: ``E = tr C``, already captured
    ``E_V = E − tr(P C P)``; add the fewest top eigenvectors of ``P C P`` so that
    ``(E_V + Σ λ_i) / E ≥ threshold`` (energy = eigenvalues, not their squares), re-orthonormalise
    and reset the covariance. Not jit-compatible (the new rank is data dependent).
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"oe_finalize: threshold={threshold} must lie in (0, 1].")
    v, k = memory.basis, int(memory.rank)
    d, max_rank = v.shape
    c = memory.covariance
    total = float(jnp.trace(c))
    if total <= 0.0:
        return memory._replace(covariance=jnp.zeros_like(c), count=jnp.zeros_like(memory.count))
    p = jnp.eye(d, dtype=jnp.float32) - v @ v.T
    c_res = p @ c @ p
    captured = total - float(jnp.trace(c_res))
    lam, vec = jnp.linalg.eigh((c_res + c_res.T) / 2)
    lam, vec = lam[::-1], vec[:, ::-1]
    cumulative = captured + jnp.cumsum(jnp.clip(lam, 0.0))
    need = int(jnp.sum(cumulative / total < threshold)) + 1 if captured / total < threshold else 0
    need = min(need, max_rank - k, d - k)
    if need > 0:
        block = jnp.concatenate([v[:, :k], vec[:, :need]], axis=1)
        q, _ = jnp.linalg.qr(block)
        v = jnp.zeros_like(v).at[:, : k + need].set(q)
    return SubspaceMemory(v, jnp.asarray(k + max(need, 0), jnp.int32), jnp.zeros_like(c),
                          jnp.zeros_like(memory.count))


def orthonormalize_basis(basis: Float[Array, "d k"], *, atol: Numeric = 1e-4):
    """Return ``basis`` if it is orthonormal; otherwise its QR orthonormalisation, with a
    warning."""
    import warnings

    gram = basis.T @ basis
    if jnp.allclose(gram, jnp.eye(gram.shape[0]), atol=atol):
        return basis
    warnings.warn("janus: protected basis was not orthonormal; orthonormalised it with QR.",
                  stacklevel=2)
    q, _ = jnp.linalg.qr(basis)
    return q


def reanchor(layer: Any, basis: Float[Array, "d k"]) -> None:
    """Task start: move ``a``'s protected part into the frozen kernel (function preserving).

    ``K ← K + s·V Vᵀ a b``, ``a ← (I − V Vᵀ) a``; afterwards ``Vᵀ a = 0`` so ``Δb`` is
    unconstrained. ``layer`` is a :class:`lowrank_jax.nn.LoRALinear` (modified in place).
    """
    a, b = layer.lora_a[...], layer.lora_b[...]
    _check_basis("layer", basis, a.shape[0])
    protected = basis @ (basis.T @ a)
    layer.kernel[...] = layer.kernel[...] + layer.scaling * (protected @ b)
    layer.lora_a[...] = a - protected


# ---------------------------------------------------------------------------------------------
# Decoupled margin loss
# ---------------------------------------------------------------------------------------------


def decoupled_margin_loss(
    features: Float[Array, "n f"],
    labels,
    prototypes: Float[Array, "c_old f"],
    anchors: Float[Array, "classes f"],
    *,
    margin: Numeric = 0.2,
) -> Float[Array, ""]:
    """``mean_i [max_c f_i·p_c − f_i·w_{y_i} + m]₊`` on unit-normalised features ([DERIVED]).

    Args:
        features: new-task features (normalised inside, so the loss is scale invariant).
        labels: int class ids indexing ``anchors``.
        prototypes: old-class prototypes (normalised inside); zero rows mean "no prototype yet".
        anchors: cosine-classifier weights of the classes (normalised inside).
        margin: the margin ``m``.
    """
    unit = lambda x: x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-12)
    f = unit(features.astype(jnp.float32))
    if prototypes.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    p = unit(prototypes.astype(jnp.float32))
    w = unit(anchors.astype(jnp.float32))[labels]
    old = jnp.max(f @ p.T, axis=-1)
    own = jnp.sum(f * w, axis=-1)
    return jnp.mean(jax.nn.relu(old - own + margin))


# ---------------------------------------------------------------------------------------------
# A baseline, and the protected bases carried in the optimizer state
# ---------------------------------------------------------------------------------------------


def scale_by_input_projection(
    *, pair_fn: PairFn | None = None
) -> optax.GradientTransformationExtraArgs:
    """The orthogonal-subspace baseline (InfLoRA / LoRA-GPM style): ``δa ← P g_a``,
    ``P = I − V Vᵀ``; ``b``'s gradient passes unchanged, so the ``a · δb`` term still moves the
    outputs of protected inputs (what Janus' Gradient Rectification also removes).

    Call as ``update(grads, state, params, subspaces={parent_path: V})``, like
    :func:`scale_by_janus`.

    Example::

        >>> import jax.numpy as jnp
        >>> g = {"l": {"lora_a": jnp.ones((3, 1)), "lora_b": jnp.ones((1, 2))}}
        >>> tx = scale_by_input_projection()
        >>> u, _ = tx.update(g, tx.init(g), g, subspaces={"l": jnp.eye(3, 1)})
        >>> u["l"]["lora_a"][:, 0].tolist(), u["l"]["lora_b"][0].tolist()
        ([0.0, 1.0, 1.0], [1.0, 1.0])
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def project(ga, gb, a, b, v):
        del a, b
        return ga - v @ (v.T @ ga), gb

    def update_fn(updates, state, params=None, *, subspaces=None, **extra):
        del extra
        if params is None:
            raise ValueError("scale_by_input_projection needs params (the LoRA factors).")
        return _for_each_pair(project, updates, params, subspaces, pair_fn), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class WithSubspacesState(NamedTuple):
    """State of :func:`with_subspaces`: the inner optimizer's state and the protected bases."""

    inner: Any
    subspaces: dict  # {parent path: V [in, k]}


def with_subspaces(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` (a Janus chain) reading its ``subspaces`` from the optimizer state, not from an
    extra argument: a step that calls ``tx.update(grads, state, params)`` with nothing else
    (:func:`lowrank_jax.core.step.make_step`) then trains with protected bases.

    ``init`` starts with no protected basis; put the current ones in with
    :func:`set_subspaces` (the bases are arrays of the state, so a new task's bases of the same
    shapes reuse the compiled step).

    Example::

        >>> import jax.numpy as jnp, optax
        >>> params = {"l": {"lora_a": jnp.eye(4, 2), "lora_b": jnp.ones((2, 3))}}
        >>> tx = with_subspaces(janus(1e-2))
        >>> state = set_subspaces(tx.init(params), {"l": jnp.eye(4, 1)})
        >>> u, _ = tx.update(params, state, params)
        >>> float(jnp.abs(u["l"]["lora_a"][0]).max())
        0.0
    """

    def init_fn(params):
        return WithSubspacesState(tx.init(params), {})

    def update_fn(updates, state, params=None, **extra):
        updates, inner = tx.update(updates, state.inner, params, subspaces=state.subspaces,
                                   **extra)
        return updates, state._replace(inner=inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def set_subspaces(state: WithSubspacesState, subspaces: dict) -> WithSubspacesState:
    """The :func:`with_subspaces` state with new protected bases ``{parent path: V}``."""
    return state._replace(subspaces=dict(subspaces))


__all__ = [
    "SubspaceMemory", "WithSubspacesState", "clamp_pair", "decoupled_margin_loss", "janus",
    "oe_accumulate", "oe_finalize", "orthogonality_clamp",
    "orthonormalize_basis", "reanchor", "rectify_pair", "scale_by_input_projection",
    "scale_by_janus", "set_subspaces", "with_subspaces",
]
