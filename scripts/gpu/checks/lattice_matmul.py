"""Device check of the UniSVQ lattice matmul: kernel vs reference, time vs bf16 dense, bandwidth.

Picked up by ``scripts/gpu/check.py`` through :data:`CHECKS`. For each shape it (1) compares the
Pallas kernel (fold and dequant modes; Triton on GPU, chosen explicitly) with the XLA reference,
(2) times the kernel against the XLA reference of the same mode (``implementation="xla"``:
unpack + decode + dot) and against a bf16 ``jnp.dot`` with the dense weight, and (3) reports the
kernel's achieved bandwidth (bytes of packed codes + activations + output per second) as a
fraction of a device copy bandwidth measured in the same run. ``--dry-run``: one tiny shape in
interpret mode, no timings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrank_jax.bench import time_fn  # the project's one timer


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """Measured device copy rate in bytes/s (read + write of a ``nbytes`` buffer)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return 2 * nbytes / time_fn(jax.jit(lambda a: a + 1.0), x, reps=reps)


def check_lattice_matmul(ctx) -> list[dict]:
    from pallas_kernels.lattice_matmul.api import BlockSizes, code_matmul
    from pallas_kernels.lattice_matmul.reference import code_matmul_reference

    if ctx.dry_run:
        shapes, tokens, dtype = [(40, 64)], [3], jnp.float32
        blocks = BlockSizes(block_m=16, block_k=8)
    else:
        shapes, tokens, dtype = [(4096, 4096), (12288, 4096)], [16, 4096], jnp.bfloat16
        blocks = BlockSizes()
    bandwidth = None if ctx.dry_run else copy_bandwidth(1 << 30, ctx.reps)
    rows = []
    for m, n in shapes:
        k = jax.random.split(jax.random.key(0), 4)
        codes = jax.random.randint(k[0], (m, n // 4), 0, 256).astype(jnp.uint8)
        affine = jax.random.normal(k[1], (4, 4)) * 0.3 + jnp.eye(4)
        offset = jax.random.normal(k[2], (4,)) * 0.1
        w_dense = jax.random.normal(k[3], (m, n)).astype(dtype)
        for t in tokens:
            if ctx.time_left() < 30:
                rows.append({"check": "lattice_matmul", "n": t, "skipped": "time budget"})
                continue
            x = jax.random.normal(jax.random.key(t), (t, n)).astype(dtype)
            ref = code_matmul_reference(x.astype(jnp.float32), codes, affine, offset)
            row = {"check": "lattice_matmul", "n": t, "m": m, "k": n, "ok": True}
            if not ctx.dry_run:
                dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
                row["bf16_dense_s"] = time_fn(dense, x, w_dense, reps=ctx.reps)
            for mode in ("fold", "dequant"):
                fn = jax.jit(lambda x, c, a, b, mode=mode: code_matmul(
                    x, c, a, b, mode=mode, implementation="pallas", interpret=ctx.interpret,
                    block_sizes=blocks))
                try:
                    got = fn(x, codes, affine, offset)
                    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                    row[f"{mode}_rel_err"] = rel
                    row["ok"] = row["ok"] and rel < (1e-5 if ctx.dry_run else 2e-2)
                    if not ctx.dry_run:
                        xla = jax.jit(lambda x, c, a, b, mode=mode: code_matmul(
                            x, c, a, b, mode=mode, implementation="xla"))
                        row[f"{mode}_xla_s"] = time_fn(xla, x, codes, affine, offset,
                                                       reps=ctx.reps)
                        seconds = time_fn(fn, x, codes, affine, offset, reps=ctx.reps)
                        moved = codes.size + x.size * 2 + t * m * 4
                        row[f"{mode}_s"] = seconds
                        row[f"{mode}_bandwidth_fraction"] = moved / seconds / bandwidth
                        row[f"{mode}_speedup_vs_bf16"] = row["bf16_dense_s"] / seconds
                        row[f"{mode}_speedup_vs_xla"] = row[f"{mode}_xla_s"] / seconds
                except Exception as err:  # noqa: BLE001 - record lowering failures, keep going
                    row[f"{mode}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    row["ok"] = False
            if bandwidth is not None:
                row["copy_bandwidth_GBps"] = bandwidth / 1e9
            rows.append(row)
    return rows


CHECKS = [check_lattice_matmul]
