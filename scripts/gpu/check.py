"""One device check for every Pallas kernel: correctness against its reference, then timings.

Run on a lent GPU through ``scripts/gpu/check.sh`` (sized to finish in under 6 minutes on one
H200). Each check is a function ``check(ctx) -> list[dict]`` in :data:`CHECKS`; every check runs
inside its own try/except, so one failure is recorded and the others still run. Later kernels
(xkv_decode, lattice_matmul, grouped_lora, subspace_attention) are modules with a ``CHECKS``
list in ``scripts/gpu/checks/``, discovered at run time. One JSON (``gpu_check.json``) and one
table come out; ``--dry-run`` runs every check at tiny sizes in Pallas interpret mode on a CPU
(``tests/gpu/test_gpu_check.py`` runs ``check.sh --dry-run`` so it cannot rot).

Timings: :func:`lowrank_jax.bench.time_fn`, the project's one timer (warm-up 3 calls, then the
median of ``--reps`` calls, each ``jax.block_until_ready``).
The baseline is ``jax.nn.dot_product_attention(implementation="cudnn")`` (``"xla"`` when cuDNN
is unavailable), measured in the same run at every length.

Usage::

    bash scripts/gpu/check.sh                      # on the device: writes $OUT/gpu_check.json
    python -m scripts.gpu.check --dry-run --out runs/gpu_check   # CPU: tiny sizes, interpret
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention import api as flash_api  # noqa: E402
from pallas_kernels.flash_attention.reference import flash_attention_reference  # noqa: E402
from pallas_kernels.sparse_attention import api as sale_api  # noqa: E402
from pallas_kernels.sparse_attention import reference as sale_ref  # noqa: E402

from lowrank_jax.bench import machine_record, time_fn  # the project's one timer


@dataclasses.dataclass
class Context:
    """What a check needs: sizes, mode, and a time budget."""

    dry_run: bool
    lengths: list[int]
    reps: int
    deadline: float  # time.time() after which checks should stop starting new work
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def interpret(self) -> bool:
        return self.dry_run

    def time_left(self) -> float:
        return self.deadline - time.time()


def _random_qkv(ctx: Context, n: int, seed: int = 0, heads=None, kv_heads=None, dim=None):
    heads, kv_heads, dim = heads or ctx.heads, kv_heads or ctx.kv_heads, dim or ctx.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(ctx.dtype)
    q = jax.random.normal(kq, (1, n, heads, dim), dtype)
    k = jax.random.normal(kk, (1, n, kv_heads, dim), dtype)
    v = jax.random.normal(kv, (1, n, kv_heads, dim), dtype)
    return q, k, v


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _flash_blocks(ctx: Context) -> flash_api.BlockSizes:
    return flash_api.BlockSizes(16, 16) if ctx.dry_run else flash_api.BlockSizes(128, 64)


def _sale_cfg(ctx: Context) -> sale_ref.SaleConfig:
    if ctx.dry_run:
        return sale_ref.SaleConfig(block_q=16, block_k=16, block_seg=32, local_window=16,
                                   dense_below=0)
    return sale_ref.SaleConfig()  # the repo's 64 × 32 tiles, 128-token local window


# ------------------------------------------------------------------------------------ checks


def check_flash_correctness(ctx: Context) -> list[dict]:
    """Flash forward and gradients vs the fp32 reference on random data (GQA 4, causal)."""
    n = 75 if ctx.dry_run else 2048
    q, k, v = _random_qkv(ctx, n, seed=1, heads=8 if ctx.dry_run else None,
                          kv_heads=2 if ctx.dry_run else None, dim=32 if ctx.dry_run else None)
    blocks = _flash_blocks(ctx)
    flash = jax.jit(lambda q, k, v: flash_api.flash_attention(
        q, k, v, implementation="pallas", interpret=ctx.interpret, block_sizes=blocks))
    ref = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v))
    rows = [{"check": "flash_forward", "n": n, "rel_err": _rel_err(flash(q, k, v), ref(q, k, v))}]

    def loss(impl):
        def f(q, k, v):
            out = flash_api.flash_attention(q, k, v, implementation=impl,
                                            interpret=ctx.interpret, block_sizes=blocks)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1])))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    got, want = loss("pallas")(q, k, v), loss("xla")(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        rows.append({"check": f"flash_backward_{name}", "n": n, "rel_err": _rel_err(g, w)})
    for row in rows:
        row["ok"] = row["rel_err"] < 2e-2
    return rows


def check_sale_correctness(ctx: Context) -> list[dict]:
    """SALE Pallas vs its jnp reference: τ=0 == dense, default τ: same mask, same output."""
    n = 75 if ctx.dry_run else 2048
    q, k, v = _random_qkv(ctx, n, seed=2, heads=8 if ctx.dry_run else None,
                          kv_heads=2 if ctx.dry_run else None, dim=32 if ctx.dry_run else None)
    cfg = _sale_cfg(ctx)
    rows = []
    dense = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v))(q, k, v)
    for tau in (0.0, sale_api.DEFAULT_TAU):
        run = jax.jit(lambda q, k, v, impl=None: sale_api.sale_prefill_attention(
            q, k, v, tau, cfg, implementation=impl, interpret=ctx.interpret, return_mask=True),
            static_argnames="impl")
        out, mask = run(q, k, v, impl="pallas")
        ref_out, ref_mask = run(q, k, v, impl="xla")
        mismatch = float(jnp.mean(mask != ref_mask))
        row = {"check": f"sale_tau_{tau:g}", "n": n, "rel_err": _rel_err(out, ref_out),
               "rel_err_vs_dense": _rel_err(out, dense), "mask_mismatch": mismatch,
               "density": float(sale_ref.causal_density(mask, n, cfg))}
        row["ok"] = row["rel_err"] < 2e-2 and mismatch < 1e-3 and (
            tau > 0 or row["rel_err_vs_dense"] < 2e-2)
        rows.append(row)
    return rows


#: The Pallas GPU backend each op chose (its ``cases.py`` / docstring give the reason).
GPU_BACKENDS = {"flash_attention": "triton", "sparse_attention": "triton",
                "subspace_attention": "triton", "xkv_decode": "triton"}


def attention_baseline(ctx: Context, *, causal: bool = True, probe=None):
    """``(name, fn)``: ``jax.nn.dot_product_attention`` with cuDNN when it runs on ``probe``
    (``(q, k, v)``, default a 256-token causal case), else XLA; XLA in a dry run. The one
    baseline of every attention check."""
    if ctx.dry_run:
        return "xla", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"))
    q, k, v = probe if probe is not None else _random_qkv(ctx, 256)
    for impl in ("cudnn", "xla"):
        fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl))
        try:
            jax.block_until_ready(fn(q, k, v))
            return impl, fn
        except Exception:  # noqa: BLE001 - cuDNN missing or unsupported shape: fall back
            continue
    raise RuntimeError("jax.nn.dot_product_attention failed with both cudnn and xla")


def bench_attention(ctx: Context) -> list[dict]:
    """Seconds per causal prefill at each length: dense baseline, flash (the check's tiles and
    the op's defaults, ``implementation="auto"``: the kernel a user gets), SALE (τ=0.004)."""
    baseline_name, baseline = attention_baseline(ctx)
    cfg = _sale_cfg(ctx)
    blocks = _flash_blocks(ctx)
    flash = jax.jit(lambda q, k, v: flash_api.flash_attention(
        q, k, v, implementation="pallas", interpret=ctx.interpret, block_sizes=blocks))
    sale = jax.jit(lambda q, k, v: sale_api.sale_prefill_attention(
        q, k, v, sale_api.DEFAULT_TAU, cfg, implementation="pallas", interpret=ctx.interpret,
        return_mask=True))
    flash_default = jax.jit(lambda q, k, v: flash_api.flash_attention(
        q, k, v, interpret=True if ctx.interpret else None))
    rows = []
    for n in ctx.lengths:
        if ctx.time_left() < 30:
            rows.append({"check": "bench", "n": n, "skipped": "time budget"})
            continue
        q, k, v = _random_qkv(ctx, n, seed=n)
        row = {"check": "bench", "n": n, "baseline": baseline_name,
               "backend": GPU_BACKENDS["flash_attention"], "heads": ctx.heads,
               "kv_heads": ctx.kv_heads, "head_dim": ctx.head_dim, "dtype": ctx.dtype,
               "flash_blocks": dataclasses.asdict(blocks), "sale_cfg": dataclasses.asdict(cfg)}
        for name, fn in (("baseline_s", baseline), ("flash_s", flash),
                         ("flash_default_s", flash_default), ("sale_s", sale)):
            try:
                row[name] = time_fn(fn, q, k, v, reps=ctx.reps)
            except Exception as exc:  # noqa: BLE001 - e.g. XLA baseline out of memory at 64K
                row[name] = None
                row[name.replace("_s", "_error")] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            row["sale_density"] = float(sale_ref.causal_density(sale(q, k, v)[1], n, cfg))
        except Exception:  # noqa: BLE001
            row["sale_density"] = None
        for name in ("flash", "flash_default", "sale"):
            if row.get("baseline_s") and row.get(f"{name}_s"):
                row[f"{name}_speedup"] = row["baseline_s"] / row[f"{name}_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


#: Every device check, run in order. Append new kernels' checks here.
CHECKS: list[Callable[[Context], list[dict]]] = [
    check_flash_correctness,
    check_sale_correctness,
    bench_attention,
]


def discover_extra_checks() -> list[Callable]:
    """``CHECKS`` lists of the modules in ``scripts/gpu/checks/`` (optional plug-ins)."""
    extra = []
    import pkgutil

    from scripts.gpu import checks

    for info in sorted(pkgutil.iter_modules(checks.__path__), key=lambda m: m.name):
        try:
            module = importlib.import_module(f"scripts.gpu.checks.{info.name}")
            extra.extend(getattr(module, "CHECKS", []))
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not stop the run
            print(f"[gpu_check] could not load {info.name}: {exc}", flush=True)
    return extra


def run_checks(ctx: Context, checks) -> dict:
    results = {}
    for check in checks:
        name = check.__name__
        start = time.time()
        try:
            if ctx.time_left() < 20:
                raise TimeoutError("time budget exhausted before this check started")
            rows = check(ctx)
            results[name] = {"ok": all(r.get("ok", True) for r in rows), "rows": rows}
        except Exception as exc:  # noqa: BLE001 - record and continue with the next check
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-4000:]}
        results[name]["seconds"] = round(time.time() - start, 2)
        print(f"[gpu_check] {name}: ok={results[name]['ok']} "
              f"({results[name]['seconds']} s)", flush=True)
    return results


def print_table(results: dict) -> None:
    print(f"\n{'check':28s} {'n':>7s} {'result':>60s}")
    for name, res in results.items():
        if "error" in res:
            print(f"{name:28s} {'':>7s} ERROR {res['error'][:70]}")
            continue
        for row in res["rows"]:
            if row.get("check") == "bench" and "baseline_s" in row:
                def fmt(x):
                    return "-" if x is None else f"{x * 1e3:.2f}ms"
                text = (f"{row['baseline']} {fmt(row['baseline_s'])}  flash "
                        f"{fmt(row['flash_s'])} (x{row.get('flash_speedup', 0):.2f})  sale "
                        f"{fmt(row['sale_s'])} (x{row.get('sale_speedup', 0):.2f}, "
                        f"density {row.get('sale_density') or 0:.3f})")
            else:
                text = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items() if k not in ("check", "n"))
            print(f"{row.get('check', name):28s} {row.get('n', ''):>7} {text}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU smoke test: tiny sizes, Pallas interpret mode")
    parser.add_argument("--quick", action="store_true", help="lengths 8K and 16K only")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting new work after this many seconds")
    args = parser.parse_args(argv)

    if args.dry_run:
        lengths = args.lengths or [80]
        ctx = Context(dry_run=True, lengths=lengths, reps=args.reps or 2,
                      deadline=time.time() + args.budget_s, heads=4, kv_heads=2, head_dim=32,
                      dtype="float32")
    else:
        lengths = args.lengths or ([8192, 16384] if args.quick else [8192, 16384, 32768, 65536])
        ctx = Context(dry_run=False, lengths=lengths, reps=args.reps or 10,
                      deadline=time.time() + args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**machine_record(), "dry_run": ctx.dry_run, "lengths": ctx.lengths}
    print(json.dumps(meta), flush=True)
    results = run_checks(ctx, CHECKS + discover_extra_checks())
    print_table(results)
    path = out / "gpu_check.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    print(f"\nwrote {path}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
