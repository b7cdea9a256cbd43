"""Per-head views of attention projections, head importance, head rewinding, interpolation.

Works on the pure-dict parameter tree of :class:`lowrank_jax.models.Llama`
(``nnx.to_pure_dict(nnx.state(model, nnx.Param))``): kernels are ``[in, out]``, the q/k/v output
axis is ``heads × head_dim`` (head-major) and the o_proj input axis is ``heads × head_dim``.

GQA choice (DERIVED): heads are scored per *query* head, aggregating its q and o slices with the
k/v slices of its kv group; a kv head is rewound only when every query head of its group is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

LAYOUTS = ("llama_qkv", "llama_out", "flax_qkv", "flax_out", "torch_qkv", "torch_out")
from lowrank_jax.models.llama import ATTENTION_PROJECTIONS  # noqa: E402 (one list)


def split_heads(kernel: Float[Array, "..."], *, layout: str, num_heads: int) -> Array:
    """Split an attention kernel into per-head blocks ``[H, ...]``.

    ===========  ======================  ==================
    layout       kernel                  heads
    ===========  ======================  ==================
    llama_qkv    (d_model, H·d_h)        (H, d_model, d_h)
    llama_out    (H·d_h, d_model)        (H, d_h, d_model)
    flax_qkv     (d_model, H, d_h)       (H, d_model, d_h)
    flax_out     (H, d_h, d_model)       (H, d_h, d_model)
    torch_qkv    (H·d_h, d_model)        (H, d_h, d_model)
    torch_out    (d_model, H·d_h)        (H, d_model, d_h)
    ===========  ======================  ==================

    ``llama_*`` is lowrank_jax's Llama (``[in, out]`` kernels, head-major).

    Example::

        >>> import jax.numpy as jnp
        >>> split_heads(jnp.zeros((8, 12)), layout="llama_qkv", num_heads=3).shape
        (3, 8, 4)
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}.")
    if layout in ("flax_qkv", "flax_out"):
        want = 3
    else:
        want = 2
    if kernel.ndim != want:
        raise ValueError(f"layout={layout!r} expects a {want}-D kernel, got shape {kernel.shape}.")
    if layout == "flax_qkv":
        return jnp.transpose(kernel, (1, 0, 2))
    if layout == "flax_out":
        return kernel
    axis = {"llama_qkv": 1, "llama_out": 0, "torch_qkv": 0, "torch_out": 1}[layout]
    width = kernel.shape[axis]
    if width % num_heads:
        raise ValueError(
            f"kernel axis {axis} has size {width}, not a multiple of num_heads={num_heads}; "
            "check the layout and head count (GQA k/v use num_kv_heads)."
        )
    d_h = width // num_heads
    if layout == "llama_qkv":
        return kernel.reshape(kernel.shape[0], num_heads, d_h).transpose(1, 0, 2)
    if layout == "llama_out":
        return kernel.reshape(num_heads, d_h, kernel.shape[1])
    if layout == "torch_qkv":
        return kernel.reshape(num_heads, d_h, kernel.shape[1])
    return kernel.reshape(kernel.shape[0], num_heads, d_h).transpose(1, 0, 2)  # torch_out


def merge_heads(heads: Array, *, layout: str) -> Array:
    """Inverse of :func:`split_heads`: ``merge_heads(split_heads(W, ...), layout) == W``.

    Example::

        >>> import jax.numpy as jnp
        >>> w = jnp.arange(24.0).reshape(2, 12)
        >>> bool((merge_heads(split_heads(w, layout="torch_out", num_heads=3),
        ...                   layout="torch_out") == w).all())
        True
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}.")
    h = heads.shape[0]
    if layout == "flax_qkv":
        return jnp.transpose(heads, (1, 0, 2))
    if layout == "flax_out":
        return heads
    if layout in ("llama_qkv", "torch_out"):
        return heads.transpose(1, 0, 2).reshape(heads.shape[1], h * heads.shape[2])
    return heads.reshape(h * heads.shape[1], heads.shape[2])  # llama_out, torch_qkv


def _layers(params) -> dict:
    if not isinstance(params, dict) or "layers" not in params:
        raise ValueError(
            "params must be the pure-dict tree of a lowrank_jax Llama "
            "(nnx.to_pure_dict(nnx.state(model, nnx.Param))) with a 'layers' entry."
        )
    return params["layers"]


def _kernel(params, layer, proj):
    node = _layers(params)[layer]["self_attn"][proj]
    if "kernel" not in node:
        raise ValueError(
            f"layers/{layer}/self_attn/{proj} has no dense 'kernel' (keys {sorted(node)}); merge "
            "LoRA / factorized layers into dense kernels before head analysis."
        )
    return node["kernel"]


def head_slices(params, layer, *, num_heads: int, num_kv_heads: int) -> dict:
    """``{proj: [H_proj, ...]}`` per-head blocks of one layer's q/k/v/o kernels (llama layout)."""
    out = {}
    for proj in ATTENTION_PROJECTIONS:
        kernel = jnp.asarray(_kernel(params, layer, proj))
        heads = num_kv_heads if proj in ("k_proj", "v_proj") else num_heads
        layout = "llama_out" if proj == "o_proj" else "llama_qkv"
        out[proj] = split_heads(kernel, layout=layout, num_heads=heads)
    return out


def _query_head_blocks(slices, h, group):
    g = h // group
    return [slices["q_proj"][h], slices["o_proj"][h], slices["k_proj"][g], slices["v_proj"][g]]


def _rel_update(base_blocks, tuned_blocks, k):
    del k
    num = sum(jnp.sum(jnp.square(t - b)) for b, t in zip(base_blocks, tuned_blocks))
    den = sum(jnp.sum(jnp.square(b)) for b in base_blocks)
    return float(jnp.sqrt(num / jnp.maximum(den, 1e-30)))


def _rotation(base_blocks, tuned_blocks, k):
    vals = []
    for b, t in zip(base_blocks, tuned_blocks):
        b2 = b if b.shape[0] >= b.shape[1] else b.T  # left vectors along the longer (d_model) axis
        t2 = t if t.shape[0] >= t.shape[1] else t.T
        u0 = jnp.linalg.svd(b2, full_matrices=False)[0]
        u1 = jnp.linalg.svd(t2, full_matrices=False)[0]
        kk = min(k, u0.shape[1])
        overlap = jnp.abs(u0[:, :kk].T @ u1[:, :kk])
        vals.append(1.0 - float(jnp.mean(jnp.max(overlap, axis=1))))
    return float(np.mean(vals))


HEAD_CRITERIA: dict[str, Callable] = {"rel_update": _rel_update, "rotation": _rotation}


def head_scores(
    base,
    tuned,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    criterion: str | Callable = "rel_update",
    k: int = 8,
    seed: int = 0,
) -> Float[np.ndarray, "L H"]:
    """Importance of every (layer, query head) for the update ``base → tuned`` (DERIVED).

    ``rel_update`` (default): ``s_h = sqrt(Σ_p ‖ΔW_h^p‖_F² / Σ_p ‖W0_h^p‖_F²)`` over the head's
    q, k, v, o slices. ``rotation``: ``mean_p (1 − mean_{i≤k} max_j |U0ᵀU1|_ij)`` on the top-k left
    singular vectors of each slice. ``random``: uniform noise (the control). A callable
    ``f(base_blocks, tuned_blocks, k) -> float`` plugs in any other criterion. Low ⇒ unimportant.

    Args:
      base: parameter tree of the base checkpoint.
      tuned: parameter tree of the tuned checkpoint (same structure).
      num_heads: query heads H.
      num_kv_heads: kv heads (default H).
      criterion: name or callable.
      k: singular vectors used by ``rotation``.
      seed: seed of the ``random`` control.

    Returns:
      ``[n_layers, H]`` numpy array.

    Example::

        >>> import jax.numpy as jnp
        >>> layer = {"self_attn": {p: {"kernel": jnp.ones((4, 4))}
        ...          for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}
        >>> head_scores({"layers": {0: layer}}, {"layers": {0: layer}}, num_heads=2).tolist()
        [[0.0, 0.0]]

    References:
      Diffract (ICML 2026), https://openreview.net/forum?id=XBUHoiAGDE
    """
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}."
        )
    layers = sorted(_layers(base))
    if sorted(_layers(tuned)) != layers:
        raise ValueError("base and tuned have different layer sets; compare the same architecture.")
    if criterion == "random":
        return np.random.default_rng(seed).random((len(layers), num_heads))
    fn = HEAD_CRITERIA.get(criterion) if isinstance(criterion, str) else criterion
    if fn is None:
        raise ValueError(
            f"criterion={criterion!r} is unknown; use one of {sorted(HEAD_CRITERIA) + ['random']} "
            "or a callable."
        )
    group = num_heads // num_kv_heads
    scores = np.zeros((len(layers), num_heads))
    for i, layer in enumerate(layers):
        sb = head_slices(base, layer, num_heads=num_heads, num_kv_heads=num_kv_heads)
        st = head_slices(tuned, layer, num_heads=num_heads, num_kv_heads=num_kv_heads)
        for h in range(num_heads):
            scores[i, h] = fn(_query_head_blocks(sb, h, group), _query_head_blocks(st, h, group), k)
    return scores


def select_heads(
    scores: Float[np.ndarray, "L H"], fraction: float, *, lowest: bool = True,
    per_layer: bool = False,
) -> Bool[np.ndarray, "L H"]:
    """Mask of the ``fraction`` lowest- (or highest-) scored heads, globally or per layer.

    Example::

        >>> import numpy as np
        >>> select_heads(np.array([[0.1, 0.9], [0.5, 0.2]]), 0.5).tolist()
        [[True, False], [False, True]]
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must lie in [0, 1].")
    scores = np.asarray(scores, dtype=np.float64)
    signed = scores if lowest else -scores
    mask = np.zeros(scores.shape, dtype=bool)
    if per_layer:
        count = int(round(fraction * scores.shape[1]))
        for i in range(scores.shape[0]):
            mask[i, np.argsort(signed[i], kind="stable")[:count]] = True
        return mask
    count = int(round(fraction * scores.size))
    flat = np.argsort(signed.ravel(), kind="stable")[:count]
    mask.ravel()[flat] = True
    return mask


def rewind_heads(
    base, tuned, mask: Bool[np.ndarray, "L H"], *, num_heads: int, num_kv_heads: int | None = None
):
    """Restore the masked heads of ``tuned`` to ``base`` (all their q/k/v/o slices).

    ``mask[l, h]`` refers to query head h of the l-th layer (sorted layer keys). A kv head is
    rewound only when every query head of its group is masked (DERIVED GQA rule). Non-attention
    parameters stay as in ``tuned``. Equivalent to zeroing the head's increment.

    Returns:
      A new parameter tree (``tuned`` is not modified).

    Example::

        >>> import jax.numpy as jnp, numpy as np
        >>> mk = lambda v: {"layers": {0: {"self_attn": {p: {"kernel": jnp.full((4, 4), v)}
        ...     for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}}}
        >>> out = rewind_heads(mk(0.0), mk(1.0), np.array([[True, False]]), num_heads=2)
        >>> out["layers"][0]["self_attn"]["q_proj"]["kernel"][0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    num_kv_heads = num_kv_heads or num_heads
    group = num_heads // num_kv_heads
    layers = sorted(_layers(tuned))
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (len(layers), num_heads):
        raise ValueError(
            f"mask has shape {mask.shape}; expected "
            f"(n_layers={len(layers)}, num_heads={num_heads})."
        )
    out = jax.tree.map(lambda x: x, tuned)  # structural copy
    for i, layer in enumerate(layers):
        if not mask[i].any():
            continue
        kv_mask = mask[i].reshape(num_kv_heads, group).all(axis=1)
        for proj in ATTENTION_PROJECTIONS:
            heads_mask = kv_mask if proj in ("k_proj", "v_proj") else mask[i]
            nh = len(heads_mask)
            layout = "llama_out" if proj == "o_proj" else "llama_qkv"
            b = split_heads(jnp.asarray(_kernel(base, layer, proj)), layout=layout, num_heads=nh)
            t = split_heads(jnp.asarray(_kernel(tuned, layer, proj)), layout=layout, num_heads=nh)
            sel = jnp.asarray(heads_mask)[:, None, None]
            merged = merge_heads(jnp.where(sel, b, t), layout=layout)
            out["layers"][layer]["self_attn"][proj]["kernel"] = merged
    return out


def rewind_curve(base, tuned, scores: Float[np.ndarray, "L H"], fractions: Sequence[float],
                 evaluate: Callable, *, lowest: bool = True, num_heads: int,
                 num_kv_heads: int | None = None) -> list:
    """``evaluate(params)`` of ``tuned`` with the ``fraction`` lowest- (``lowest=False``:
    highest-) scored heads rewound to ``base``, for each fraction (:func:`select_heads`,
    :func:`rewind_heads`): the cost of undoing a fine-tune head by head.

    Example::

        >>> import jax.numpy as jnp, numpy as np
        >>> mk = lambda v: {"layers": {0: {"self_attn": {p: {"kernel": jnp.full((4, 4), v)}
        ...     for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}}}
        >>> total = lambda p: float(p["layers"][0]["self_attn"]["q_proj"]["kernel"].sum())
        >>> rewind_curve(mk(0.0), mk(1.0), np.array([[0.1, 0.9]]), [0.0, 0.5, 1.0], total,
        ...              num_heads=2)
        [16.0, 8.0, 0.0]
    """
    return [evaluate(rewind_heads(base, tuned, select_heads(scores, f, lowest=lowest),
                                  num_heads=num_heads, num_kv_heads=num_kv_heads))
            for f in fractions]


def interpolate(params_a, params_b, alpha: float):
    """Linear interpolation ``(1 − α)·a + α·b`` leaf by leaf (domain connectivity).

    Example::

        >>> import jax.numpy as jnp
        >>> interpolate({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, 0.25)["w"].tolist()
        [0.25, 0.25]
    """
    sa, sb = jax.tree.structure(params_a), jax.tree.structure(params_b)
    if sa != sb:
        raise ValueError("params_a and params_b have different tree structures; same architecture?")
    shapes_a = [jnp.shape(x) for x in jax.tree.leaves(params_a)]
    shapes_b = [jnp.shape(x) for x in jax.tree.leaves(params_b)]
    if shapes_a != shapes_b:
        raise ValueError("params_a and params_b have different leaf shapes; same architecture?")
    return jax.tree.map(lambda a, b: (1.0 - alpha) * a + alpha * b, params_a, params_b)


def loss_barrier(alphas: Sequence[float], losses: Sequence[float]) -> float:
    """Barrier ``max_α [L(θ(α)) − ((1−α)L(θ_0) + αL(θ_1))]`` on an interpolation path.

    ``alphas`` must start at 0 and end at 1.

    Example::

        >>> loss_barrier([0.0, 0.5, 1.0], [1.0, 2.0, 1.0])
        1.0
    """
    a = np.asarray(alphas, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    if a.shape != losses.shape or a[0] != 0.0 or a[-1] != 1.0:
        raise ValueError("alphas and losses must align, with alphas[0] == 0 and alphas[-1] == 1.")
    line = (1 - a) * losses[0] + a * losses[-1]
    return float(np.max(losses - line))


__all__ = [
    "ATTENTION_PROJECTIONS", "HEAD_CRITERIA", "LAYOUTS", "head_scores", "head_slices",
    "interpolate", "loss_barrier", "merge_heads", "rewind_curve", "rewind_heads", "select_heads",
    "split_heads",
]
