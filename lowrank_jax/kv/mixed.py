"""xKV with bits allocated per singular direction (reverse water-filling over the spectrum).

``xkv_quant*`` keep the top ``r`` singular directions of each layer group at one bit width
and drop the rest. Transform coding says that is wasteful: with a budget of bytes, the error
``Σ_j σ_j² · D_j(b_j)`` (``D_j`` the relative quantization error of direction ``j`` at
``b_j`` bits, 1 when dropped) is smallest when the strong directions get many bits and the
weak ones few (2 or 1) instead of none. Here every direction ``j`` of a group's SVD
``X = U Σ Vᵀ`` gets its own pair ``(b_A, b_B)`` of bits for its token factor ``u_j`` and its
basis row ``σ_j v_jᵀ`` (or is dropped), chosen by a Lagrangian search that minimises

.. math::

    \\sum_j \\sigma_j^2\\,\\big(e_A(u_j, b_A) + e_B(v_j, b_B)\\big)
    \\quad\\text{s.t.}\\quad \\sum_j \\mathrm{bytes}(b_A, b_B) \\le \\text{budget},

where ``e_A``, ``e_B`` are the *measured* relative errors of the stored (Hadamard-rotated,
clip-searched, group-quantized) vectors at each bit width. Directions with the same pair are
stored together as one "tier" (a :class:`~lowrank_jax.kv.quantized.QuantizedArray` of token
factors per group and one of bases per layer); since ``A B = Σ_j a_j b_j``, the order of the
directions does not matter and no index is stored. Everything stored is counted.

The key / value split of the budget is ``key_share`` (perplexity follows the key error: an
energy-based K-vs-V split lost in round 3); within a kind the budget is shared by the groups in
proportion to their layers (``allocation="group"``), or one Lagrange multiplier for all groups
of the kind, on errors relative to each group's energy (``"global"``).

References:
    Chang et al, `xKV <https://arxiv.org/abs/2503.18893>`_, 2025; the reverse water-filling
    rule of rate-distortion theory (Cover & Thomas, *Elements of Information Theory*, 10.3.3).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from lowrank_jax.kv.compress import SVDCache, group_matrix, thin_svd
from lowrank_jax.kv.hybrid import FULL_BITS, hadamard_rotate
from lowrank_jax.kv.quantized import (
    STORAGE_DTYPE,
    QuantizedArray,
    check_kv_bits,
    dequantize_kv,
    quantize,
    quantized_nbytes,
)
from lowrank_jax.kv.ranks import DEFAULT_GROUP_SIZE, layer_groups

# the widths a direction's factor or basis may take (1 bit is supported but was never chosen
# on SmolLM2: its error, ~0.4 of the direction, costs more than dropping weak directions saves)
DEFAULT_BIT_CHOICES = (2, 4, 8)
DEFAULT_TOKEN_GROUP = 256  # tokens per quantization / Hadamard group of a token factor
DEFAULT_BASIS_GROUP = 64  # channels per group of a basis row (capped at head_dim)
DEFAULT_KEY_SHARE = 0.6  # fraction of the budget spent on keys


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["key_factors", "value_factors", "key_bases", "value_bases", "sink_keys",
                 "sink_values"],
    meta_fields=["groups", "prefill_length", "rope_theta"],
)
@dataclasses.dataclass(frozen=True)
class MixedBitsXKVCache:
    """xKV factors in tiers of equal bits.

    Attributes:
        key_factors, value_factors: per layer group, a tuple of tiers; a tier is a
            :class:`QuantizedArray` of Hadamard-rotated token factors ``[b, r_t, N_pad]``
            (direction-major, so a direction's codes are one packed byte row; tokens padded
            to whole groups, padding stored and counted) or, at 16 bits, an fp16 array
            ``[b, r_t, N]``.
        key_bases, value_bases: per layer, the matching tuple of tiers ``[b, hk, r_t, d]``
            (rotated along ``d`` when quantized).
        sink_keys, sink_values: the first ``S`` prompt tokens, exact ``[layers, b, S, hk, d]``.
        groups, prefill_length, rope_theta: layer groups, ``L``, RoPE base (static).
    """

    key_factors: tuple
    value_factors: tuple
    key_bases: tuple
    value_bases: tuple
    sink_keys: Array
    sink_values: Array
    groups: tuple
    prefill_length: int
    rope_theta: float

    @property
    def n_layers(self) -> int:
        return len(self.key_bases)

    @property
    def ranks(self) -> tuple[tuple[int, int], ...]:
        """``(directions kept for K, for V)`` per group, over all tiers."""
        width = lambda tiers: sum(t.shape[-2] for t in tiers)  # noqa: E731
        return tuple((width(k), width(v)) for k, v in zip(self.key_factors, self.value_factors))

    def tiers(self, group: int, kind: str = "k") -> list[tuple[int, int, int]]:
        """``(factor bits, basis bits, directions)`` of each tier of a group."""
        factors = (self.key_factors if kind == "k" else self.value_factors)[group]
        bases = (self.key_bases if kind == "k" else self.value_bases)[self.groups[group][0]]
        bits = lambda t: t.bits if isinstance(t, QuantizedArray) else FULL_BITS  # noqa: E731
        return [(bits(a), bits(b), a.shape[-2]) for a, b in zip(factors, bases)]

    def group_of(self, layer: int) -> int:
        for g, members in enumerate(self.groups):
            if layer in members:
                return g
        raise ValueError(f"layer={layer} is outside the cache's {self.n_layers} layers.")


def _pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two ``<= min(n, cap)`` that divides ``n`` (for the basis group)."""
    g = 1
    while g * 2 <= cap and n % (g * 2) == 0:
        g *= 2
    return g


def _token_group(tokens: int, cap: int) -> int:
    """Token-group size: ``cap`` (a power of two), or the next power of two ``>= tokens``
    when the prompt is shorter (no group of mostly padding)."""
    return min(cap, 1 << max(0, math.ceil(math.log2(max(tokens, 1)))))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _store(x, bits: int, axis: int, group: int, dtype):
    """Pad ``axis`` to whole groups, rotate, quantize (clip-searched); fp16 at 16 bits."""
    if bits == FULL_BITS:
        return x.astype(dtype)
    n = x.shape[axis]
    padded = -(-n // group) * group
    x = jnp.pad(x, [(0, padded - n if i == axis else 0) for i in range(x.ndim)])
    return quantize(hadamard_rotate(x, axis, group), bits, axis=axis, group_size=group,
                    dtype=dtype, search_clip=bits <= 4)  # at 8 bits min/max is as good


@functools.partial(jax.jit, static_argnums=(1,))
def _load(x, length: int) -> jax.Array:
    if not isinstance(x, QuantizedArray):
        return x.astype(jnp.float32)
    out = hadamard_rotate(dequantize_kv(x), x.axis, x.group_size, inverse=True)
    return jax.lax.slice_in_dim(out, 0, length, axis=x.axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _store_and_errors(x, bits: int, group: int, dtype):
    """``x [..., n]`` stored at ``bits`` along its last axis, and the squared error of each
    of its vectors ``[...]``."""
    stored = _store(x, bits, x.ndim - 1, group, dtype)
    return stored, jnp.sum((_load(stored, x.shape[-1]) - x) ** 2, axis=-1)


def _take(stored, idx: np.ndarray, axis: int):
    """The directions ``idx`` (along ``axis``, the axis before the grouped last one) of a
    stored array: whole packed byte rows, no re-quantization (each direction is quantized,
    rotated and packed on its own)."""
    if not isinstance(stored, QuantizedArray):
        return jnp.asarray(np.take(np.asarray(stored), idx, axis=axis))
    shape = stored.shape
    row = shape[-1] * stored.bits // 8  # bytes of one direction's codes
    codes = np.asarray(stored.codes).reshape(shape[:-1] + (row,))
    new_shape = shape[:axis] + (len(idx),) + shape[axis + 1:]
    pick = lambda a: jnp.asarray(np.take(np.asarray(a), idx, axis=axis))  # noqa: E731
    return QuantizedArray(codes=jnp.asarray(np.take(codes, idx, axis=axis).reshape(-1)),
                          scale=pick(stored.scale), minimum=pick(stored.minimum),
                          shape=new_shape, bits=stored.bits, axis=stored.axis,
                          group_size=stored.group_size)


@dataclasses.dataclass
class _Matrix:
    """One group's keys or values: SVD, per-direction errors for each bit width, costs."""

    group: int
    kind: str
    s: np.ndarray  # [k] σ_j² summed over the batch
    factors: dict  # bits -> stored token factors of all k directions [b, k, N_pad]
    bases: dict  # bits -> per layer, stored bases of all k directions [b, hk, k, d]
    energy: float
    factor_error: dict  # bits -> [k] squared error · σ_j², summed over the batch
    basis_error: dict
    factor_cost: dict  # bits -> bytes per direction
    basis_cost: dict


def _analyse(x, svd_cache, group, kind, members, kv_heads, head_dim, bit_widths, token_group,
             basis_group, dtype) -> _Matrix:
    """The matrix's SVD and its directions stored at every width (memoised in ``svd_cache``:
    they do not depend on the ratio, so every ratio and split of a prefill shares them)."""
    compute = functools.partial(_analyse_uncached, group=group, kind=kind, members=members,
                                kv_heads=kv_heads, head_dim=head_dim, bit_widths=bit_widths,
                                token_group=token_group, basis_group=basis_group, dtype=dtype)
    if svd_cache is None:
        return compute(x, None)
    tag = ("xkv_mixed", tuple(members), kind, tuple(bit_widths), token_group, basis_group,
           jnp.dtype(dtype).name)
    return svd_cache.memo(tag, x, lambda: compute(x, svd_cache))


def _analyse_uncached(x, svd_cache, *, group, kind, members, kv_heads, head_dim, bit_widths,
                      token_group, basis_group, dtype) -> _Matrix:
    u, s, vt = svd_cache.get(x) if svd_cache is not None else thin_svd(x)
    b, n, k = u.shape
    ut = jnp.transpose(u, (0, 2, 1))  # b k N: each direction's token factor is one row
    rows = (s[..., None] * vt).reshape(b, k, len(members), kv_heads, head_dim)
    s2 = np.asarray(s, np.float64) ** 2  # b k
    factors, bases, factor_error, basis_error, factor_cost, basis_cost = {}, {}, {}, {}, {}, {}
    item = jnp.dtype(dtype).itemsize
    n_pad = -(-n // token_group) * token_group
    for bits in bit_widths:
        # u_j has unit norm, so (squared error) · σ_j² is the direction's loss; the basis rows
        # σ_j v_j are stored as they are and their error is already in those units
        factors[bits], ea = _store_and_errors(ut, bits, token_group, dtype)  # b k
        bases[bits], eb = [], 0.0
        for j in range(len(members)):
            stored, err = _store_and_errors(jnp.transpose(rows[:, :, j], (0, 2, 1, 3)), bits,
                                            basis_group, dtype)  # b hk k
            bases[bits].append(stored)
            eb = eb + np.asarray(err, np.float64).sum(axis=(0, 1))
        factor_error[bits] = (s2 * np.asarray(ea, np.float64)).sum(axis=0)
        basis_error[bits] = eb
        if bits == FULL_BITS:
            factor_cost[bits] = b * n * item
            basis_cost[bits] = len(members) * b * kv_heads * head_dim * item
        else:
            factor_cost[bits] = quantized_nbytes(b * n_pad, bits, b * n_pad // token_group,
                                                 dtype)
            basis_cost[bits] = len(members) * quantized_nbytes(
                b * kv_heads * head_dim, bits, b * kv_heads * head_dim // basis_group, dtype)
    return _Matrix(group, kind, s2.sum(axis=0), factors, bases, float(s2.sum()), factor_error,
                   basis_error, factor_cost, basis_cost)


def _options(m: _Matrix, bit_widths):
    """``(pairs, distortion [k, 1 + P], cost [1 + P])``; option 0 drops the direction."""
    pairs = [(a, b) for a in bit_widths for b in bit_widths]
    dist = np.stack([m.s] + [m.factor_error[a] + m.basis_error[b] for a, b in pairs], axis=1)
    cost = np.asarray([0.0] + [m.factor_cost[a] + m.basis_cost[b] for a, b in pairs])
    return pairs, dist, cost


def _choose(matrices, budget, bit_widths, weights):
    """One Lagrange multiplier for ``matrices`` (distortions scaled by ``weights``): the
    smallest weighted error whose total cost fits ``budget``. Returns per matrix the option
    index of every direction."""
    tables = [_options(m, bit_widths) for m in matrices]

    def pick(lam):
        choice = [np.argmin(w * d + lam * c[None], axis=1) for (_, d, c), w in
                  zip(tables, weights)]
        spent = sum(float(c[ch].sum()) for (_, _, c), ch in zip(tables, choice))
        return choice, spent

    if pick(0.0)[1] <= budget:
        return [t[0] for t in tables], pick(0.0)[0]
    hi = 1.0
    while pick(hi)[1] > budget:  # a multiplier large enough to fit the budget
        hi *= 4.0
        if hi > 1e30:
            raise ValueError("the target ratio leaves no bytes for any factor; lower it.")
    lo = hi
    while pick(lo)[1] <= budget and lo > 1e-30:
        lo /= 4.0
    for _ in range(50):  # geometric bisection: pick(lo) over budget, pick(hi) within
        mid = math.sqrt(lo * hi)
        if pick(mid)[1] > budget:
            lo = mid
        else:
            hi = mid
    return [t[0] for t in tables], pick(hi)[0]


def xkv_mixed_compress(
    keys: Float[Array, "layers b L hk d"], values: Float[Array, "layers b L hk d"], *,
    rope_theta: float, ratio: float | None = None, rank: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE, sink_tokens: int = 1,
    bit_widths: tuple = DEFAULT_BIT_CHOICES, token_group: int = DEFAULT_TOKEN_GROUP,
    basis_group: int = DEFAULT_BASIS_GROUP, key_share: float = DEFAULT_KEY_SHARE,
    allocation: str = "group", full_bits: int = FULL_BITS, dtype=STORAGE_DTYPE,
    svd_cache: SVDCache | None = None,
) -> MixedBitsXKVCache:
    """Cross-layer SVD per group, every singular direction stored at its own bits (or dropped)
    to meet ``ratio`` with every byte counted (see the module docstring).

    Args:
        keys, values: pre-RoPE ``[layers, b, L, hk, d]``.
        rope_theta: RoPE base.
        ratio: target ``exact fp16 bytes / stored bytes``; or ``rank="full"``: every direction
            kept at ``full_bits`` (16 = fp16: the exact cache up to fp16 rounding).
        group_size: layers per shared SVD.
        sink_tokens: leading prompt tokens kept exact (fp16, counted).
        bit_widths: the widths a factor / basis may take (from 1, 2, 4, 8, 16).
        token_group: tokens per quantization and Hadamard group of a token factor (a power
            of two; shorter prompts use the next power of two above their length).
        basis_group: channels per group of a basis row (a power of two dividing ``d``).
        key_share: fraction of the budget (after the sinks) spent on keys.
        allocation: ``"group"`` (each group gets bytes in proportion to its layers) or
            ``"global"`` (one multiplier per kind over all groups, errors relative to each
            group's energy).
        dtype: float dtype of fp16 parts, scales and minima.
        svd_cache: shared exact SVDs of this prefill's group matrices.

    Returns:
        A :class:`MixedBitsXKVCache`.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 64, 1, 8))
        >>> cache = xkv_mixed_compress(k, k, rope_theta=1e4, ratio=4.0, group_size=2)
        >>> from lowrank_jax.kv.methods import cache_ratio
        >>> cache_ratio(cache) >= 4.0
        True
    """
    if keys.ndim != 5 or keys.shape != values.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} must both be "
                         "[layers, batch, tokens, kv_heads, head_dim].")
    if (ratio is None) == (rank is None):
        raise ValueError("give exactly one of ratio= (e.g. 8.0) or rank='full'.")
    if rank is not None and rank != "full":
        raise ValueError(f"rank={rank!r}: this method allocates bits per direction from ratio=;"
                         " only rank='full' (every direction at full_bits) is accepted.")
    widths = tuple(int(b) for b in (bit_widths if rank is None else (full_bits,)))
    for bits in widths:
        if bits != FULL_BITS:
            try:
                check_kv_bits(bits)
            except ValueError:
                raise ValueError(f"bit_widths={bit_widths!r}: each must be 1, 2, 4, 8 or "
                                 f"{FULL_BITS} (fp16).") from None
    if allocation not in ("group", "global"):
        raise ValueError(f"allocation={allocation!r} must be 'group' or 'global'.")
    if not 0.0 < key_share < 1.0:
        raise ValueError(f"key_share={key_share!r} must lie in (0, 1) (e.g. 0.6).")
    n_layers, b, length, hk, d = keys.shape
    if not isinstance(sink_tokens, (int, np.integer)) or not 0 <= sink_tokens < length:
        raise ValueError(f"sink_tokens={sink_tokens!r} must be an int in [0, {length}).")
    for name, g in (("token_group", token_group), ("basis_group", basis_group)):
        if not isinstance(g, (int, np.integer)) or g < 1 or g & (g - 1):
            raise ValueError(f"{name}={g!r} must be a power of two (e.g. 256 and 64).")
    dt = jnp.dtype(dtype)
    groups = layer_groups(n_layers, group_size)
    factored = length - sink_tokens
    tgroup = _token_group(factored, int(token_group))
    bgroup = _pow2_at_most(d, int(basis_group))
    # a direction's codes must fill whole bytes (tiers are cut out of packed byte rows)
    n_pad = -(-factored // tgroup) * tgroup
    widths = tuple(w for w in widths if w == FULL_BITS or (n_pad * w % 8 == 0 and d * w % 8 == 0))
    if not widths:
        raise ValueError(f"bit_widths={bit_widths!r}: none packs a direction into whole bytes "
                         f"({n_pad} padded tokens, head_dim {d}); add 8 or {FULL_BITS}.")
    keys32, values32 = jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32)
    matrices = {"k": [], "v": []}
    for g, members in enumerate(groups):
        for kind, src in (("k", keys32), ("v", values32)):
            x = group_matrix(src, members, int(sink_tokens))
            matrices[kind].append(_analyse(x, svd_cache, g, kind, members, hk, d, widths,
                                           tgroup, bgroup, dt))
    if rank == "full":
        choices = {kind: [np.ones(m.s.shape[0], int) for m in ms] for kind, ms in
                   matrices.items()}
    else:
        if not ratio > 0 or not math.isfinite(ratio):
            raise ValueError(f"ratio={ratio!r} must be a finite number > 0 (e.g. 8).")
        reference = 2 * n_layers * b * length * hk * d * dt.itemsize
        budget = reference / ratio - 2 * n_layers * b * sink_tokens * hk * d * dt.itemsize
        choices = {}
        for kind, share in (("k", key_share), ("v", 1.0 - key_share)):
            ms = matrices[kind]
            if allocation == "global":
                weights = [1.0 / max(m.energy, 1e-30) for m in ms]
                choices[kind] = _choose(ms, budget * share, widths, weights)[1]
            else:
                choices[kind] = [
                    _choose([m], budget * share * len(groups[m.group]) / n_layers, widths,
                            [1.0])[1][0] for m in ms]
    pairs = [(a, bb) for a in widths for bb in widths]
    stored = {}
    for kind in ("k", "v"):
        factors, bases = [], [None] * n_layers
        for m, choice in zip(matrices[kind], choices[kind]):
            tiers_a, tiers_b = [], [[] for _ in groups[m.group]]
            for option in sorted(set(int(c) for c in choice) - {0}):
                idx = np.flatnonzero(choice == option)
                fa, fb = pairs[option - 1]
                tiers_a.append(_take(m.factors[fa], idx, 1))
                for j in range(len(groups[m.group])):
                    tiers_b[j].append(_take(m.bases[fb][j], idx, 2))
            factors.append(tuple(tiers_a))
            for j, layer in enumerate(groups[m.group]):
                bases[layer] = tuple(tiers_b[j])
        stored[kind] = (tuple(factors), tuple(bases))
    return MixedBitsXKVCache(
        key_factors=stored["k"][0], value_factors=stored["v"][0], key_bases=stored["k"][1],
        value_bases=stored["v"][1], sink_keys=keys32[:, :, :sink_tokens].astype(dt),
        sink_values=values32[:, :, :sink_tokens].astype(dt), groups=groups,
        prefill_length=int(length), rope_theta=float(rope_theta))


def xkv_mixed_reconstruct(cache: MixedBitsXKVCache, layer: int, kind: str = "k"
                          ) -> Float[Array, "b L hk d"]:
    """Dense fp32 pre-RoPE keys or values of one layer's prompt (sinks first)."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind={kind!r} must be 'k' or 'v'.")
    g = cache.group_of(layer)
    sink = (cache.sink_keys if kind == "k" else cache.sink_values)[layer]
    factors = (cache.key_factors if kind == "k" else cache.value_factors)[g]
    bases = (cache.key_bases if kind == "k" else cache.value_bases)[layer]
    return _rebuild(factors, bases, sink, cache.prefill_length - sink.shape[1])


@functools.partial(jax.jit, static_argnums=(3,))
def _rebuild(factors, bases, sink, factored: int):
    b, _, hk, d = sink.shape
    body = jnp.zeros((b, factored, hk, d), jnp.float32)
    for a, basis in zip(factors, bases):
        body = body + jnp.einsum("brl,bhrd->blhd", _load(a, factored), _load(basis, d))
    return jnp.concatenate([sink.astype(jnp.float32), body], axis=1)


__all__ = ["DEFAULT_BIT_CHOICES", "DEFAULT_KEY_SHARE", "DEFAULT_TOKEN_GROUP", "MixedBitsXKVCache",
           "xkv_mixed_compress", "xkv_mixed_reconstruct"]
