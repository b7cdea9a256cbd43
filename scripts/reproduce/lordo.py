"""Reproduce LoRDO's claim at CPU scale: near-parity with low-rank DDP at far less communication.

Eight workers on eight simulated CPU devices (one worker per device, the worker axis sharded over
the mesh's ``data`` axis) train the same tiny byte-level Llama on the embedded corpus:

* **DDP AdamW** — reference: gradients all-reduced every step, full-rank Adam;
* **low-rank DDP** — gradients all-reduced every step, LDAdam-style low-rank Adam (``ω = 1``,
  projection refreshed from the gradient every 16 steps);
* **LoRDO K=4 / K=16** — ``K`` local steps of :func:`lowrank_jax.optim.lordo` per worker, then
  :func:`lowrank_jax.optim.lordo_sync` under ``shard_map`` (one all-reduce of displacements,
  new global projection, moment transport);
* **LoRDO K=16, ω=1** — the same without the full-rank term (subspace stagnation).

Every arm sees the same batches (worker ``m`` at step ``t`` reads batch ``(seed, t·M + m)``) and
the same number of steps. The table reports the final validation loss of the anchor (global)
model, the floats each worker sent (counted from what enters the collectives), and for LoRDO the
largest principal-angle sine between consecutive global subspaces.

Usage::

    python scripts/reproduce/lordo.py            # ~5 min on 2 shared CPU cores
    python scripts/reproduce/lordo.py --quick    # ~1 min smoke run

Writes ``<out>/results.json`` (default ``runs/reproduce_lordo``).

Processes: the script feeds its 8 workers from one process. ``lordo_sync`` itself runs
unchanged across processes (a global mesh, see :mod:`lowrank_jax.optim.lordo_distributed`);
under a multi-process launcher each process would build only its own workers' batches with
``jax.make_array_from_process_local_data`` instead of ``jax.device_put``.

References:
    Jovanović et al., `LoRDO: Distributed Low-Rank Optimization with Infrequent Communication
    <https://arxiv.org/abs/2602.04396>`_, ICML 2026.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType

from lowrank_jax.data import batch_at, corpus_bytes, train_val_split
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.train.loop import evaluate, lm_loss, make_eval_fn
from lowrank_jax.optim import (
    communication_per_sync,
    lordo,
    outer_average,
    outer_nesterov,
    simulate_ddp,
    simulate_lordo,
)

jax.config.update("jax_num_cpu_devices", 8)  # before any device is touched

WORKERS = 8
ARMS = ("ddp", "lowrank-ddp", "k4", "k16", "k16-omega1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_lordo")
    p.add_argument("--quick", action="store_true", help="smoke run (~1 minute)")
    p.add_argument("--steps", type=int, default=None, help="local steps per worker")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--omega", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=4, help="local batch per worker")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outer", default="average", choices=("average", "nesterov"),
                   help="outer step on the averaged displacement: plain averaging, or DiLoCo's "
                        "Nesterov SGD on the pseudo-gradient (--outer-lr, --outer-momentum)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated subset of {','.join(ARMS)} (the first two are the "
                        "baselines the ratios refer to)")
    p.add_argument("--devices", type=int, default=8, choices=(1, 8),
                   help="8: one worker per simulated device, sync under shard_map (the real "
                        "layout); 1: the 8 workers vmapped on one device, same math (faster "
                        "on an oversubscribed CPU: no cross-device collectives)")
    return p.parse_args(argv)


def model_config(quick: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, d_model=64, n_layers=1 if quick else 2, n_heads=4,
                       n_kv_heads=4, d_ff=128, max_seq_len=64)


def worker_batches(tokens, step, args):
    xs, ys = zip(*(batch_at(tokens, step * WORKERS + m, args.batch, args.seq, args.seed)
                   for m in range(WORKERS)))
    return jnp.asarray(np.stack(xs)), jnp.asarray(np.stack(ys))


def main(argv=None):
    args = parse_args(argv)
    steps = args.steps or (48 if args.quick else 320)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if len(jax.devices()) < WORKERS:
        raise SystemExit(f"need {WORKERS} devices, found {len(jax.devices())}; run on a CPU host "
                         "(JAX_PLATFORMS=cpu) so that 8 devices are simulated.")
    mesh = None
    if args.devices == WORKERS:
        mesh = jax.make_mesh((WORKERS,), ("data",), axis_types=(AxisType.Explicit,),
                             devices=jax.devices()[:WORKERS])
    train_tokens, val_tokens = train_val_split(corpus_bytes(), 0.1)
    cfg = model_config(args.quick)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(args.seed)), nnx.Param)
    params = jax.tree.map(jnp.asarray, params)
    loss_fn, eval_fn = lm_loss(graphdef), make_eval_fn(graphdef)
    n_params = communication_per_sync(params)
    common = {"rank": args.rank, "clip_norm": 1.0}
    workers = {**common, "first_projection": "set"}  # Q_0 from set_projection (global SVD)
    arms = {
        "ddp": ("DDP AdamW", "ddp",
                optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr)), None),
        "lowrank-ddp": ("low-rank DDP", "ddp", lordo(args.lr, omega=1.0, refresh_every=16,
                                                     refresh_from="gradient", **common), None),
        "k4": ("LoRDO K=4", "lordo", lordo(args.lr, omega=args.omega, **workers), 4),
        "k16": ("LoRDO K=16", "lordo", lordo(args.lr, omega=args.omega, **workers), 16),
        "k16-omega1": ("LoRDO K=16, no full-rank term", "lordo",
                       lordo(args.lr, omega=1.0, **workers), 16),
    }
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown or not chosen:
        raise SystemExit(f"--arms {args.arms!r}: unknown {unknown}; choose from {list(ARMS)}.")
    outer = (outer_nesterov(args.outer_lr, args.outer_momentum) if args.outer == "nesterov"
             else outer_average())
    rows = []
    for name, kind, tx, period in (arms[a] for a in chosen):
        t0 = time.perf_counter()
        batches = lambda t: worker_batches(train_tokens, t, args)  # noqa: E731
        if kind == "ddp":
            final, info = simulate_ddp(tx, params, loss_fn, batches, steps=steps)
        else:
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                final, info = simulate_lordo(tx, params, loss_fn, batches, steps=steps,
                                             period=period, outer=outer, workers=WORKERS,
                                             mesh=mesh)
        # plain host copies: the anchor's arrays keep the mesh's explicit axis types otherwise
        final = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), final)
        val = evaluate(eval_fn, final, val_tokens, 16, args.seq, max_batches=8)
        rows.append({"arm": name, "val_loss": val, **info,
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name:32s} val {val:.4f}  floats/worker {info['floats_per_worker']:,}", flush=True)
    base = next((r for r in rows if r["arm"] == "low-rank DDP"), rows[0])["floats_per_worker"]
    print(f"\n{WORKERS} workers on {args.devices} device(s) x {steps} local steps, "
          f"local batch {args.batch}x{args.seq} bytes, "
          f"rank {args.rank}, omega {args.omega}, outer {args.outer}, "
          f"|theta| = {n_params:,}")
    print("| arm | val loss (nats/byte) | floats sent per worker | vs low-rank DDP | "
          "max sin(angle) Q_old→Q_new, last sync |")
    print("|---|---|---|---|---|")
    for r in rows:
        angle = r.get("max_subspace_sine_last_sync")
        angle = "—" if angle is None else f"{angle:.2e}"
        print(f"| {r['arm']} | {r['val_loss']:.4f} | {r['floats_per_worker']:,} | "
              f"{base / r['floats_per_worker']:.1f}x less | {angle} |")
    summary = {"args": vars(args), "steps": steps, "workers": WORKERS, "n_params": n_params,
               "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff},
               "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
