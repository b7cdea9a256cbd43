"""Device check for ``pallas_kernels.xkv_decode`` (plug-in for ``scripts/gpu/check.py``).

1. Construction test (spec): K = A_k·B_k and V = A_v·B_v are exactly low rank, bf16 inputs;
   the Pallas kernel must match the fp32 reference with relative L2 error < 2e-2 and per-row
   cosine > 0.99, at an odd length (4001) with several splits.
2. Decode-attention speed at long context against uncompressed attention over the dense cache
   (``jax.nn.dot_product_attention``, cuDNN when available, else XLA) and against the XLA
   reference path (dense reconstruction), Hq = 32, H_kv = 8, D = 128, batch 4, xKV-4 ranks
   (384, 576) — as in the spec's benchmark plan.

``scripts/gpu/check.py`` imports ``CHECKS`` from here.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.xkv_decode import (  # noqa: E402
    BlockSizes,
    reconstruct,
    rope,
    xkv_decode_attention,
)
from pallas_kernels.xkv_decode.reference import xkv_decode_reference  # noqa: E402

from lowrank_jax.bench import time_fn  # the project's one timer


def _case(b, hq, hk, d, length, rk, rv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, hq, d), jnp.float32)
    ak = jax.random.normal(ks[1], (b, length, rk), jnp.float32) / np.sqrt(rk)
    bk = jax.random.normal(ks[2], (b, hk, rk, d), jnp.float32)
    av = jax.random.normal(ks[3], (b, length, rv), jnp.float32) / np.sqrt(rv)
    bv = jax.random.normal(ks[4], (b, hk, rv, d), jnp.float32)
    cast = lambda x: x.astype(dtype)
    return q, cast(ak), cast(bk), cast(av), cast(bv)


def _rows(dry_run: bool, lengths, reps: int, interpret: bool, time_left=lambda: 1e9):
    rows = []
    # 1. construction test
    if dry_run:
        shape = dict(b=1, hq=4, hk=2, d=32, length=75, rk=8, rv=12)
        blocks = BlockSizes(block_k=16, num_splits=3)
    else:
        shape = dict(b=2, hq=32, hk=8, d=128, length=4001, rk=384, rv=576)
        blocks = BlockSizes(block_k=64, num_splits=8)
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    q, ak, bk, av, bv = _case(**shape, dtype=dtype)
    got = xkv_decode_attention(q, ak, bk, av, bv, rope_theta=1e7, implementation="pallas",
                               interpret=interpret, block_sizes=blocks)
    want = xkv_decode_reference(q, ak.astype(jnp.float32), bk.astype(jnp.float32),
                                av.astype(jnp.float32), bv.astype(jnp.float32), rope_theta=1e7)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    cos = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    rows.append({"check": "xkv_decode_construction", "n": shape["length"], "rel_err": rel,
                 "min_row_cosine": float(cos.min()),
                 "ok": bool(rel < 2e-2 and cos.min() > 0.99)})
    # 2. speed vs uncompressed decode attention
    b, hq, hk, d, rk, rv = (1, 4, 2, 32, 8, 12) if dry_run else (4, 32, 8, 128, 384, 576)
    for length in lengths:
        if time_left() < 40:
            break
        row = {"check": "xkv_decode_bench", "n": length, "batch": b, "rank_k": rk,
               "rank_v": rv}
        try:
            q, ak, bk, av, bv = _case(b, hq, hk, d, length, rk, rv, dtype, seed=1)
            keys = rope(reconstruct(ak, bk), jnp.arange(length), 1e7).astype(dtype)
            vals = reconstruct(av, bv).astype(dtype)
            qd = q.astype(dtype)[:, None]
            impl = None if dry_run else "cudnn"
            dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, implementation=impl))
            try:
                jax.block_until_ready(dense(qd, keys, vals))
                row["baseline"] = impl or "xla"
            except Exception:  # noqa: BLE001 - cuDNN may reject the shape; fall back
                dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
                row["baseline"] = "xla"
            nblk = 16 if dry_run else 64
            splits = max(1, min(32, length // (nblk * 16)))
            kernel = jax.jit(lambda q, ak, bk, av, bv: xkv_decode_attention(
                q, ak, bk, av, bv, rope_theta=1e7, implementation="pallas",
                interpret=interpret, block_sizes=BlockSizes(block_k=nblk, num_splits=splits)))
            ref = jax.jit(lambda q, ak, bk, av, bv: xkv_decode_attention(
                q, ak, bk, av, bv, rope_theta=1e7, implementation="xla"))
            row["baseline_s"] = time_fn(dense, qd, keys, vals, reps=reps)
            row["xkv_pallas_s"] = time_fn(kernel, q, ak, bk, av, bv, reps=reps)
            row["xkv_xla_s"] = time_fn(ref, q, ak, bk, av, bv, reps=reps)
            # the op as a user calls it: defaults, implementation="auto" (Triton on a GPU)
            default = jax.jit(lambda q, ak, bk, av, bv: xkv_decode_attention(
                q, ak, bk, av, bv, rope_theta=1e7, interpret=True if interpret else None))
            row["xkv_default_s"] = time_fn(default, q, ak, bk, av, bv, reps=reps)
            row["backend"] = "triton"
            row["speedup_vs_dense"] = row["baseline_s"] / row["xkv_pallas_s"]
            row["bytes_dense"] = int(keys.nbytes + vals.nbytes)
            row["bytes_xkv_layer"] = int(ak.nbytes + bk.nbytes + av.nbytes + bv.nbytes)
            row["splits"] = splits
        except Exception as exc:  # noqa: BLE001 - record, keep going
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["ok"] = False
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def check_xkv_decode(ctx) -> list[dict]:
    """``gpu_check.py`` plug-in: construction test, then speed vs dense decode attention."""
    return _rows(ctx.dry_run, ctx.lengths, ctx.reps, ctx.interpret, ctx.time_left)


CHECKS = [check_xkv_decode]
