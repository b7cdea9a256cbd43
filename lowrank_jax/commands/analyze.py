"""``lowrank-jax analyze``: a spectral report of a model (and of its update from a base).

Writes to ``--out``: ``report.json`` (every metric per matrix and per layer, unembedding geometry,
head scores, key CKA) and PNGs: ``spectra.png``, ``effective_rank_by_layer.png``,
``head_importance.png``, ``key_cka.png``.
"""

from __future__ import annotations

import os
import time

from lowrank_jax.runs.validate import positive_int


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
    from lowrank_jax.hub import load_model

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
    from flax import nnx

    from lowrank_jax.analysis import checkpoint as ckpt
    from lowrank_jax.analysis import report
    from lowrank_jax.analysis.model_report import model_report
    from lowrank_jax.runs import prepare_output
    from lowrank_jax.runs.validate import check_regex

    check_regex(args.layers, "--layers")
    prepare_output(args.out, command="analyze", overwrite=args.overwrite,
                   reads={"--model": args.model, "--compare": args.compare})
    start = time.time()
    model, tokenizer = _load(args.model)
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

    ids = _encode(tokenizer, report.PASSAGE, args.max_tokens)
    results = model_report(model, params, ids, out=args.out, base=base,
                           layer_filter=args.layers, top_k=args.top_k)
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
