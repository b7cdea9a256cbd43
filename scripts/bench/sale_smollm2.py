"""SALE on SmolLM2-135M: per-layer output error, perplexity change and block density vs dense.

For every layer, the dense model's own attention inputs (post-RoPE q, k, v) go through both
dense causal attention (the baseline, same run) and SALE at each threshold τ; we report the
relative L2 error ``‖O_sale − O_dense‖ / ‖O_dense‖`` and the fraction of causal key blocks SALE
computes. A second stream runs the whole model with SALE in every layer to give the perplexity
change. Optionally (``--calibrate``) per-head thresholds are calibrated on a *different* text
window with the repo's halving search (spec §6) and evaluated the same way.

SALE runs its jnp reference path (``implementation="xla"``): on CPU the Pallas kernels only run in
interpret mode, and the tests show kernel and reference give the same block mask and output.

Usage::

    python -m scripts.bench.sale_smollm2                 # 2048 tokens, τ ∈ {0.001, 0.004, 0.016}
    python -m scripts.bench.sale_smollm2 --quick         # 1280 tokens, τ = 0.004 only
    python -m scripts.bench.sale_smollm2 --calibrate     # + per-head calibrated τ (slow on CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.kv.model import attention_inputs
from lowrank_jax.kv.sale import calibrate_sale, sale_vs_dense
from lowrank_jax.models.generate import perplexity
from pallas_kernels.sparse_attention import api as sale_api
from pallas_kernels.sparse_attention import reference as sale_ref


def load(args):
    """``(model, token ids, source)``: SmolLM2 + English text, or a random-weight fallback."""
    try:
        from lowrank_jax.models.generate import english_eval_text
        from lowrank_jax.hub import load_model

        model, tokenizer = load_model("smollm2")
        ids = tokenizer.encode(english_eval_text())
        return model, np.asarray(ids, np.int32), "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)"
    except Exception as exc:  # noqa: BLE001 - loader missing: say so and use random weights
        print(f"[bench] SmolLM2 unavailable ({type(exc).__name__}: {exc}); random weights")
        from flax import nnx

        from lowrank_jax.models.llama import Llama, LlamaConfig

        cfg = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                          d_ff=1536, max_seq_len=8192, rope_theta=1e5)
        rng = np.random.default_rng(0)
        return Llama(cfg, rngs=nnx.Rngs(0)), rng.integers(0, 49152, 8192).astype(np.int32), (
            "random-weight Llama with SmolLM2's shape")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_sale_smollm2")
    parser.add_argument("--quick", action="store_true", help="1280 tokens, τ = 0.004 only")
    parser.add_argument("--tokens", type=int, default=None, help="context length (default 2048)")
    parser.add_argument("--taus", type=float, nargs="*", default=None)
    parser.add_argument("--calibrate", action="store_true",
                        help="also calibrate per-head τ on another window (err budget 0.4)")
    parser.add_argument("--err-budget", type=float, default=0.4)
    args = parser.parse_args(argv)
    n = args.tokens or (1280 if args.quick else 2048)
    taus = args.taus or ([sale_api.DEFAULT_TAU] if args.quick else [0.001, 0.004, 0.016])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    start = time.time()
    model, ids, source = load(args)
    if len(ids) < n:
        raise ValueError(f"--tokens={n} but the evaluation text has only {len(ids)} tokens.")
    if n <= sale_ref.SaleConfig().dense_below:
        raise ValueError(f"--tokens={n} must exceed SALE's dense_below=1024 to be sparse.")
    cfg = sale_ref.SaleConfig()
    tokens = jnp.asarray(ids[None, :n])
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

    settings = [(f"tau={t:g}", np.full((n_layers, n_heads), t, np.float32)) for t in taus]
    calib = None
    if args.calibrate:
        calib_n = min(n, len(ids) - n)
        if calib_n > cfg.dense_below:
            calib_tokens = jnp.asarray(ids[None, n:n + calib_n])
            calib = calibrate_sale(model, calib_tokens, cfg, args.err_budget, progress=True)
            settings.append((f"calibrated(err={args.err_budget:g})", calib))
        else:
            print("[bench] text too short for a separate calibration window; skipped")

    results = []
    qkv = attention_inputs(model, tokens)
    nll_dense = perplexity(model, ids[:n], window=n, progress=False).nll
    for name, tau in settings:
        per_layer, nll_sale = sale_vs_dense(model, ids[:n], qkv, tau, cfg, desc=name)
        errs = np.array([r["rel_err"] for r in per_layer])
        dens = np.array([r["density"] for r in per_layer])
        results.append({
            "setting": name, "ppl_dense": math.exp(nll_dense), "ppl_sale": math.exp(nll_sale),
            "ppl_change_pct": 100 * (math.exp(nll_sale - nll_dense) - 1),
            "mean_rel_err": float(errs.mean()), "max_rel_err": float(errs.max()),
            "mean_density": float(dens.mean()), "per_layer": per_layer,
        })

    print(f"\nSALE on {source}, {n} tokens, SaleConfig defaults (64x32 tiles, local 128)")
    print(f"{'setting':24s} {'ppl dense':>9s} {'ppl SALE':>9s} {'Δppl %':>7s} "
          f"{'mean err':>9s} {'max err':>8s} {'blocks computed':>15s}")
    for r in results:
        print(f"{r['setting']:24s} {r['ppl_dense']:9.3f} {r['ppl_sale']:9.3f} "
              f"{r['ppl_change_pct']:7.2f} {r['mean_rel_err']:9.4f} {r['max_rel_err']:8.4f} "
              f"{r['mean_density']:15.3f}")
    payload = {
        "date_utc": time.strftime("%Y-%m-%d", time.gmtime()), "source": source, "tokens": n,
        "sale_config": cfg.__dict__, "implementation": "xla (jnp reference of the kernels)",
        "results": results, "calibrated_tau": None if calib is None else calib.tolist(),
        "seconds": round(time.time() - start, 1), "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2))
    panels = [{"curves": [{"x": [p["layer"] for p in r["per_layer"]],
                           "y": [p[key] for p in r["per_layer"]], "label": r["setting"]}
                          for r in results], "xlabel": "layer", "ylabel": ylabel, **extra}
              for key, ylabel, extra in (
                  ("rel_err", "relative output error", {"yscale": "log", "legend": False}),
                  ("density", "fraction of causal blocks computed", {"legend_fontsize": 8}))]
    plot_panels(panels, out_dir / "sale_smollm2.png", figsize=(10, 3.5),
                suptitle=f"SALE vs dense attention, {source}, {n} tokens")
    print(f"wrote {out_dir / 'results.json'} ({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
