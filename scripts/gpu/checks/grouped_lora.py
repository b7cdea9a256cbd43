"""Device check of the PLoRA grouped LoRA kernels: each entry against the ragged_dot reference.

Picked up by ``scripts/gpu/check.py`` through :data:`CHECKS` (``check_grouped_lora(ctx)``).
For K = 8 adapters padded to R = 64 (mixed ranks 8-64, and all ranks = R to show what rank-chunk
skipping saves) over a 4096-wide bf16 projection and 8192 tokens, every entry point runs with its
chosen backend (Pallas: Triton on GPU, Mosaic on TPU) and with the XLA reference
(``jax.lax.ragged_dot``) in the same run:

* ``shrink`` / ``expand`` forward;
* ``shrink_backward`` / ``expand_backward``: ``jax.value_and_grad`` of a scalar through the op
  (the forward kernel plus the backward kernels: the transposed grouped matmul and the per-group
  weight-gradient reduction);
* ``lora`` (shrink then expand on the base output) against the per-adapter baseline: K separate
  ``x_k A_k B_k`` matmuls (what serving without grouping does).

Each row records the relative error against the reference and, on the device, both times and
their ratio. ``--dry-run``: 40 tokens, d 64, fp32, interpret mode, no timings.
"""

from __future__ import annotations

from lowrank_jax.bench import time_fn  # the project's one timer


def _entries(impl: str, interpret: bool, gs, scale, rk, shrink_tiles, expand_tiles):
    """``name -> (jitted fn, arg names)`` for one implementation."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.grouped_lora import lora_expand, lora_shrink

    kw = dict(implementation=impl, interpret=interpret if impl == "pallas" else None)

    def shrink(x, a):
        return lora_shrink(x, a, gs, scale, rk, block_sizes=shrink_tiles, **kw)

    def expand(h, b):
        return lora_expand(h, b, gs, rk, block_sizes=expand_tiles, **kw)

    def lora(x, a, b, base):
        h = shrink(x, a).astype(b.dtype)
        return lora_expand(h, b, gs, rk, base, block_sizes=expand_tiles, **kw)

    def backward(fn):
        return jax.value_and_grad(lambda *xs: 0.5 * jnp.sum(jnp.square(fn(*xs))),
                                  argnums=(0, 1))

    return {"shrink": (jax.jit(shrink), ("x", "a")),
            "expand": (jax.jit(expand), ("h", "b")),
            "shrink_backward": (jax.jit(backward(shrink)), ("x", "a")),
            "expand_backward": (jax.jit(backward(expand)), ("h", "b")),
            "lora": (jax.jit(lora), ("x", "a", "b", "base"))}


def _rel_err(got, want) -> float:
    import jax
    import numpy as np

    num = den = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        num, den = num + float(np.sum((g - w) ** 2)), den + float(np.sum(w ** 2))
    return (num / max(den, 1e-30)) ** 0.5


def _rows(ctx) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.grouped_lora import BlockSizes

    dry_run, reps = ctx.dry_run, max(5, ctx.reps)
    d, r_max, k = (64, 16, 4) if dry_run else (4096, 64, 8)
    n = 40 if dry_run else 8192
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    rank_sets = {"mixed": [4, 8, 16, 16] if dry_run else [8, 16, 32, 64, 8, 16, 32, 64],
                 "all_R": [r_max] * k}
    block = dict(block_m=16, block_r=16) if dry_run else dict(block_m=64, block_r=16)
    shrink_tiles = BlockSizes(**block)
    expand_tiles = BlockSizes(**block, block_n=32 if dry_run else 128)
    keys = jax.random.split(jax.random.key(n), 5)
    data = {"x": jax.random.normal(keys[0], (n, d), dtype),
            "a": (jax.random.normal(keys[1], (k, d, r_max)) / d ** 0.5).astype(dtype),
            "b": (jax.random.normal(keys[2], (k, r_max, d)) / 8).astype(dtype),
            "h": jax.random.normal(keys[3], (n, r_max), dtype),
            "base": jax.random.normal(keys[4], (n, d), jnp.float32)}
    sizes = np.diff(np.linspace(0, n, k + 1).astype(int))
    sizes[1] = 0  # an empty slot
    sizes[0] = n - sizes[1:].sum()
    gs = jnp.asarray(sizes, jnp.int32)
    scale = jnp.full((k,), 2.0, jnp.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    rows = []
    for label, ranks in rank_sets.items():
        rk = jnp.asarray(ranks, jnp.int32)
        pallas = _entries("pallas", ctx.interpret, gs, scale, rk, shrink_tiles, expand_tiles)
        xla = _entries("xla", ctx.interpret, gs, scale, rk, shrink_tiles, expand_tiles)

        @jax.jit
        def per_adapter(x, a, b, base, ranks=ranks):
            """The baseline without grouping: one ``x_k A_k B_k`` per adapter."""
            parts = [base[bounds[j]:bounds[j + 1]] + scale[j] * jnp.dot(
                jnp.dot(x[bounds[j]:bounds[j + 1]], a[j, :, :ranks[j]]), b[j, :ranks[j]],
                preferred_element_type=jnp.float32) for j in range(k)]
            return jnp.concatenate(parts)

        for entry, (fn, names) in pallas.items():
            if ctx.time_left() < 20:
                rows.append({"check": f"grouped_lora_{entry}_{label}", "skipped": "time budget"})
                continue
            args = [data[name] for name in names]
            row = {"check": f"grouped_lora_{entry}_{label}", "n": n, "d": d, "K": k, "R": r_max,
                   "ranks": ranks, "dtype": jnp.dtype(dtype).name}
            try:
                ref, got = xla[entry][0](*args), fn(*args)
                if entry == "lora":  # the adapters' part only, not the base output
                    ref, got = ref - data["base"], got - data["base"]
                    row["per_adapter_rel_err"] = _rel_err(per_adapter(*args) - data["base"], ref)
                row["rel_err"] = _rel_err(got, ref)
                tolerance = 1e-5 if dry_run else 2e-2
                row["ok"] = max(v for key, v in row.items() if "rel_err" in key) < tolerance
                if not dry_run:
                    row["pallas_s"] = time_fn(fn, *args, reps=reps)
                    row["xla_s"] = time_fn(xla[entry][0], *args, reps=reps)
                    row["speedup_vs_xla"] = row["xla_s"] / row["pallas_s"]
                    if entry == "lora":
                        row["per_adapter_s"] = time_fn(per_adapter, *args, reps=reps)
                        row["speedup_vs_per_adapter"] = row["per_adapter_s"] / row["pallas_s"]
            except Exception as err:  # noqa: BLE001 - record lowering failures, keep going
                row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                row["ok"] = False
            rows.append(row)
    return rows


def check_grouped_lora(ctx) -> list[dict]:
    """``scripts/gpu/check.py`` plug-in entry: rows with ``ok`` per entry and rank set."""
    return _rows(ctx)


CHECKS = [check_grouped_lora]
