"""Device check of the Video-SVD dual-stream subspace attention kernel.

Picked up by ``scripts/gpu/check.py`` through :data:`CHECKS`. For each rank and temporal window
it compares the Pallas kernel with the pure-jnp reference (relative Frobenius error) and, on a
device, times it (its chosen backend, Triton) against ``jax.nn.dot_product_attention`` (cuDNN
when it runs, else XLA: :func:`scripts.gpu.check.attention_baseline`) and against the same
kernel with every block on the exact stream (what the low-rank far stream saves).
"""

from __future__ import annotations


def check_subspace_attention(ctx) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.subspace_attention import (
        BlockSizes,
        subspace_attention,
        subspace_attention_reference,
    )
    from lowrank_jax.bench import time_fn  # the project's one timer: warm-up, then the median
    from scripts.gpu.check import GPU_BACKENDS, attention_baseline

    frames, block = (4, 16) if ctx.dry_run else (16, 64)
    heads, head_dim = (2, 32) if ctx.dry_run else (12, 128)
    dtype = jnp.dtype(ctx.dtype)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    rows = []
    for rank in (8,) if ctx.dry_run else (16, 32, 64):
        for window in (0,) if ctx.dry_run else (0, 1):
            n = frames * block
            keys = jax.random.split(jax.random.key(100 * rank + window), 4)
            q, k, v = (jax.random.normal(key, (1, n, heads, head_dim), dtype) for key in keys[:3])
            basis = jnp.linalg.qr(jax.random.normal(keys[3], (heads, head_dim, rank)))[0]
            basis = basis.astype(dtype)

            def latent(x, basis=basis):
                return jnp.einsum("bnhd,hdr->bnhr", x, basis)

            t = np.arange(frames)
            near = jnp.asarray(np.abs(t[:, None] - t[None]) <= window)
            sizes = BlockSizes(block, block)

            def compiled(mask, basis=basis, latent=latent, sizes=sizes):
                return jax.jit(lambda q, k, v: subspace_attention(
                    q, k, v, latent(q), latent(k), latent(v), basis, mask, block_sizes=sizes,
                    implementation="pallas", interpret=ctx.interpret))

            fast, all_exact = compiled(near), compiled(jnp.ones_like(near))
            reference = subspace_attention_reference(
                q, k, v, latent(q), latent(k), latent(v), basis, near, block_q=block,
                block_k=block).astype(jnp.float32)
            error = float(jnp.linalg.norm(fast(q, k, v).astype(jnp.float32) - reference)
                          / jnp.linalg.norm(reference))
            row = {"check": "subspace_attention", "n": n, "rank": rank, "window_t": window,
                   "near_fraction": float(near.mean()), "rel_err": error,
                   "ok": error < tolerance}
            if not ctx.dry_run:
                baseline_name, dense = attention_baseline(ctx, causal=False, probe=(q, k, v))
                row.update(baseline=baseline_name, backend=GPU_BACKENDS["subspace_attention"])
                row["dense_s"] = time_fn(dense, q, k, v, reps=ctx.reps)
                row["all_exact_s"] = time_fn(all_exact, q, k, v, reps=ctx.reps)
                row["subspace_s"] = time_fn(fast, q, k, v, reps=ctx.reps)
                row["speedup_vs_dense"] = row["dense_s"] / row["subspace_s"]
                row["speedup_vs_all_exact"] = row["all_exact_s"] / row["subspace_s"]
            rows.append(row)
    return rows


CHECKS = [check_subspace_attention]
