"""Packed multi-LoRA layer (PLoRA): K adapters of different ranks over one frozen base kernel."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from lowrank_jax.nn.lora import default_a_initializer, lora_scaling
from lowrank_jax.nn.projection import new_param


class AdapterIds(nnx.Variable):
    """Per-example adapter ids stored on a layer by :func:`set_adapter_ids` (not trained)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class MultiLoRALinear(nnx.Linear):
    """``nnx.Linear`` plus K stacked LoRA adapters; example ``b`` uses adapter ``ids[b]``.

    Not a :class:`~lowrank_jax.nn.LoRA` itself: its body is K adapters of different ranks packed
    in ``[K, in, R]`` / ``[K, R, out]`` and routed per example (a grouped kernel), which one
    ``A [in, r]``, ``B [r, out]`` pair cannot hold; it shares the plumbing (PEFT's scale
    :func:`~lowrank_jax.nn.lora_scaling`, the initializer, ``nnx.LoRAParam`` factors carrying
    the kernel's logical axes).

    .. math:: y_b = x_b W + c + s_k \\,(x_b A_k \\odot m_k)(B_k),\\quad k = \\mathrm{ids}_b,\\;
        s_k = \\alpha_k / r_k,\\; m_k = [1]^{r_k}[0]^{R - r_k}

    The state keeps ``nnx.Linear``'s names (``kernel``, ``bias``; train with
    ``wrt=nnx.LoRAParam`` so they stay frozen) and adds ``lora_a [K, in, R]`` and
    ``lora_b [K, R, out]`` (``nnx.LoRAParam``), ``R = round_up(max r_k, rank_pad)``. The padded
    slots are zero at init and multiplied by the static mask ``m_k`` in the forward pass, so their
    gradient is exactly zero under any loss.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> layer = MultiLoRALinear(16, 8, ranks=(2, 4, 8), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((3, 5, 16)), jnp.array([0, 2, 1])).shape
        (3, 5, 8)

    Args:
        in_features, out_features: sizes, as ``nnx.Linear``.
        ranks: K adapter ranks (each ``1 ≤ r_k ≤ min(in, out)``; 0 marks an unused slot).
        alphas: K scale numerators (default ``r_k``, i.e. scale 1); use_rslora: ``α/√r``.
        rank_pad: pad R to a multiple of this (DERIVED default 8: f32 MMA granularity).
        implementation: ``"ragged"`` (sort rows by adapter, ``ragged_dot``), ``"pallas"``
            (same layout, grouped Pallas kernel; ``interpret`` for CPU) or ``"gather"``
            (per-example ``einsum`` with gathered adapters; any order, no sort).
        kwargs: everything else ``nnx.Linear`` takes (``use_bias``, ``dtype``, ``rngs``, ...).

    References:
        Yan et al, `PLoRA <https://arxiv.org/abs/2508.02932>`_, 2025; Hu et al,
        `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        ranks: Sequence[int],
        alphas: Sequence[float] | None = None,
        use_rslora: bool = False,
        rank_pad: int = 8,
        implementation: Literal["ragged", "pallas", "gather"] = "ragged",
        interpret: bool = False,
        a_initializer=default_a_initializer,
        rngs: nnx.Rngs,
        **linear_kwargs: Any,
    ):
        super().__init__(in_features, out_features, rngs=rngs, **linear_kwargs)
        ranks = tuple(int(r) for r in ranks)
        if not ranks or any(r < 0 or r > min(in_features, out_features) for r in ranks):
            raise ValueError(
                f"MultiLoRALinear: ranks={ranks} must be a non-empty sequence of ints in "
                f"[0, {min(in_features, out_features)}] (0 = unused slot)."
            )
        if alphas is not None and len(alphas) != len(ranks):
            raise ValueError(
                f"MultiLoRALinear: alphas has {len(alphas)} entries but ranks has {len(ranks)}; "
                "give one alpha per adapter."
            )
        if implementation not in ("ragged", "pallas", "gather"):
            raise ValueError(
                f"MultiLoRALinear: implementation={implementation!r}; use 'ragged', 'pallas' "
                "or 'gather'."
            )
        self.ranks = ranks
        self.num_adapters = len(ranks)
        self.r_max = max(1, _round_up(max(ranks), rank_pad))
        alphas = [None] * len(ranks) if alphas is None else list(alphas)
        self.scales = tuple(lora_scaling(r, al, use_rslora) if r > 0 else 0.0
                            for r, al in zip(ranks, alphas))
        self.implementation, self.interpret = implementation, interpret
        k, r_max, pdt = self.num_adapters, self.r_max, self.param_dtype
        mask = self.rank_mask().astype(pdt)
        a = a_initializer(rngs.params(), (k, in_features, r_max), pdt) * mask[:, None, :]
        # the factors carry the kernel's logical axes, as LoRA's (adapter and rank axes unsharded)
        names = self.kernel.get_metadata().get("out_sharding")
        a_axes, b_axes = ((None, names[0], None), (None, None, names[1])) if names else (None,) * 2
        self.lora_a = new_param(nnx.LoRAParam, a, a_axes, self.kernel)
        self.lora_b = new_param(nnx.LoRAParam, jnp.zeros((k, r_max, out_features), pdt), b_axes,
                                self.kernel)
        self.adapter_ids = AdapterIds(None)

    def rank_mask(self) -> Float[Array, "k r"]:
        """Static ``[K, R]`` mask: 1 where the column index is below ``r_k``."""
        return (jnp.arange(self.r_max)[None, :] < jnp.asarray(self.ranks)[:, None]).astype(
            jnp.float32)

    def adapter(self, k: int) -> tuple[Float[Array, "in r"], Float[Array, "r out"]]:
        """Adapter ``k`` cropped to its rank: ``(A_k[:, :r_k], B_k[:r_k])``."""
        r = self.ranks[k]
        return self.lora_a[...][k, :, :r], self.lora_b[...][k, :r]

    def set_adapter(self, k: int, a: Float[Array, "in r"], b: Float[Array, "r out"]) -> None:
        """Write adapter ``k`` (``a [in, r_k]``, ``b [r_k, out]``); padded slots stay zero."""
        r = self.ranks[k]
        if a.shape != (self.in_features, r) or b.shape != (r, self.out_features):
            raise ValueError(
                f"MultiLoRALinear.set_adapter: got a {a.shape}, b {b.shape}; adapter {k} needs "
                f"a {(self.in_features, r)} and b {(r, self.out_features)}."
            )
        self.lora_a[...] = self.lora_a[...].at[k].set(0.0).at[k, :, :r].set(a)
        self.lora_b[...] = self.lora_b[...].at[k].set(0.0).at[k, :r].set(b)

    def delta(self, k: int) -> Float[Array, "in out"]:
        """Dense update ``s_k A_k B_k`` of adapter ``k``."""
        a, b = self.adapter(k)
        return self.scales[k] * (a @ b)

    def __call__(
        self,
        inputs: Float[ArrayLike, "b ... in"],
        adapter_ids: Int[ArrayLike, " b"] | None = None,
    ) -> Float[Array, "b ... out"]:
        out = super().__call__(inputs)
        ids = self.adapter_ids.get_value() if adapter_ids is None else adapter_ids
        if ids is None:
            raise ValueError(
                "MultiLoRALinear: adapter_ids is None; pass ids [batch] or call "
                "set_adapter_ids(model, ids) first."
            )
        ids = jnp.asarray(ids, jnp.int32)
        if ids.shape != inputs.shape[:1]:
            raise ValueError(
                f"MultiLoRALinear: adapter_ids shape {ids.shape} must be ({inputs.shape[0]},), "
                "one id per example."
            )
        mask = self.rank_mask()
        a = self.lora_a[...] * mask[:, None, :].astype(self.lora_a[...].dtype)
        b = self.lora_b[...] * mask[:, :, None].astype(self.lora_b[...].dtype)
        scale = jnp.asarray(self.scales, jnp.float32)
        x = inputs
        if self.implementation == "gather":
            h = jnp.einsum("b...i,bir->b...r", x, a[ids].astype(x.dtype))
            h = h * scale[ids].reshape((-1,) + (1,) * (h.ndim - 1)).astype(h.dtype)
            delta = jnp.einsum("b...r,bro->b...o", h, b[ids].astype(h.dtype))
            return out + delta.astype(out.dtype)
        from pallas_kernels.grouped_lora import api as grouped

        batch, tail = x.shape[0], x.shape[1:-1]
        per_example = 1
        for d in tail:
            per_example *= d
        order = jnp.argsort(ids, stable=True)
        inverse = jnp.argsort(order)
        rows = x[order].reshape(batch * per_example, self.in_features)
        sizes = jnp.bincount(ids, length=self.num_adapters).astype(jnp.int32) * per_example
        impl = "xla" if self.implementation == "ragged" else "pallas"
        ranks = jnp.asarray(self.ranks, jnp.int32)
        tiles = grouped.BlockSizes(block_m=16) if self.interpret else None  # per-backend default
        h = grouped.lora_shrink(rows, a, sizes, scale, ranks, implementation=impl,
                                interpret=self.interpret, block_sizes=tiles)
        y = grouped.lora_expand(h.astype(b.dtype), b, sizes, ranks, implementation=impl,
                                interpret=self.interpret, block_sizes=tiles)
        y = y.reshape((batch,) + tail + (self.out_features,))[inverse]
        return out + y.astype(out.dtype)


def multi_lora_layers(model: nnx.Module) -> list[tuple[str, MultiLoRALinear]]:
    """All ``MultiLoRALinear`` submodules as ``(path, layer)``, paths like ``layers/0/mlp/up_proj``
    (the format of :func:`lowrank_jax.nn.lora_layers`)."""
    return [("/".join(str(p) for p in path), m) for path, m in nnx.iter_modules(model)
            if isinstance(m, MultiLoRALinear)]


def set_adapter_ids(model: nnx.Module, ids: Int[Array, " b"] | None) -> None:
    """Store per-example adapter ids on every ``MultiLoRALinear`` of ``model``.

    Lets an unmodified model (e.g. ``Llama``) call its projections as ``proj(x)``; call this
    inside the jitted step, before the forward pass.
    """
    for _, layer in multi_lora_layers(model):
        layer.adapter_ids.set_value(ids)


def apply_multi_lora(
    model: nnx.Module,
    *,
    ranks: Sequence[int],
    alphas: Sequence[float] | None = None,
    targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"),
    rngs: nnx.Rngs,
    **kwargs: Any,
) -> int:
    """Replace every ``nnx.Linear`` whose attribute name is in ``targets`` by a
    :class:`MultiLoRALinear` sharing its kernel and bias; returns how many were replaced.

    Example::

        >>> from flax import nnx
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up_proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        >>> m = M(); apply_multi_lora(m, ranks=(1, 2), rngs=nnx.Rngs(1))
        1
    """
    found = []
    for path, module in nnx.iter_modules(model):
        if (isinstance(module, nnx.Linear) and not isinstance(module, MultiLoRALinear)
                and path and str(path[-1]) in targets):
            found.append((path, module))
    for path, lin in found:
        new = MultiLoRALinear(lin.in_features, lin.out_features, ranks=ranks, alphas=alphas,
                              use_bias=lin.bias is not None, dtype=lin.dtype,
                              param_dtype=lin.param_dtype, rngs=rngs, **kwargs)
        new.kernel = lin.kernel
        new.bias = lin.bias
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) or not hasattr(parent, str(p)) else getattr(
                parent, str(p))
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, str(path[-1]), new)
    return len(found)
