"""LoRA initialisations that keep the layer's initial output: standard, PiSSA, OLoRA, Gap-Init.

Each function rewrites ``layer.lora_a`` ``[in, r]``, ``layer.lora_b`` ``[r, out]`` and, where the
method moves weight into the adapter, ``layer.kernel`` ``[in, out]`` of a
:class:`~lowrank_jax.nn.LoRALinear`, so that ``x K + s · x A B`` is unchanged at init.

References:
    Hu et al, `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021; Meng et al,
    `PiSSA <https://arxiv.org/abs/2404.02948>`_, 2024; Büyükakyüz,
    `OLoRA <https://arxiv.org/abs/2406.01775>`_, 2024; Zhao, Han, Hovy, `When Is Rank-1 Enough?
    Geometry-Guided Initialization for Parameter-Efficient Fine-Tuning
    <https://arxiv.org/abs/2602.01522>`_, ICML 2026.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from lowrank_jax.nn.capture import capture
from lowrank_jax.nn.inject import lora_layers
from lowrank_jax.nn.lora import LoRALinear, default_a_initializer

InitMethod = Literal["standard", "peft", "gaussian", "pissa", "olora", "gap"]
INIT_METHODS = ("standard", "peft", "gaussian", "pissa", "olora", "gap")


def _flat_rows(x, in_features: int, name: str):
    x = jnp.asarray(x, jnp.float32)
    if x.shape[-1] != in_features:
        raise ValueError(
            f"init_lora: {name} has shape {x.shape} but the layer takes {in_features} input "
            f"features; pass the layer's inputs, shape [..., {in_features}]."
        )
    return x


def gap_direction(
    kernel: Float[Array, "in out"],
    calibration_inputs: Float[Array, "... in"],
    reference_inputs: Float[Array, "... in"] | None = None,
) -> Float[Array, " out"]:
    """Unit gap direction in the layer's output space from calibration activations.

    .. math::

        z_i = \\operatorname{mean}_t(x_{i,t}) K,\\quad g_i = z_i - \\bar z_{\\text{ref}},\\quad
        \\hat g = \\frac{\\sum_i g_i/\\|g_i\\|}{\\|\\sum_i g_i/\\|g_i\\|\\|}

    A sample is a leading index of a ``[samples, tokens, in]`` array (tokens are mean-pooled) or a
    row of a ``[rows, in]`` array. DERIVED (the paper's gap is image-vs-text tokens in an MLLM):
    for a text-only fine-tune the gap is the shift of the layer's mean output between the
    fine-tuning data (``calibration_inputs``) and ``reference_inputs`` (e.g. pretraining-like
    text); without a reference it is the direction of the mean output itself (the translation
    component of the activations). The paper's 95th-percentile outlier drop is not applied; the
    per-sample unit normalisation ("smooth") is.

    Example::

        >>> import jax.numpy as jnp
        >>> g = gap_direction(jnp.eye(3), jnp.array([[1.0, 0, 0], [2.0, 0, 0]]))
        >>> g.tolist()
        [1.0, 0.0, 0.0]
    """
    x = jnp.asarray(calibration_inputs, jnp.float32)
    k = jnp.asarray(kernel, jnp.float32)
    pooled = x.mean(axis=1) if x.ndim == 3 else x.reshape(-1, x.shape[-1])
    z = pooled @ k
    if reference_inputs is not None:
        ref = jnp.asarray(reference_inputs, jnp.float32).reshape(-1, x.shape[-1])
        z = z - (ref @ k).mean(axis=0)
    unit = z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-12)
    g = unit.mean(axis=0)
    norm = jnp.linalg.norm(g)
    if not bool(norm > 1e-8):
        raise ValueError(
            "gap_direction: the calibration activations give a zero gap (all samples cancel); "
            "pass more or different calibration_inputs, or reference_inputs."
        )
    return g / norm


def _orthonormal_rows_with(first, rank: int, key):
    """``[rank, d]`` with orthonormal rows, row 0 = ``first`` (unit), the rest random."""
    d = first.shape[0]
    if rank == 1:
        return first[None, :]
    noise = jax.random.normal(key, (d, rank - 1), jnp.float32)
    basis = jnp.concatenate([first[:, None], noise], axis=1)
    q, r = jnp.linalg.qr(basis)
    q = q * jnp.sign(jnp.diagonal(r))[None, :]  # keep column 0 = +first
    return q.T


def init_lora(
    layer: LoRALinear,
    method: InitMethod,
    *,
    key: jax.Array | None = None,
    calibration_inputs: Float[Array, "... in"] | None = None,
    reference_inputs: Float[Array, "... in"] | None = None,
    gap_vector: Float[Array, " out"] | None = None,
    noise: float = 0.0,
) -> LoRALinear:
    """Re-initialise a LoRA layer in place; the layer's output at init is unchanged.

    Methods (``K`` = kernel ``[in, out]``, ``s`` = scaling, ``A`` = lora_a, ``B`` = lora_b):

    - ``"standard"``: ``A ~ he_uniform = U(±√(6/in))``, ``B = 0`` (Flax ``nnx.LoRA``'s
      default and :class:`LoRALinear`'s).
    - ``"peft"``: ``A ~ U(±1/√in)``, ``B = 0``: PEFT's default, torch's
      ``kaiming_uniform_(a=√5)``, √6 smaller than ``"standard"`` (use it to match a PEFT run's
      effective learning rate of ``B``).
    - ``"gaussian"``: ``A ~ N(0, 1/r²)``, ``B = 0``.
    - ``"pissa"``: ``K = U S Vᵀ``; ``A = U_r √(S_r/s)``, ``B = √(S_r/s) V_rᵀ``,
      ``K ← K − s A B`` (principal singular directions train, the residual is frozen).
    - ``"olora"``: PEFT's OLoRA in torch layout ``W = Kᵀ = Q R``: ``lora_B = Q_{:, :r}``,
      ``lora_A = R_{:r}``, i.e. ``A = R_{:r}ᵀ``, ``B = Q_{:, :r}ᵀ``, and ``K ← K − s A B``
      (no division by ``s``, as in PEFT).
    - ``"gap"`` (Gap-Init): ``A = 0``; row 0 of ``B`` is the unit gap direction ``ĝ`` in output
      space (:func:`gap_direction`, or ``gap_vector``), optionally noised
      ``normalize(ĝ + σ ξ)``; rows ``1..r−1`` are a random orthonormal complement (never zero:
      a zero row of ``B`` with ``A = 0`` gets no gradient ever). DERIVED: the complement rows
      and the output-space mapping ``ĝ = normalize(mean(x) K)`` for every module type.

    Args:
        layer: the :class:`LoRALinear` to rewrite (not merged).
        method: one of ``"standard"``, ``"peft"``, ``"gaussian"``, ``"pissa"``, ``"olora"``,
            ``"gap"``.
        key: PRNG key for the random parts (standard, gaussian, gap's extra rows and noise).
        calibration_inputs: ``[..., in]`` inputs of this layer on the fine-tuning data (gap).
        reference_inputs: optional ``[..., in]`` inputs on reference data (gap).
        gap_vector: an explicit ``[out]`` direction instead of calibration inputs (gap).
        noise: σ of the gap-noise ablation (``cos(b, ĝ)`` decreases with σ).

    Returns:
        The same layer.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> layer = LoRALinear(8, 6, rank=2, rngs=nnx.Rngs(0))
        >>> x = jax.random.normal(jax.random.key(1), (4, 8))
        >>> before = layer(x)
        >>> _ = init_lora(layer, "olora")
        >>> bool(jnp.allclose(layer(x), before, atol=1e-5))
        True
    """
    if not isinstance(layer, LoRALinear):
        raise ValueError(f"init_lora: layer is a {type(layer).__name__}; pass a LoRALinear.")
    if method not in INIT_METHODS:
        raise ValueError(f"init_lora: method={method!r} is unknown; use one of {INIT_METHODS}.")
    if layer.merged:
        raise ValueError("init_lora: the layer's adapter is merged; unmerge it first.")
    key = jax.random.key(0) if key is None else key
    in_f, out_f, rank, pdt = layer.in_features, layer.out_features, layer.rank, layer.param_dtype
    s = layer.scaling
    if method in ("standard", "peft", "gaussian"):
        if method == "standard":
            a = default_a_initializer(key, (in_f, rank), pdt)
        elif method == "peft":
            bound = 1.0 / math.sqrt(in_f)
            a = jax.random.uniform(key, (in_f, rank), pdt, -bound, bound)
        else:
            a = jax.random.normal(key, (in_f, rank), pdt) / rank
        layer.lora_a[...] = a
        layer.lora_b[...] = jnp.zeros((rank, out_f), pdt)
    elif method == "pissa":
        layer.init_pissa()
    elif method == "olora":
        w = layer.kernel[...].astype(jnp.float32).T  # torch layout [out, in]
        q, r = jnp.linalg.qr(w)
        a = r[:rank].T
        b = q[:, :rank].T
        layer.lora_a[...] = a.astype(pdt)
        layer.lora_b[...] = b.astype(pdt)
        a, b = layer.lora_a[...].astype(jnp.float32), layer.lora_b[...].astype(jnp.float32)
        layer.kernel[...] = (layer.kernel[...].astype(jnp.float32) - s * (a @ b)).astype(pdt)
    else:  # gap
        if gap_vector is None:
            if calibration_inputs is None:
                raise ValueError(
                    "init_lora: method='gap' needs calibration_inputs (this layer's inputs on "
                    "the fine-tuning data) or an explicit gap_vector."
                )
            x = _flat_rows(calibration_inputs, in_f, "calibration_inputs")
            ref = None
            if reference_inputs is not None:
                ref = _flat_rows(reference_inputs, in_f, "reference_inputs")
            g = gap_direction(layer.kernel[...], x, ref)
        else:
            g = jnp.asarray(gap_vector, jnp.float32)
            if g.shape != (out_f,):
                raise ValueError(
                    f"init_lora: gap_vector has shape {g.shape}; it must be [out]=({out_f},)."
                )
            g = g / jnp.maximum(jnp.linalg.norm(g), 1e-12)
        noise_key, basis_key = jax.random.split(key)
        if noise > 0:
            xi = jax.random.normal(noise_key, g.shape)
            g = g + noise * xi / jnp.linalg.norm(xi)
            g = g / jnp.linalg.norm(g)
        layer.lora_a[...] = jnp.zeros((in_f, rank), pdt)
        layer.lora_b[...] = _orthonormal_rows_with(g, rank, basis_key).astype(pdt)
    return layer


def capture_layer_inputs(
    model: nnx.Module, forward: Callable[[nnx.Module], Any], paths: list[str] | None = None
) -> dict[str, jax.Array]:
    """Run ``forward(model)`` eagerly and return each LoRA layer's inputs ``{path: [..., in]}``
    (through the package's one capture mechanism, :func:`lowrank_jax.nn.capture.capture`).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up = LoRALinear(3, 2, rank=1, rngs=nnx.Rngs(0))
        >>> m = M()
        >>> capture_layer_inputs(m, lambda m: m.up(jnp.ones((5, 3))))["up"].shape
        (5, 3)
    """
    found = {p: m for p, m in lora_layers(model)}
    targets = list(found) if paths is None else list(paths)
    unknown = [p for p in targets if p not in found]
    if unknown:
        raise ValueError(f"capture_layer_inputs: unknown LoRA paths {unknown[:5]}; "
                         f"available: {list(found)[:12]}")
    with capture(model, targets) as recorder:
        forward(model)
    return {name: jnp.concatenate([jnp.asarray(x).reshape(-1, x.shape[-1]) for x in seen])
            for name, seen in recorder.inputs.items() if seen}


def init_lora_model(
    model: nnx.Module,
    method: InitMethod,
    *,
    key: jax.Array | None = None,
    calibration_forward: Callable[[nnx.Module], Any] | None = None,
    reference_forward: Callable[[nnx.Module], Any] | None = None,
    noise: float = 0.0,
) -> list[str]:
    """Apply :func:`init_lora` to every :class:`LoRALinear` in ``model``; returns their paths.

    For ``"gap"``, ``calibration_forward(model)`` runs the model on calibration data once (and
    ``reference_forward`` on reference data, optional) to collect each layer's inputs. The
    inputs are captured with the adapters still at their previous init, whose output is that of
    the base model when they were freshly added (``B = 0``).

    Example::

        >>> from flax import nnx
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up = LoRALinear(3, 2, rank=1, rngs=nnx.Rngs(0))
        >>> init_lora_model(M(), "olora")
        ['up']
    """
    key = jax.random.key(0) if key is None else key
    layers = lora_layers(model)
    calib = ref = {}
    if method == "gap":
        if calibration_forward is None:
            raise ValueError("init_lora_model: method='gap' needs calibration_forward "
                             "(a function running the model on calibration data).")
        calib = capture_layer_inputs(model, calibration_forward)
        if reference_forward is not None:
            ref = capture_layer_inputs(model, reference_forward)
    for i, (path, layer) in enumerate(layers):
        init_lora(layer, method, key=jax.random.fold_in(key, i),
                  calibration_inputs=calib.get(path), reference_inputs=ref.get(path),
                  noise=noise)
    return [p for p, _ in layers]


def _factor_name(path) -> str:
    """The last meaningful key of a state path (``.../lora_a/value`` -> ``lora_a``)."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    while names and names[-1] in ("value", "raw_value"):
        names.pop()
    return names[-1] if names else ""


def peft_lora_state(lora_state: Any, key: jax.Array) -> Any:
    """A fresh PEFT-default draw of every LoRA factor in a state tree: ``A ~ U(±1/√in)``,
    ``B = 0`` (the ``"peft"`` method of :func:`init_lora`, on a pytree instead of a layer).

    Every leaf named ``lora_a`` (shape ``[in, r]``) gets its own key, in tree order, from
    ``jax.random.split(key, max(64, count))``; every other leaf becomes zeros. Being a pure
    function of ``(tree, key)``, it re-initialises many seeds from one ``nnx.split`` state (a
    sweep over seeds, ``vmap`` over keys) without touching the model.

    Args:
        lora_state: the LoRA part of a model, e.g. ``nnx.split(model, nnx.LoRAParam, ...)[1]``,
            or any pytree whose factor leaves are keyed ``lora_a`` / ``lora_b``.
        key: PRNG key.

    Returns:
        A tree of the same structure, shapes and dtypes.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> tree = {"up": {"lora_a": jnp.ones((4, 2)), "lora_b": jnp.ones((2, 3))}}
        >>> new = peft_lora_state(tree, jax.random.key(0))
        >>> float(jnp.abs(new["up"]["lora_a"]).max()) <= 0.5, float(new["up"]["lora_b"].sum())
        (True, 0.0)
    """
    paths = jax.tree_util.tree_flatten_with_path(lora_state)[0]
    count = sum(_factor_name(p) == "lora_a" for p, _ in paths)
    keys = iter(jax.random.split(key, max(64, count)))

    def draw(path, value):
        if _factor_name(path) == "lora_a":
            bound = 1.0 / math.sqrt(value.shape[0])
            return jax.random.uniform(next(keys), value.shape, value.dtype, -bound, bound)
        return jnp.zeros_like(value)

    return jax.tree_util.tree_map_with_path(draw, lora_state)


__all__ = ["INIT_METHODS", "capture_layer_inputs", "gap_direction", "init_lora",
           "init_lora_model", "peft_lora_state"]
