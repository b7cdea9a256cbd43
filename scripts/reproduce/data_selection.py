"""Low-rank residual data selection vs uniform and k-means sensitivity sampling.

Three parts, all measured in one run:

1. Synthetic (spec §7): n = 20,000 rows near a rank-8 subspace of R^64, 3% off-subspace rows, loss
   ``softplus(wᵀz/3) + 0.5 r``. Relative error ``|L̂ − L̄| / L̄`` of the weighted subset mean at
   several budgets m, median and 90th percentile over ``--reps`` keys.
2. Real embeddings: SmolLM2-135M mean-pooled final hidden states of token chunks of the embedded
   standard-library docstring corpus (centred); the loss of a chunk is the model's mean
   next-token NLL on it. Same error table, for rank k ∈ ``--ranks``.
3. End use: LoRA fine-tuning of SmolLM2 (rank 8 on q/v) on a selected subset of the chunks
   (low-rank residual coreset, batches drawn ∝ its weights) vs a uniformly random subset with the
   same number of distinct chunks; held-out NLL on other chunks before and after.

Oracle calls: uniform m; k-means 4k cluster queries + m; low-rank 4k representatives + m (only the
m sampled losses enter the estimate).

Usage::

    python scripts/reproduce/data_selection.py --quick    # CPU minutes
    python scripts/reproduce/data_selection.py

Paper: Cohen-Addad et al, "Active Learning with Low-Rank Structure for Data Selection", ICML 2026
(https://arxiv.org/abs/2606.16045); baseline Axiotis et al, ICML 2024.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer budgets/chunks/steps (CPU minutes)")
    p.add_argument("--out", default="runs/reproduce_data_selection")
    p.add_argument("--reps", type=int, default=None, help="keys per cell (default 50, quick 20)")
    p.add_argument("--chunks", type=int, default=None,
                   help="corpus chunks (default 600, quick 128)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="tokens/chunk (128, quick 64)")
    p.add_argument("--finetune-steps", type=int, default=None, help="LoRA steps (60, quick 12)")
    p.add_argument("--skip-real", action="store_true", help="synthetic part only (no SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    q = args.quick
    args.reps = args.reps or (20 if q else 50)
    args.chunks = args.chunks or (128 if q else 600)
    args.chunk_tokens = args.chunk_tokens or (64 if q else 128)
    args.finetune_steps = args.finetune_steps or (12 if q else 60)
    args.budgets = (100, 400) if q else (100, 400, 1600)
    args.real_budgets = (16, 32) if q else (16, 32, 64, 128)
    args.ranks = (4,) if q else (8, 16)
    return args


def print_table(title, rows):
    from lowrank_jax.runs.results import markdown_table

    cells = list(next(iter(rows.values())))
    print(f"\n{title}: relative error median / p90 (oracle calls)")
    print("\n".join(markdown_table(["method", *cells], [
        {"method": name, **{c: f"{v[0]:.3f} / {v[1]:.3f} ({v[2]})" for c, v in vals.items()}}
        for name, vals in rows.items()])))


def main(argv=None) -> int:
    import jax

    from lowrank_jax.data import selection as sel
    from lowrank_jax.data.coreset_errors import coreset_error_table

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    result = {"args": {k: v for k, v in vars(args).items()}}

    A, losses, _ = sel.synthetic_lowrank_losses(jax.random.key(args.seed))
    synth = coreset_error_table(A, losses, args.budgets, (8,), args.reps, args.seed,
                                lipschitz_kmeans=0.5)
    print_table("synthetic n=20000 d=64 k=8", synth)
    result["synthetic"] = synth
    print(f"[{time.time() - start:.0f}s]")

    if not args.skip_real:
        from lowrank_jax.data import corpus_text
        from lowrank_jax.hub import load_model
        from lowrank_jax.train.finetune import finetune

        model, tok = load_model("smollm2")
        all_chunks = sel.chunk_tokens(tok.encode(corpus_text()), args.chunk_tokens,
                                      min_tokens=args.chunk_tokens)
        order = np.random.default_rng(args.seed).permutation(len(all_chunks))
        heldout_n = 16 if args.quick else 48
        pool = [all_chunks[i] for i in order[:args.chunks]]
        heldout = [all_chunks[i] for i in order[args.chunks:args.chunks + heldout_n]]
        emb, nll = sel.text_embeddings(model, pool, with_loss=True)
        heldout_nll = lambda m: float(np.mean(sel.text_embeddings(
            m, heldout, with_loss=True)[1]))
        emb = emb - emb.mean(0, keepdims=True)
        print(f"embedded {len(pool)} of {len(all_chunks)} chunks x {args.chunk_tokens} tokens, "
              f"mean NLL {nll.mean():.3f} [{time.time() - start:.0f}s]")
        real = coreset_error_table(emb, nll, args.real_budgets, args.ranks, args.reps, args.seed)
        print_table(f"SmolLM2 hidden states, n={len(pool)} d={emb.shape[1]}", real)
        result["real"] = real
        print(f"[{time.time() - start:.0f}s]")

        budget = args.real_budgets[-1]
        cs = sel.select_subset(jax.random.key(args.seed), emb, budget, losses=nll,
                               rank=args.ranks[0])
        idx, w = sel.compact(cs.idx, cs.weights)
        rand = np.random.default_rng(args.seed + 1).choice(len(pool), size=len(idx),
                                                           replace=False)
        base = heldout_nll(model)
        del model
        ft = {"base_heldout_nll": base, "distinct_chunks": len(idx)}
        for name, chosen, p in (("lowrank_residual", idx, w / w.sum()),
                                ("random", rand, np.full(len(rand), 1 / len(rand)))):
            tuned, _ = load_model("smollm2")  # LoRA(q, v, rank 8) on batches drawn ∝ p
            finetune(tuned, sel.weighted_batches([pool[i] for i in chosen], p,
                                                 args.finetune_steps, 4, args.seed),
                     steps=args.finetune_steps, lr=2e-3, seed=args.seed, progress=False)
            ft[name] = heldout_nll(tuned)
            del tuned
            print(f"finetune {name}: held-out NLL {base:.4f} -> {ft[name]:.4f} "
                  f"[{time.time() - start:.0f}s]")
        result["finetune"] = ft

    result["seconds"] = time.time() - start
    path = os.path.join(args.out, "data_selection.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({result['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
