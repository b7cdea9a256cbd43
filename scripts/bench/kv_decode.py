"""Decode speed from every KV-cache method vs the exact cache, at equal context, in one run.

Model: SmolLM2-135M's layer shapes (d 576, 9 query / 3 KV heads, head dim 64, d_ff 1536) with
random weights, ``--layers`` layers and a ``--vocab`` LM head (decode cost per layer is the real
model's; fewer layers and a small vocabulary keep compile times short on a CPU). For each
context length: prefill a random prompt, then time ``--steps`` greedy decode steps (after
``--warmup`` compiled ones) with the exact :class:`~lowrank_jax.models.llama.KVCache` and with
each method at each ratio; xKV also with selective reconstruction (xKV-SR, ``--sr-budget``
tokens rebuilt per KV head and step). Reports tokens/s, the ratio to the exact cache and the
prompt-cache bytes (exact fp16 / stored).

Usage::

    python -m scripts.bench.kv_decode [--contexts 1024 4096] [--ratios 4 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax import kv
from lowrank_jax.models.llama import KVCache, Llama, LlamaConfig


@nnx.jit
def _exact_step(model, cache, token):
    logits, cache = model(token[:, None], cache=cache)
    return logits[:, 0], cache


def _time(step, state, token, warmup: int, steps: int, rounds: int = 2) -> float:
    """Best-of-``rounds`` tokens/s over ``steps`` decode steps from the same starting cache
    (after ``warmup`` steps that compile; the machine is shared, so the best round counts)."""
    logits, first = step(state, token)
    for _ in range(warmup - 1):
        logits, _ = step(first, token)
    jax.block_until_ready(logits)
    best = 0.0
    for _ in range(rounds):
        current = first
        start = time.perf_counter()
        for _ in range(steps):
            logits, current = step(current, token)
        jax.block_until_ready(logits)
        best = max(best, steps / (time.perf_counter() - start))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--methods", nargs="+",
                        default=[m for m in kv.METHODS if m != "none"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sr-budget", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="context 256, 2 layers, 3 steps")
    parser.add_argument("--out", default="runs/bench_kv_decode")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.layers, args.steps, args.warmup = [256], 2, 3, 1
        args.sr_budget = 64
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
        exact_tps = _time(lambda c, t: _exact_step(model, c, t), exact, token, args.warmup,
                          args.steps)
        rows.append(dict(context=context, method="exact", ratio=1.0, tokens_per_s=exact_tps,
                         vs_exact=1.0))
        print(f"| {context} | exact | – | 1.00× | {exact_tps:.1f} | 1.00 |", flush=True)
        keys, values = kv.prefill_kv(model, prompt[:, :-1])
        theta = cfg.rope_theta
        configs = []
        for ratio in args.ratios:
            for method in args.methods:
                configs.append((method, ratio, {}))
            configs.append(("xkv-SR", ratio, dict(selective=kv.SelectiveConfig(
                budget=args.sr_budget), sink_tokens=0)))
        for method, ratio, extra in configs:
            try:
                if method.startswith("xkv-SR") or method in ("xkv", "per_layer_svd"):
                    name = "xkv" if method == "xkv-SR" else method
                    cache = kv.compress_kv(name, keys, values, rope_theta=theta, ratio=ratio,
                                           tail_capacity=capacity, **extra)
                    state, step = cache, (lambda c, t: kv.xkv_decode_step(model, c, t))
                    stored = kv.stored_bytes(cache)
                else:
                    cache = kv.compress_kv(method, keys, values, rope_theta=theta, ratio=ratio)
                    stored = kv.stored_bytes(cache)
                    state = kv.start_decode(method, cache, max_new_tokens=capacity)
                    step = lambda c, t: kv.decode_step(model, c, t)  # noqa: E731
            except ValueError as err:
                print(f"| {context} | {method} | {ratio:g}× | unreachable | – | – |")
                rows.append(dict(context=context, method=method, ratio=ratio,
                                 unreachable=str(err)))
                continue
            actual = kv.reference_bytes(cache) / stored
            tps = _time(step, state, token, args.warmup, args.steps)
            rows.append(dict(context=context, method=method, ratio=ratio, bytes_ratio=actual,
                             tokens_per_s=tps, vs_exact=tps / exact_tps))
            print(f"| {context} | {method} | {ratio:g}× | {actual:.2f}× | {tps:.1f} | "
                  f"{tps / exact_tps:.2f} |", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(rows=rows, layers=args.layers, vocab=args.vocab, steps=args.steps,
                       backend=jax.default_backend()), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
