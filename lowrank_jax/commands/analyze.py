"""``lowrank-jax analyze``: a spectral report of a model (and of its update from a base).

Writes to ``--out``: ``report.json`` (every metric per matrix and per layer, unembedding geometry,
head scores, key CKA) and PNGs: ``spectra.png``, ``effective_rank_by_layer.png``,
``head_importance.png``, ``key_cka.png``.
"""

from __future__ import annotations

import os
import time

from lowrank_jax.io.validate import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", help="spectral report of a model: ranks, spectra, heads, key CKA",
        description="Compute effective/stable/numerical rank, spectra with power-law and "
                    "Marchenko-Pastur fits for every matrix, per-head statistics, the "
                    "cross-layer CKA of the KV cache's keys on a fixed English passage, and, "
                    "with --compare, Diffract's update analysis (spectral share, singular-vector "
                    "overlaps, head importance).",
    )
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', a .gguf file, a HF folder, or 'tiny' (random tiny Llama)")
    p.add_argument("--compare", default=None, metavar="CHECKPOINT",
                   help="base to compare against: an orbax checkpoint of the same model's params "
                        "(lowrank_jax.analysis.save_params), or another model name/path")
    p.add_argument("--layers", default=None, metavar="REGEX",
                   help="only matrices whose path matches, e.g. 'self_attn' or 'layers/(0|1)/'")
    p.add_argument("--out", default="runs/analyze", help="report folder")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.add_argument("--top-k", type=positive_int, default=8,
                   help="singular vectors in overlaps/rotation")
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="passage tokens for key CKA")
    p.set_defaults(func=run)


def _load(name: str):
    from flax import nnx

    from lowrank_jax.models.llama import Llama, LlamaConfig

    if name == "tiny":
        cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                          d_ff=128, max_seq_len=256)
        return Llama(cfg, rngs=nnx.Rngs(0)), None
    from lowrank_jax.models.hub import load_model

    return load_model(name)


def _is_orbax(path: str) -> bool:
    return os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))


def _encode(tokenizer, text: str, max_tokens: int):
    if tokenizer is None:
        ids = list(text.encode("utf-8"))
    else:
        ids = tokenizer.encode(text)
    return ids[:max_tokens]


def run(args) -> int:
    import jax
    import numpy as np
    from flax import nnx

    from lowrank_jax.analysis import checkpoint as ckpt
    from lowrank_jax.analysis import report
    from lowrank_jax.analysis.heads import head_scores
    from lowrank_jax.io.outputs import prepare_output
    from lowrank_jax.io.validate import check_regex

    check_regex(args.layers, "--layers")
    prepare_output(args.out, command="analyze", overwrite=args.overwrite)
    start = time.time()
    model, tokenizer = _load(args.model)
    cfg = model.cfg
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shapes = ckpt.params_shapes(params)

    base = None
    if args.compare:
        if _is_orbax(args.compare):
            other = ckpt.checkpoint_shapes(args.compare)
            ckpt.check_same_architecture(shapes, other, f"--model {args.model}", args.compare)
            # leaf-at-a-time: only the compared matrices are restored
            base = ckpt.restore_params(args.compare, params)
        else:
            other_model, _ = _load(args.compare)
            base = nnx.to_pure_dict(nnx.state(other_model, nnx.Param))
            ckpt.check_same_architecture(shapes, ckpt.params_shapes(base),
                                         f"--model {args.model}", f"--compare {args.compare}")

    results = report.analyze_params(params, layer_filter=args.layers, base=base, top_k=args.top_k)
    os.makedirs(args.out, exist_ok=True)

    if cfg.tie_embeddings or params.get("lm_head") is None:
        unembed = params["embed_tokens"]["embedding"]
    else:
        unembed = np.asarray(params["lm_head"]["kernel"]).T
    results["unembedding"] = report.unembedding_report(unembed)
    results["unembedding"]["tied"] = bool(cfg.tie_embeddings)

    if base is not None:
        scores = {c: head_scores(base, params, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads,
                                 criterion=c, k=args.top_k) for c in ("rel_update", "rotation")}
        results["head_scores"] = scores
        heat, title = scores["rel_update"], "head importance (relative update, vs base)"
    else:
        from lowrank_jax.analysis.heads import head_slices
        from lowrank_jax.analysis.rank import effective_rank_of

        heat = np.zeros((cfg.n_layers, cfg.n_heads))
        for i in range(cfg.n_layers):
            sl = head_slices(params, i, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads)
            for h in range(cfg.n_heads):
                heat[i, h] = float(effective_rank_of(sl["q_proj"][h]))
        results["head_q_effective_rank"] = heat
        title = "per-head effective rank of q slices (no --compare given)"
    report.plot_heatmap(heat, os.path.join(args.out, "head_importance.png"), title=title,
                        xlabel="query head", ylabel="layer")

    ids = _encode(tokenizer, report.PASSAGE, args.max_tokens)
    cka = report.key_cka(model, np.asarray(ids))
    results["key_cka"] = {"matrix": cka, "tokens": len(ids), "estimator": "unbiased linear CKA",
                          "adjacent_mean": float(np.mean(np.diag(cka, 1))) if len(cka) > 1
                          else None}
    report.plot_heatmap(cka, os.path.join(args.out, "key_cka.png"),
                        title=f"linear CKA of cached keys across layers ({len(ids)} tokens)",
                        xlabel="layer", ylabel="layer", vmin=0.0, vmax=1.0)
    report.plot_spectra(results["spectra"], os.path.join(args.out, "spectra.png"))
    table = report.per_layer_table(results, "effective_rank")
    results["effective_rank_by_layer"] = table
    if table:
        report.plot_by_layer(table, os.path.join(args.out, "effective_rank_by_layer.png"))
    results["meta"] = {"model": args.model, "compare": args.compare, "layers": args.layers,
                       "n_matrices": len(results["matrices"]), "seconds": time.time() - start,
                       "jax_backend": jax.default_backend()}
    report.write_json(results, os.path.join(args.out, "report.json"))
    u = results["unembedding"]
    print(f"analysed {len(results['matrices'])} matrices of {args.model} in "
          f"{time.time() - start:.1f}s")
    print(f"unembedding {u['shape']}: effective rank {u['effective_rank']:.1f}, stable rank "
          f"{u['stable_rank']:.2f}, anisotropy {u['anisotropy']:.3f}")
    print(f"key CKA, adjacent layers (mean): {results['key_cka']['adjacent_mean']}")
    print(f"report: {os.path.join(args.out, 'report.json')} (+ PNGs)")
    return 0
