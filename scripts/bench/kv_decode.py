"""Decode speed from every KV-cache method vs the exact cache, at equal context, in one run.

Model: SmolLM2-135M's layer shapes (d 576, 9 query / 3 KV heads, head dim 64, d_ff 1536) with
random weights, ``--layers`` layers and a ``--vocab`` LM head (decode cost per layer is the real
model's; fewer layers and a small vocabulary keep compile times short on a CPU). For each
context length: prefill a random prompt, then time ``--steps`` greedy decode steps (after
``--warmup`` compiled ones) with the exact :class:`~lowrank_jax.models.llama.KVCache` and with
each method at each ratio; xKV also with selective reconstruction (xKV-SR, ``--sr-budget``
tokens rebuilt per KV head and step). Every configuration is compiled first, then timed in
``--rounds`` interleaved rounds (each configuration once per round; best round counts), so a
load change on a shared machine hits all of them alike. Reports tokens/s, the ratio to the
exact cache (same context, same run) and the prompt-cache bytes (exact fp16 / stored).

Usage::

    python -m scripts.bench.kv_decode [--contexts 1024 4096] [--ratios 4 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax import kv
from lowrank_jax.bench import decode_rates
from lowrank_jax.models.llama import KVCache, Llama, LlamaConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--methods", nargs="+",
                        default=[m for m in kv.KV_METHODS if m != "none"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds (best round per method counts)")
    parser.add_argument("--sr-budget", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="context 256, 2 layers, 3 steps")
    parser.add_argument("--out", default="runs/bench_kv_decode")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.layers, args.steps, args.warmup = [256], 2, 3, 1
        args.sr_budget, args.rounds = 64, 2
    os.makedirs(args.out, exist_ok=True)
    cfg = LlamaConfig(vocab_size=args.vocab, d_model=576, n_layers=args.layers, n_heads=9,
                      n_kv_heads=3, d_ff=1536, rope_theta=1e5,
                      max_seq_len=max(args.contexts) + 64)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    capacity = 1 + args.steps
    rows = []
    print("| context | method | target | actual bytes ratio | tokens/s | vs exact |")
    print("|---|---|---|---|---|---|")
    for context in args.contexts:
        prompt = jnp.asarray(np.random.default_rng(context).integers(0, args.vocab,
                                                                     (1, context)), jnp.int32)
        token = prompt[:, -1]
        _, exact = model(prompt[:, :-1], cache=KVCache.empty(cfg, 1, context + capacity))
        keys, values = kv.prefill_kv(model, prompt[:, :-1])
        configs = [("exact", None, {})]
        for ratio in args.ratios:
            for method in args.methods:
                configs.append((method, ratio, {}))
            configs.append(("xkv-SR", ratio, dict(selective=kv.SelectiveConfig(
                budget=args.sr_budget), sink_tokens=0)))
        timed, decoders = [], {}  # rows to time, and their (step, state) by index
        for method, ratio, extra in configs:
            try:
                if method == "exact":
                    state, step = exact, (lambda c, t: kv.cache_step(model, c, t))
                    actual = 1.0
                else:
                    state, step = kv.start_kv_decode(
                        model, keys, values, method="xkv" if method == "xkv-SR" else method,
                        ratio=ratio, max_new_tokens=capacity, **extra)
                    actual = kv.cache_ratio(state.cache if isinstance(
                        state, kv.ReconstructDecodeKV) else state)
            except ValueError as err:
                rows.append(dict(context=context, method=method, ratio=ratio,
                                 unreachable=str(err)))
                continue
            timed.append(dict(context=context, method=method, ratio=ratio, bytes_ratio=actual))
            decoders[len(timed) - 1] = (step, state)
        rates = decode_rates(decoders, token, steps=args.steps, warmup=args.warmup,
                             rounds=args.rounds)
        for row, rounds in zip(timed, rates.values()):
            row.update(rounds=rounds, tokens_per_s=max(rounds),
                       vs_exact=max(rounds) / max(rates[0]))
        rows += timed
        for row in [r for r in rows if r["context"] == context]:
            target = "–" if row["ratio"] is None else f"{row['ratio']:g}×"
            if "unreachable" in row:
                print(f"| {context} | {row['method']} | {target} | unreachable | – | – |")
                continue
            print(f"| {context} | {row['method']} | {target} | {row['bytes_ratio']:.2f}× | "
                  f"{row['tokens_per_s']:.1f} | {row['vs_exact']:.2f} |", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(rows=rows, layers=args.layers, vocab=args.vocab, steps=args.steps,
                       rounds=args.rounds,
                       backend=jax.default_backend()), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
