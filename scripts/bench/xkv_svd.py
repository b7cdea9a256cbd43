"""Prefill compression cost of xKV: exact vs randomized SVD on SmolLM2, measured in one run.

For each prompt length, prefill SmolLM2 exactly, then compress its KV cache (ratio 8, G = 4, one
exact sink token) with ``svd_method="full"`` and ``"randomized"``; report the best of 3 timings
after compilation, the speed-up, and the relative K / V reconstruction errors of both.

Usage::

    python -m scripts.bench.xkv_svd [--lengths 1024 2048] [--ratio 8]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.kv import xkv  # noqa: E402
from lowrank_jax.data import corpus_windows  # noqa: E402
from scripts._shared import load_model_and_codec  # noqa: E402


def _relative_error(cache, keys, values, kind: str) -> float:
    src = keys if kind == "k" else values
    return float(np.mean([jnp.linalg.norm(xkv.xkv_reconstruct(cache, l, kind) - src[l])
                          / jnp.linalg.norm(src[l]) for l in range(src.shape[0])]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model, encode, _ = load_model_and_codec(args.model)
    print("| prompt | exact SVD | randomized | speed-up | rel. K err exact / randomized | "
          "rel. V err exact / randomized |\n|---|---|---|---|---|---|")
    for length in args.lengths:
        ids = corpus_windows(encode, 1, length)[0]
        keys, values = xkv.prefill_kv(model, jnp.asarray(ids[None]))
        rows = {}
        for method in ("full", "randomized"):
            def compress():
                return jax.block_until_ready(xkv.xkv_compress(
                    keys, values, rope_theta=model.cfg.rope_theta, ratio=args.ratio,
                    sink_tokens=1, svd_method=method))

            cache = compress()  # compile
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                compress()
                times.append(time.perf_counter() - start)
            rows[method] = (min(times), _relative_error(cache, keys, values, "k"),
                            _relative_error(cache, keys, values, "v"))
        (tf, kf, vf), (tr, kr, vr) = rows["full"], rows["randomized"]
        print(f"| {length} tokens | {tf:.2f} s | {tr:.2f} s | {tf / tr:.1f}× | {kf:.4f} / {kr:.4f} "
              f"| {vf:.4f} / {vr:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
