"""Reproduce the Diffract claims at toy scale: continued pretraining (CPT) of a tiny byte-level
Llama on a shifted domain keeps singular *values* nearly fixed while singular *vectors* rotate,
and rewinding the least-important attention heads to the base costs little, compared in the same
run with rewinding the most important heads and random heads. Also interpolates two CPT runs
(domain connectivity).

Domains (all shipped with Python, no download; ``lowrank_jax.data.corpus.domain_bytes``):
  A  "docs": docstrings of the standard library (lowrank_jax.data.corpus_text), pretraining;
  B  "code": Python source of a fixed list of standard-library modules, CPT domain;
  C  "reference": the language-reference prose of pydoc_data.topics, a second CPT domain.

    python -m scripts.reproduce.diffract            # default, ≈ 5–10 min on 2 CPU cores
    python -m scripts.reproduce.diffract --quick    # smoke run, ≈ 1–2 min
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from lowrank_jax.analysis import head_scores, interpolate, loss_barrier, rewind_curve
from lowrank_jax.analysis.report import compare_to_random_update, plot_panels, write_json
from lowrank_jax.data import batch_at, train_val_split
from lowrank_jax.data.corpus import domain_bytes
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.core.step import make_step
from lowrank_jax.train.loop import lm_loss, make_eval_fn, train_steps

def train(params, loss_fn, tokens, *, steps, lr, batch, seq, seed, desc, warmup=20):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps // 4 + 1), steps,
                                                  lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    params, _, losses = train_steps(make_step(loss_fn, opt), params, opt.init(params), tokens,
                                    steps=steps, batch_size=batch, seq_len=seq, seed=seed,
                                    desc=desc)
    return params, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/reproduce_diffract")
    ap.add_argument("--quick", action="store_true", help="few steps, smoke run")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--cpt-steps", type=int, default=None)
    ap.add_argument("--cpt-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pre_steps = args.pretrain_steps or (120 if args.quick else 1200)
    cpt_steps = args.cpt_steps or (60 if args.quick else 400)
    batch, seq, n_eval = 16, 64, (4 if args.quick else 12)
    start = time.time()

    cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                      head_dim=8, d_ff=192, max_seq_len=seq)
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(args.seed)))
    params0, loss_fn, eval_loss = nnx.to_pure_dict(state), lm_loss(graphdef), make_eval_fn(graphdef)

    data = {d: train_val_split(domain_bytes(d), 0.1) for d in ("docs", "code", "reference")}
    val = {d: [batch_at(v, i, batch, seq, seed=123) for i in range(n_eval)]
           for d, (_, v) in data.items()}

    def eval_all(p):
        return {d: float(np.mean([float(eval_loss(p, x, y)) for x, y in b]))
                for d, b in val.items()}

    base, _ = train(params0, loss_fn, data["docs"][0], steps=pre_steps, lr=3e-3, batch=batch,
                    seq=seq, seed=args.seed, desc="pretrain on docs (A)")
    tuned_b, _ = train(base, loss_fn, data["code"][0], steps=cpt_steps, lr=args.cpt_lr,
                       batch=batch, seq=seq, seed=args.seed + 1, desc="CPT on code (B)")
    tuned_c, _ = train(base, loss_fn, data["reference"][0], steps=cpt_steps, lr=args.cpt_lr,
                       batch=batch, seq=seq, seed=args.seed + 2, desc="CPT on reference (C)")
    losses = {"base": eval_all(base), "cpt_code": eval_all(tuned_b),
              "cpt_reference": eval_all(tuned_c)}

    # (i) spectra: values stay, vectors rotate (baseline: a random update of the same norm)
    per_matrix = compare_to_random_update(base, tuned_b, k=8, seed=args.seed)
    shares = np.array([r["spectral_share"] for r in per_matrix.values()])
    rel_update = np.array([r["relative_update"] for r in per_matrix.values()])
    rel_spec = np.array([r["relative_spectrum_change"] for r in per_matrix.values()])
    shares_rand = np.array([r["random_update_spectral_share"] for r in per_matrix.values()])

    # (ii) head rewinding: least important vs most important vs random
    kw = dict(num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads)
    scores = {c: head_scores(base, tuned_b, criterion=c, k=4, **kw)
              for c in ("rel_update", "rotation")}
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]
    plans = {"least rel_update": (scores["rel_update"], True),
             "least rotation": (scores["rotation"], True),
             "most rel_update": (scores["rel_update"], False)}
    rewind = {label: rewind_curve(base, tuned_b, sc, fractions, eval_all, lowest=lowest, **kw)
              for label, (sc, lowest) in tqdm(plans.items(), desc="rewind heads", leave=False)}
    rand_runs = [rewind_curve(base, tuned_b, head_scores(base, tuned_b, criterion="random",
                                                         seed=s, **kw), fractions, eval_all, **kw)
                 for s in (1, 2, 3)]
    rewind["random (mean of 3)"] = [
        {d: float(np.mean([r[i][d] for r in rand_runs])) for d in val}
        for i in range(len(fractions))
    ]

    # (iii) interpolation between the two CPT runs
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    path = [eval_all(interpolate(tuned_b, tuned_c, a)) for a in tqdm(alphas, desc="interpolate",
                                                                     leave=False)]
    barrier = {d: loss_barrier(alphas, [p[d] for p in path]) for d in val}

    gain = losses["base"]["code"] - losses["cpt_code"]["code"]
    results = {
        "config": {"pretrain_steps": pre_steps, "cpt_steps": cpt_steps, "cpt_lr": args.cpt_lr,
                   "batch": batch, "seq": seq, "model": vars(cfg), "quick": args.quick},
        "losses_nats_per_byte": losses,
        "spectral": {"per_matrix": per_matrix, "median_spectral_share": float(np.median(shares)),
                     "median_spectral_share_random_update": float(np.median(shares_rand)),
                     "median_relative_update": float(np.median(rel_update)),
                     "median_relative_spectrum_change": float(np.median(rel_spec))},
        "head_scores": scores, "rewind_fractions": fractions, "rewind": rewind,
        "cpt_gain_on_code": gain,
        "interpolation": {"alphas": alphas, "losses": path, "barrier": barrier},
        "seconds": time.time() - start,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json(results, os.path.join(args.out, "results.json"))

    print(f"\nlosses (nats/byte)  {'docs(A)':>9} {'code(B)':>9} {'ref(C)':>9}")
    for k, v in losses.items():
        print(f"{k:<18} {v['docs']:9.3f} {v['code']:9.3f} {v['reference']:9.3f}")
    print("\n(i) base → CPT(code), per matrix")
    print(f"{'matrix':<34} {'S':>6} {'S_rand':>7} {'|dW|/|W|':>9} {'|ds|/|s|':>9} "
          f"{'O_ii(L)':>8} {'O_rand':>7} {'floor':>6}")
    for name, r in per_matrix.items():
        print(f"{name:<34} {r['spectral_share']:6.3f} {r['random_update_spectral_share']:7.3f} "
              f"{r['relative_update']:9.4f} {r['relative_spectrum_change']:9.4f} "
              f"{r['left_diag_overlap']:8.3f} {r['random_update_left_diag_overlap']:7.3f} "
              f"{r['left_noise_floor']:6.3f}")
    print(f"median spectral share S = {np.median(shares):.3f} (0 = pure rotation, 1 = pure "
          f"rescale; random update of the same norm: {np.median(shares_rand):.3f}); median "
          f"relative update {np.median(rel_update):.4f}, median relative spectrum change "
          f"{np.median(rel_spec):.4f}")
    print(f"\n(ii) rewinding heads to the base: code(B) loss; CPT gain on code = {gain:.3f} nats")
    print(f"{'plan':<20}" + "".join(f"{'ρ=' + str(r):>9}" for r in fractions))
    for label, row in rewind.items():
        print(f"{label:<20}" + "".join(f"{x['code']:9.3f}" for x in row))
    print("docs(A) loss under the same plans")
    for label, row in rewind.items():
        print(f"{label:<20}" + "".join(f"{x['docs']:9.3f}" for x in row))
    print("\n(iii) interpolation CPT(code) → CPT(reference)")
    for a, p in zip(alphas, path):
        print(f"α={a:4.2f}  code {p['code']:.3f}  reference {p['reference']:.3f}  "
              f"docs {p['docs']:.3f}")
    print("barrier:", {k: round(v, 4) for k, v in barrier.items()})

    short = [n.replace("layers/", "L").replace("/kernel", "").replace("self_attn/", "")
             .replace("mlp/", "") for n in per_matrix]
    plot_panels([
        {"curves": [{"x": rel_update, "y": shares, "style": "o", "label": "CPT update",
                     "annotate": short},
                    {"x": rel_update, "y": shares_rand, "style": "x", "color": "gray",
                     "label": "random update, same norm"}],
         "xlabel": "relative update ‖ΔW‖/‖W0‖", "ylabel": "spectral share S", "ylim": (0, 1),
         "title": "CPT mostly rotates (S ≪ 1)"},
        {"curves": [{"x": fractions, "y": [x["code"] for x in row], "style": "o-",
                     "label": label} for label, row in rewind.items()],
         "hlines": [(losses["base"]["code"], "base (no CPT)", ":")],
         "xlabel": "fraction of heads rewound to base", "ylabel": "code (B) loss, nats/byte",
         "title": "rewinding heads"},
        {"curves": [{"x": alphas, "y": [p[d] for p in path], "style": "o-", "label": d}
                    for d in val],
         "xlabel": "α (0 = CPT code, 1 = CPT reference)", "ylabel": "loss, nats/byte",
         "title": "interpolation between CPT runs"},
    ], os.path.join(args.out, "diffract.png"), figsize=(15, 4.3), dpi=110)
    print(f"\nwrote {args.out}/results.json and diffract.png in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
