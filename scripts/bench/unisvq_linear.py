"""Throughput of the UniSVQ linear layer vs the dense layer and the k-means VQ (gather) layer, CPU.

All paths are jitted XLA on the host (the Pallas kernel needs a device; on CPU it only runs in
interpret mode, which is a correctness tool, not a speed one). For each weight shape and token
count, one run times every path after compilation, **interleaved**: each repeat calls every path
once, in a rotating order, so a burst of load from other processes hits all paths alike; the
table gives the median over ``--repeats`` and the spread of the dense path (max/min of the
middle half):

* dense fp32 ``x @ Wᵀ`` and dense bf16;
* UniSVQ ``lattice_matmul`` in ``fold`` mode (``Aᵀ`` onto the activations, 4 digit planes ×
  activations, rank-1 correction) and ``dequant`` mode (decode ``A z + b``, float GEMM), and
  the 3-bit lattice (``uint16`` codes) in ``fold`` mode;
* k-means VQ: ``codebook[codes]`` gather, then the float GEMM (``VQLinear``).

Ratios are against dense fp32 in the same run.

Usage::

    python -m scripts.bench.unisvq_linear                    # SmolLM2 shapes, T = 1, 16, 256
    python -m scripts.bench.unisvq_linear --shapes 4096x4096 --tokens 1 16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.bench import interleaved_samples
from lowrank_jax.quant.kmeans_vq import kmeans_vq_weight
from lowrank_jax.quant.layers import QuantizedLinear, VQLinear
from lowrank_jax.quant.unisvq import UniSVQConfig, dequantize, quantize_linear


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["576x576", "1536x576", "576x1536"],
                        help="out x in")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print("| W [out×in] | tokens | dense fp32 µs (spread) | dense bf16 | UniSVQ-2 fold "
          "| UniSVQ-2 dequant | UniSVQ-3 fold | k-means VQ gather | fold / VQ |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        m, n = (int(v) for v in shape.lower().split("x"))
        w = jax.random.normal(jax.random.PRNGKey(0), (m, n)) / n**0.5
        cfg = UniSVQConfig(tune_iters=0)
        q = quantize_linear(w, None, cfg)
        fold = QuantizedLinear(q, mode="fold", implementation="xla")
        deq = QuantizedLinear(q, mode="dequant", implementation="xla")
        fold3 = QuantizedLinear(quantize_linear(w, None, UniSVQConfig(tune_iters=0, bits=3)),
                                mode="fold", implementation="xla")
        vq = VQLinear(kmeans_vq_weight(w, None, cfg, iters=2))
        dense = dequantize(q)
        for t in args.tokens:
            x = jax.random.normal(jax.random.PRNGKey(t), (t, n))
            paths = {
                "dense": (jax.jit(lambda x, w: x @ w.T), x, dense),
                "bf16": (jax.jit(lambda x, w: x @ w.T), x.astype(jnp.bfloat16),
                         dense.astype(jnp.bfloat16)),
                "fold": (jax.jit(lambda x: fold(x)), x),
                "dequant": (jax.jit(lambda x: deq(x)), x),
                "fold3": (jax.jit(lambda x: fold3(x)), x),
                "vq": (jax.jit(lambda x: vq(x)), x),
            }
            times = {k: np.asarray(v) for k, v in interleaved_samples(
                {k: (lambda fn=fn, a=a: fn(*a)) for k, (fn, *a) in paths.items()},
                reps=args.repeats, rotate=True).items()}
            us = {k: 1e6 * float(np.median(v)) for k, v in times.items()}
            q1, q3 = np.percentile(times["dense"], [25, 75])
            base = us["dense"]
            print(f"| {m}×{n} | {t} | {base:.0f} ({q3 / q1:.2f}) | {us['bf16'] / base:.2f}× | "
                  f"{us['fold'] / base:.2f}× | {us['dequant'] / base:.2f}× | "
                  f"{us['fold3'] / base:.2f}× | {us['vq'] / base:.2f}× | "
                  f"{us['fold'] / us['vq']:.2f} |", flush=True)
    print("(medians of interleaved repeats; columns after 'dense fp32' are times relative to "
          "dense fp32, < 1 is faster; spread = 75th / 25th percentile of the dense times)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
