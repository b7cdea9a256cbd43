"""IsoFLOP scaling-law fit for natively factorized Llamas trained with Spectron (tiny, CPU).

For each compute budget ``C`` (training FLOPs) and each model width ``d`` in a grid, train a
factorized Llama (rank ratio 0.25, Spectron on the factors, AdamW on the rest) for
``C / (F(d) · tokens_per_step)`` steps, where ``F(d)`` is the forward+backward FLOPs per token
(``6·N_matmul`` + attention, see
:func:`lowrank_jax.models.flops.training_flops_per_token`), and record the final validation
loss. Per budget a quadratic ``L(log N)`` is fitted (the isoFLOP parabola); its vertex
gives ``N_opt(C)`` and ``D_opt = C / F(N_opt)`` tokens. Power laws ``N_opt ∝ C^a`` and
``D_opt ∝ C^b`` are fitted by least squares in log-log space, with the slope's standard error,
and printed next to the paper's ``a = 0.479``, ``b = 0.521``.

These budgets are ~10⁸× smaller than the paper's 2.2e18–3.57e19 FLOPs, on a byte-level corpus
of a few MB, so expect the exponents to be noisy; the script reports what it measures.

Usage::

    python -m scripts.reproduce.scaling_law           # default small grid (≤ 10 min on 2 CPU cores)
    python -m scripts.reproduce.scaling_law --quick   # smoke run (~2 min)
    # larger:
    python -m scripts.reproduce.scaling_law --widths 32 64 96 128 --budgets 2e10 6e10 1.8e11

Writes ``<out>/results.json`` and ``<out>/isoflop.png`` (default ``runs/scaling_law``).

References:
    Janson, Oyallon, Belilovsky, `Stabilizing Native Low-Rank LLM Pretraining
    <https://arxiv.org/abs/2602.12429>`_, ICML 2026; Hoffmann et al, `Training Compute-Optimal
    Large Language Models <https://arxiv.org/abs/2203.15556>`_, 2022.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from lowrank_jax.data import batch_at, corpus_bytes, train_val_split  # noqa: E402
from lowrank_jax.train.loop import evaluate
from lowrank_jax.train.sweep import fit_power_law, isoflop_optimum
from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.models import Llama, LlamaConfig  # noqa: E402
from lowrank_jax.optim import spectron_with_adamw  # noqa: E402
from lowrank_jax.train import lm_loss, make_eval_fn, make_step  # noqa: E402
from lowrank_jax.models.flops import training_flops_per_token as flops_per_token  # noqa: E402
from lowrank_jax.train.lockstep import LockstepRun, train_lockstep  # noqa: E402

PAPER_A, PAPER_B = 0.479, 0.521


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/scaling_law")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--widths", type=int, nargs="+", default=[32, 48, 64, 96])
    p.add_argument("--budgets", type=float, nargs="+", default=[8e9, 2.4e10, 7.2e10])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rank-ratio", type=float, default=0.25)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument("--other-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.widths, args.budgets, args.eval_batches = [32, 48, 64], [2e9, 6e9, 1.8e10], 4
    if len(args.widths) < 3 or len(args.budgets) < 2:
        raise ValueError("need at least 3 widths (for a parabola) and 2 budgets (for a slope).")
    return args


def make_config(args, width: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, d_model=width, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.heads, d_ff=4 * width, max_seq_len=args.seq,
                       projection="factorized", rank_ratio=args.rank_ratio)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = train_val_split(corpus_bytes())
    tokens_per_step = args.batch * args.seq

    plan = []
    for width in args.widths:
        cfg = make_config(args, width)
        fpt = flops_per_token(cfg, args.seq)
        steps = {c: max(10, int(round(c / (fpt * tokens_per_step)))) for c in args.budgets}
        plan.append((width, cfg, fpt, steps))
    total = sum(sum(s.values()) for *_, s in plan)
    print(f"{len(args.widths)} widths x {len(args.budgets)} budgets, {total} steps in all")

    records = []
    tx = optax.inject_hyperparams(
        spectron_with_adamw,
        static_args=("b1", "b2", "ns_steps", "ns_coeffs", "power_iters", "pair_fn"))(
        eta=args.eta, adamw_lr=args.other_lr, weight_decay=args.weight_decay)
    t_start = time.time()
    with tqdm(total=total, desc="isoFLOP grid") as bar:
        for width, cfg, fpt, steps in plan:
            model = Llama(cfg, rngs=nnx.Rngs(args.seed))
            graphdef, state = nnx.split(model)
            params0 = nnx.as_pure(state)
            n_params = int(sum(x.size for x in jax.tree.leaves(params0)))
            n_matmul = (fpt - 12 * cfg.n_layers * width * args.seq / 2) / 6.0
            step_fn, eval_fn = make_step(lm_loss(graphdef), tx), make_eval_fn(graphdef)
            runs = {c: LockstepRun(f"{c:.2e}", step_fn, params0, tx.init(params0), steps[c],
                                   {"eta": args.eta, "adamw_lr": args.other_lr})
                    for c in args.budgets}
            # budgets of one width run in lockstep, never stopped by a high loss
            train_lockstep(list(runs.values()), lambda step: tuple(
                jnp.asarray(t) for t in batch_at(train, step, args.batch, args.seq,
                                                 seed=args.seed)),
                warmup_frac=args.warmup_frac, max_loss=float("inf"),
                on_step=lambda: bar.update(1))
            for c, run in runs.items():
                records.append({"width": width, "budget": c, "steps": steps[c],
                                "tokens": steps[c] * tokens_per_step, "n_params": n_params,
                                "n_matmul": n_matmul, "flops_per_token": fpt,
                                "val_loss": evaluate(eval_fn, run.params, val, args.batch, args.seq,
                                                     args.eval_batches),
                                "final_train_loss": float(np.mean(run.losses[-10:]))})

    fits = []
    print(f"\n{'budget':>9} {'width':>6} {'N_matmul':>9} {'tokens':>9} {'val loss':>9}")
    for c in args.budgets:
        rows = sorted((r for r in records if r["budget"] == c), key=lambda r: r["n_matmul"])
        for r in rows:
            print(f"{c:>9.2e} {r['width']:>6} {r['n_matmul']:>9.0f} {r['tokens']:>9} "
                  f"{r['val_loss']:>9.4f}")
        fit = isoflop_optimum([r["n_matmul"] for r in rows], [r["val_loss"] for r in rows])
        fits.append({"budget": c, **fit, "d_opt_tokens": c / (6.0 * fit["n_opt"])})

    a, _, a_err = fit_power_law([f["budget"] for f in fits], [f["n_opt"] for f in fits])
    b, _, b_err = fit_power_law([f["budget"] for f in fits], [f["d_opt_tokens"] for f in fits])
    print(f"\n{'budget':>9} {'N_opt':>10} {'D_opt':>10} {'vertex in grid':>15}")
    for f in fits:
        print(f"{f['budget']:>9.2e} {f['n_opt']:>10.0f} {f['d_opt_tokens']:>10.0f} "
              f"{str(f['vertex_inside_grid']):>15}")
    print(f"\nN_opt ∝ C^a: a = {a:.3f} ± {a_err:.3f}   (paper: {PAPER_A})")
    print(f"D_opt ∝ C^b: b = {b:.3f} ± {b_err:.3f}   (paper: {PAPER_B})")
    print("(D_opt = C / (6 N_opt), so a + b = 1 by construction; ± is the slope's std error.)")

    summary = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "config": vars(args),
               "wall_s": time.time() - t_start, "runs": records, "isoflop_fits": fits,
               "a": a, "a_stderr": a_err, "b": b, "b_stderr": b_err,
               "paper_a": PAPER_A, "paper_b": PAPER_B}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    plot(records, fits, out / "isoflop.png")
    print(f"wrote {out / 'results.json'} and {out / 'isoflop.png'}")
    return 0


def plot(records, fits, path: Path) -> None:
    curves = []
    for k, f in enumerate(fits):
        rows = sorted((r for r in records if r["budget"] == f["budget"]),
                      key=lambda r: r["n_matmul"])
        n = np.array([r["n_matmul"] for r in rows])
        grid = np.exp(np.linspace(np.log(n.min()), np.log(n.max()), 50))
        curves += [{"x": n, "y": [r["val_loss"] for r in rows], "style": "o", "color": f"C{k}",
                    "label": f"C={f['budget']:.1e}"},
                   {"x": grid, "y": np.polyval(f["quadratic"], np.log(grid)), "color": f"C{k}"}]
    plot_panels([{"curves": curves, "xscale": "log", "xlabel": "matmul parameters N",
                  "ylabel": "val loss (nats)", "legend_fontsize": 8,
                  "title": "IsoFLOP curves, factorized Llama + Spectron"}], str(path),
                figsize=(6, 4.5))


if __name__ == "__main__":
    raise SystemExit(main())
