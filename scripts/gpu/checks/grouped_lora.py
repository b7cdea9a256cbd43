"""Device check of the PLoRA grouped LoRA kernels: kernel vs ragged_dot reference, and timings.

Picked up by ``scripts/gpu/check.py`` through :data:`CHECKS` (``check_grouped_lora(ctx)``).
For K = 8 adapters with mixed ranks padded to R = 64 over a
4096-wide projection it (1) compares shrink + expand (Pallas, Triton lowering on GPU) with the
``jax.lax.ragged_dot`` reference in bf16, (2) times forward shrink+expand of both paths and the
forward+backward of the kernel path (its backward is the reference VJP), and (3) the same with
all ranks = R, to show what rank-tile skipping saves, and (4) the per-adapter baseline: K
separate ``x_k @ A_k @ B_k`` matmuls over each adapter's rows (what serving without grouping
does).
"""

from __future__ import annotations

from lowrank_jax.bench import time_fn  # the project's one timer


def _rows(dry_run: bool, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.grouped_lora import BlockSizes, lora_expand, lora_shrink

    interpret = dry_run
    d, r_max, k = (64, 16, 4) if dry_run else (4096, 64, 8)
    token_counts = [40] if dry_run else [1024, 8192]
    rank_sets = {"mixed": [4, 8, 16, 16][:k] if dry_run else [8, 16, 32, 64, 8, 16, 32, 64],
                 "all_R": [r_max] * k}
    block = dict(block_m=16, block_r=8) if dry_run else dict(block_m=64, block_r=16)
    shrink_tiles = BlockSizes(**block)
    expand_tiles = BlockSizes(**block, block_n=32 if dry_run else 128)
    rows = []
    for n in token_counts:
        keys = jax.random.split(jax.random.key(n), 4)
        dtype = jnp.float32 if dry_run else jnp.bfloat16
        x = jax.random.normal(keys[0], (n, d), dtype)
        a = (jax.random.normal(keys[1], (k, d, r_max), jnp.float32) / d ** 0.5).astype(dtype)
        b = (jax.random.normal(keys[2], (k, r_max, d), jnp.float32) / 8).astype(dtype)
        base = jax.random.normal(keys[3], (n, d), jnp.float32)
        sizes = np.diff(np.linspace(0, n, k + 1).astype(int))
        sizes[1] = 0  # an empty slot
        sizes[0] = n - sizes[1:].sum()
        gs = jnp.asarray(sizes, jnp.int32)
        scale = jnp.full((k,), 2.0, jnp.float32)
        for label, ranks in rank_sets.items():
            rk = jnp.asarray(ranks, jnp.int32)

            def fwd(impl):
                def f(x, a, b, base):
                    h = lora_shrink(x, a, gs, scale, rk, implementation=impl,
                                    interpret=interpret, block_sizes=shrink_tiles)
                    return lora_expand(h.astype(b.dtype), b, gs, rk, base, implementation=impl,
                                       interpret=interpret, block_sizes=expand_tiles)
                return jax.jit(f)

            def fwd_bwd(impl):
                f = fwd(impl)
                return jax.jit(jax.grad(lambda x, a, b, base: jnp.sum(f(x, a, b, base)),
                                        argnums=(0, 1, 2)))

            row = {"check": f"grouped_lora_{label}", "n": n, "d": d, "K": k, "R": r_max,
                   "ranks": ranks}
            bounds = np.concatenate([[0], np.cumsum(sizes)])

            @jax.jit
            def per_adapter(x, a, b, base, ranks=ranks, bounds=bounds):
                """The baseline without grouping: one ``x_k A_k B_k`` per adapter."""
                parts = [base[bounds[j]:bounds[j + 1]] + scale[j] * jnp.dot(
                    jnp.dot(x[bounds[j]:bounds[j + 1]], a[j, :, :ranks[j]]), b[j, :ranks[j]],
                    preferred_element_type=jnp.float32) for j in range(k)]
                return jnp.concatenate(parts)

            try:
                got = fwd("pallas")(x, a, b, base)
                ref = fwd("xla")(x, a, b, base)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref - base))
                loop = per_adapter(x, a, b, base)
                loop_err = float(jnp.linalg.norm(loop - ref) / jnp.linalg.norm(ref - base))
                row["rel_err"], row["per_adapter_rel_err"] = err, loop_err
                row["ok"] = max(err, loop_err) < (1e-5 if dry_run else 2e-2)
                if not dry_run:
                    row["pallas_fwd_s"] = time_fn(fwd("pallas"), x, a, b, base, reps=reps)
                    row["xla_ragged_dot_fwd_s"] = time_fn(fwd("xla"), x, a, b, base, reps=reps)
                    row["fwd_speedup"] = row["xla_ragged_dot_fwd_s"] / row["pallas_fwd_s"]
                    row["pallas_fwd_bwd_s"] = time_fn(fwd_bwd("pallas"), x, a, b, base, reps=reps)
                    row["xla_fwd_bwd_s"] = time_fn(fwd_bwd("xla"), x, a, b, base, reps=reps)
                    dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
                    row["base_gemm_s"] = time_fn(dense, x, jnp.ones((d, d), dtype), reps=reps)
                    row["per_adapter_fwd_s"] = time_fn(per_adapter, x, a, b, base, reps=reps)
                    row["speedup_vs_per_adapter"] = row["per_adapter_fwd_s"] / row["pallas_fwd_s"]
            except Exception as err:  # noqa: BLE001 - record lowering failures, keep going
                row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                row["ok"] = False
            rows.append(row)
    return rows


def check_grouped_lora(ctx) -> list[dict]:
    """``scripts/gpu/check.py`` plug-in entry: rows with ``ok`` per shape and rank set."""
    return _rows(ctx.dry_run, max(5, ctx.reps))


CHECKS = [check_grouped_lora]
