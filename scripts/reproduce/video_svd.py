"""Video-SVD on a trained video DiT: QKᵀ spectrum, then a rank sweep with/without residuals.

    python scripts/reproduce/video_svd.py [--quick] [--checkpoint runs/video_dit]

1. Loads the DiT saved by ``scripts/reproduce/train_video_dit.py`` (or trains one briefly when
   the checkpoint is missing).
2. Calibration: dense sampling from calibration noise; every layer's post-RoPE Q/K/V at every
   sampling step is accumulated into Gram statistics; bases are fitted per layer and head.
3. Observation 1: singular values of QKᵀ per layer/head on a held-out clip vs random Q, K of the
   same shape (plot ``docs/img/video_svd_spectrum.png``).
4. Rank sweep (rank = rank_v): attention output error against dense (held-out Q/K/V), per-frame
   PSNR/SSIM of clips sampled from the same noise against dense sampling, attention FLOPs saved
   (analytic), CPU wall-clock ratio of the attention op and of one DiT forward (XLA paths), with
   the residual stream (exact same-frame blocks) and without it (subspace stream only).
   Sample frames go to ``docs/img/video_svd_samples.png``; numbers to
   ``docs/results/video_svd.json`` (``--quick``: everything under ``runs/video_svd_quick/``).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.analysis.rank import energy_rank
from lowrank_jax.attention import subspace as vsvd
from lowrank_jax.bench import speedup
from lowrank_jax.data.video import frame_psnr, frame_ssim
from lowrank_jax.models import video_dit
from lowrank_jax.analysis.report import plot_curves, plot_frames

IMG = os.path.join("docs", "img")
RESULTS = os.path.join("docs", "results", "video_svd.json")
QUICK_DIR = os.path.join("runs", "video_svd_quick")  # --quick never overwrites the docs


def spectrum_plot(model, noise, steps, img_dir):
    """σ_i/σ_1 of QKᵀ per layer/head (mid-trajectory, first clip) and a random baseline."""
    cfg = model.config
    qkv_steps = list(video_dit.sampling_qkv(model, noise, steps=steps))
    spectra, ranks = {}, {}
    for step in (0, steps // 2, steps - 1):
        for layer, (q, k, _) in enumerate(qkv_steps[step]):
            for h in range(cfg.heads):
                s = np.asarray(vsvd.qk_singular_values(q[0, :, h], k[0, :, h]))
                spectra[(step, layer, h)] = s / s[0]
                ranks[f"step{step}/L{layer}H{h}"] = [int(energy_rank(jnp.asarray(s), e))
                                                    for e in (0.9, 0.99)]
    rng = np.random.default_rng(0)
    rand = np.asarray(vsvd.qk_singular_values(
        jnp.asarray(rng.standard_normal((cfg.tokens, cfg.head_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((cfg.tokens, cfg.head_dim)), jnp.float32)))
    ranks["random"] = [int(energy_rank(jnp.asarray(rand), e)) for e in (0.9, 0.99)]
    mid = steps // 2
    curves = [{"x": np.arange(1, len(s) + 1), "y": s, "marker": ".",
               "label": f"layer {layer} head {h}"}
              for (step, layer, h), s in spectra.items() if step == mid]
    curves.append({"x": np.arange(1, len(rand) + 1), "y": rand / rand[0], "color": "k",
                   "ls": "--", "label": "random Q, K"})
    plot_curves(curves, os.path.join(img_dir, "video_svd_spectrum.png"), xlabel="index i",
                ylabel="σ_i / σ_1 of QKᵀ", yscale="log", legend_fontsize=7, figsize=(6, 4),
                title=f"Video DiT QKᵀ spectrum (N={cfg.tokens}, d={cfg.head_dim}, step "
                f"{mid}/{steps})")
    return ranks, qkv_steps


def synthetic_timing(quick: bool) -> list[dict]:
    """CPU wall-clock of the attention op alone at a larger latent grid (timing only)."""
    grid = (8, 8, 8) if quick else (8, 16, 16)
    n, heads, d = int(np.prod(grid)), 2, 64
    block = grid[1] * grid[2]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, n, heads, d)) for key in keys)
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    rows = []
    for rank in (8, 16):
        basis = jnp.broadcast_to(jnp.eye(d)[:, :rank], (heads, d, rank))
        bases = vsvd.SubspaceBases(basis, basis, basis, basis, basis, jnp.ones((heads, d)),
                                   jnp.full((heads,), rank), jnp.full((heads,), rank))
        for residual, window_t in (("none", None), ("same-frame", 0)):
            mask = vsvd.spatiotemporal_block_mask(grid, block, block, window_t=window_t)
            vcfg = vsvd.VideoSVDConfig(block_q=block, block_k=block, window_t=window_t,
                                       implementation="xla")
            fast = jax.jit(lambda q, k, v, m=mask, c=vcfg, b=bases:
                           vsvd.video_svd_attention(q, k, v, b, m, c))
            flops = vsvd.attention_flops(n, d, rank, rank, mask, block, block)
            rows.append({"tokens": n, "head_dim": d, "rank": rank, "residual": residual,
                         "flops_saved": flops["saved"],
                         "cpu_attention_speedup": speedup(lambda: dense(q, k, v),
                                                          lambda f=fast: f(q, k, v),
                                                          reps=3 if quick else 7)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer clips, steps and ranks")
    parser.add_argument("--checkpoint", default=os.path.join("runs", "video_dit"))
    parser.add_argument("--steps", type=int, default=16, help="sampling steps")
    parser.add_argument("--clips", type=int, default=8, help="evaluation clips")
    args = parser.parse_args(argv)
    steps, clips = (6, 2) if args.quick else (args.steps, args.clips)
    img_dir = QUICK_DIR if args.quick else IMG
    results = os.path.join(QUICK_DIR, "video_svd.json") if args.quick else RESULTS
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(os.path.dirname(results), exist_ok=True)
    model, source = video_dit.load_or_train_video_dit(args.checkpoint,
                                                      steps=40 if args.quick else 300)
    cfg = model.config
    gt, gy, gx = cfg.grid
    block = gy * gx  # one latent frame per block: frame-aligned windows
    shape = (cfg.frames, cfg.height, cfg.width, cfg.channels)
    calib_noise = jax.random.normal(jax.random.key(100), (clips, *shape))
    eval_noise = jax.random.normal(jax.random.key(200), (clips, *shape))

    stats = video_dit.calibrate_grams(model, calib_noise, steps=steps)
    ranks, held_out = spectrum_plot(model, eval_noise, steps, img_dir)
    print("energy ranks (90%, 99%) of QKᵀ:", ranks)

    dense_forward = nnx.jit(lambda m, x, s: m(x, s))
    dense_clips = video_dit.sample(model, eval_noise, steps=steps)
    t_probe = jnp.full((clips,), 0.5)
    q0, k0, v0 = held_out[steps // 2][0]
    dense_att = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))

    rank_list = (4, cfg.head_dim) if args.quick else (2, 4, 8, 16, cfg.head_dim)
    windows = {"none": None, "same-frame": 0}
    rows, samples, labels = [], [dense_clips], ["dense"]
    for rank in rank_list:
        bases = [vsvd.fit_bases(s, rank=rank, rank_v=rank, eps=1e-6 * float(jnp.trace(s.gram_q[0])))
                 for s in stats]
        for residual, window_t in windows.items():
            mask = vsvd.spatiotemporal_block_mask(cfg.grid, block, block, window_t=window_t)
            vcfg = vsvd.VideoSVDConfig(block_q=block, block_k=block, window_t=window_t,
                                       implementation="xla")

            def attention(layer, q, k, v, bases=bases, mask=mask, vcfg=vcfg):
                return vsvd.video_svd_attention(q, k, v, bases[layer], mask, vcfg)

            errors = []
            for qkv in held_out:
                for layer, (q, k, v) in enumerate(qkv):
                    ref = jax.nn.dot_product_attention(q, k, v)
                    out = attention(layer, q, k, v)
                    errors.append(float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)))
            clips_out = video_dit.sample(model, eval_noise, steps=steps, attention=attention)
            psnr = np.asarray(frame_psnr(clips_out, dense_clips))
            ssim = np.asarray(frame_ssim(clips_out, dense_clips))
            flops = vsvd.attention_flops(cfg.tokens, cfg.head_dim, rank, rank, mask, block, block)
            fast_att = jax.jit(lambda q, k, v, a=attention: a(0, q, k, v))
            fast_forward = nnx.jit(lambda m, x, s, a=attention: m(x, s, attention=a))
            att_speedup = speedup(lambda: dense_att(q0, k0, v0), lambda f=fast_att: f(q0, k0, v0),
                                  reps=5 if args.quick else 21)
            fwd_speedup = speedup(lambda: dense_forward(model, eval_noise, t_probe),
                                  lambda f=fast_forward: f(model, eval_noise, t_probe),
                                  reps=3 if args.quick else 9)
            row = {"rank": rank, "residual": residual,
                   "near_fraction": flops["near_fraction"],
                   "attention_rel_error": float(np.mean(errors)),
                   "psnr_db": float(np.mean(psnr[np.isfinite(psnr)])) if np.isfinite(psnr).any()
                   else float("inf"),
                   "psnr_min_db": float(np.min(psnr)), "ssim": float(np.mean(ssim)),
                   "ssim_min": float(np.min(ssim)), "flops_saved": flops["saved"],
                   "flops_ratio": flops["ratio"],
                   "cpu_attention_speedup": att_speedup,
                   "cpu_forward_speedup": fwd_speedup}
            if window_t is not None and rank in (4, 8):  # our warm-up knob: first 25% dense
                warm = video_dit.sample(model, eval_noise, steps=steps, attention=attention,
                                        dense_steps=steps // 4)
                row["warmup_dense_steps"] = steps // 4
                row["warmup_psnr_db"] = float(np.mean(np.asarray(frame_psnr(warm, dense_clips))))
                row["warmup_ssim"] = float(np.mean(np.asarray(frame_ssim(warm, dense_clips))))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if rank in (4, 8) or (args.quick and rank == 4):
                samples.append(clips_out)
                labels.append(f"r={rank} {residual}")

    plot_frames([clips[0] for clips in samples], labels,
                os.path.join(img_dir, "video_svd_samples.png"))
    synthetic = synthetic_timing(args.quick)
    header = ("| rank | residual | near % | attn rel. err | PSNR dB (min) | SSIM (min) | "
              "attn FLOPs saved | CPU attn speedup | CPU forward speedup |")
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        print(f"| {r['rank']} | {r['residual']} | {100 * r['near_fraction']:.1f} | "
              f"{r['attention_rel_error']:.3f} | {r['psnr_db']:.1f} ({r['psnr_min_db']:.1f}) | "
              f"{r['ssim']:.3f} ({r['ssim_min']:.3f}) | {100 * r['flops_saved']:.0f}% | "
              f"{r['cpu_attention_speedup']:.2f}x | {r['cpu_forward_speedup']:.2f}x |")
    print("| rank | residual | PSNR dB, all steps | PSNR dB, first 25% dense | SSIM "
          "| SSIM warm-up |")
    print("|" + "---|" * 6)
    for r in rows:
        if "warmup_psnr_db" in r:
            print(f"| {r['rank']} | {r['residual']} | {r['psnr_db']:.1f} | "
                  f"{r['warmup_psnr_db']:.1f} | {r['ssim']:.3f} | {r['warmup_ssim']:.3f} |")
    print("| tokens | head dim | rank | residual | attn FLOPs saved | CPU attn speedup |")
    print("|" + "---|" * 6)
    for r in synthetic:
        print(f"| {r['tokens']} | {r['head_dim']} | {r['rank']} | {r['residual']} | "
              f"{100 * r['flops_saved']:.0f}% | {r['cpu_attention_speedup']:.2f}x |")
    with open(results, "w") as f:
        json.dump({"model": source, "config": {"grid": cfg.grid, "tokens": cfg.tokens,
                                               "heads": cfg.heads, "head_dim": cfg.head_dim,
                                               "layers": cfg.layers},
                   "sampling_steps": steps, "clips": clips, "energy_ranks": ranks,
                   "rows": rows, "synthetic_timing": synthetic, "quick": args.quick}, f,
                  indent=1)
    print(f"wrote {results}, {img_dir}/video_svd_samples.png, {img_dir}/video_svd_spectrum.png")


if __name__ == "__main__":
    main()
