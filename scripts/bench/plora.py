"""PLoRA on CPU: K packed LoRA jobs in one step vs the same jobs one after another; planner sim.

Measured in one run on the tiny byte-level Llama (2 layers, d=128, 4 heads, vocab 256, S=64):

* sequential: for each job, a fresh model with a ``LoRALinear`` (``apply_lora``) on all
  attention and MLP projections, its own jitted AdamW step; steps/s after a warm-up step.
* packed: one model with ``MultiLoRALinear`` (K adapters, ranks padded) on the same projections,
  one jitted step over the concatenated batch, loss = sum of per-job means, per-job AdamW.

Throughput = trained tokens per second (all jobs) excluding compilation. Then the planner is
simulated on a 48-job sweep over 8 devices (H100-like roofline cost model, DERIVED; 3/4 of
the jobs on SmolLM2-135M, 1/4 on a 1B Llama).

Usage::

    python -m scripts.bench.plora --quick          # K=8, batch 2, 4 timed steps
    python -m scripts.bench.plora --out runs/bench_plora
    python -m scripts.bench.plora --model smollm2 --batches 1 --seq-len 32 --steps 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from lowrank_jax.bench import time_once
from lowrank_jax.core.step import make_step
from lowrank_jax.data import batch_at, corpus_bytes
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
from lowrank_jax.nn.multi_lora import apply_multi_lora, multi_lora_layers
from lowrank_jax.train.jobs import make_packed_step
from lowrank_jax.train.losses import adapter_loss
from lowrank_jax.train.multi_job import (
    CostModel,
    JobSpec,
    ModelSpec,
    compare_plans,
    per_job_adamw,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (4, 8, 16, 4, 8, 16, 4, 8)
LRS = (1e-3, 3e-3) * 4
WEIGHT_DECAY = 1e-4  # optax.adamw's default, used by both paths


_LOADED: dict = {}


def _base(seq_len: int, model: str = "tiny") -> Llama:
    if model == "smollm2":  # real weights, loaded once; every run gets its own copy
        if "smollm2" not in _LOADED:
            from lowrank_jax.hub import load_model

            _LOADED["smollm2"] = load_model("smollm2")[0]
        return nnx.clone(_LOADED["smollm2"])
    cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                      d_ff=512, max_seq_len=seq_len)
    return Llama(cfg, rngs=nnx.Rngs(0))


def _time_steps(step, state, batches) -> tuple[float, object, list]:
    state, loss = step(*state, *batches[0])  # warm-up / compile
    jax.block_until_ready(loss)

    def run(state):
        losses = []
        for batch in batches[1:]:
            state, loss = step(*state, *batch)
            losses.append(loss)
        return state, losses

    seconds, (state, losses) = time_once(run, state)  # the package's one timer
    return seconds, state, [np.asarray(x) for x in losses]


def run_sequential(tokens, k_jobs, batch, seq_len, steps, bar, model_name="tiny"):
    seconds, losses, inits = 0.0, [], []
    for k in range(k_jobs):
        model = _base(seq_len, model_name)
        apply_lora(model, LoRARule(pattern="|".join(TARGETS), rank=RANKS[k],
                                   alpha=2.0 * RANKS[k]), rngs=nnx.Rngs(k + 1))
        inits.append({path: (layer.lora_a[...], layer.lora_b[...])
                      for path, layer in lora_layers(model)})
        graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        tx = optax.adamw(LRS[k], weight_decay=WEIGHT_DECAY)
        update = make_step(adapter_loss(graph), tx)
        step = lambda lora, opt, window, update=update, rest=rest: (  # noqa: E731
            lambda new, opt, loss: ((new, opt), loss))(*update(lora, opt, rest, window))
        batches = [(jnp.asarray(np.concatenate([x, y[:, -1:]], 1)),)  # [batch, seq_len + 1]
                   for x, y in (batch_at(tokens, t, batch, seq_len, seed=k)
                                for t in range(steps + 1))]
        dt, _, job_losses = _time_steps(step, (lora, tx.init(lora)), batches)
        seconds += dt
        losses.append([float(x) for x in job_losses])
        bar.update(1)
    return seconds, losses, inits


def run_packed(tokens, k_jobs, batch, seq_len, steps, inits, implementation="ragged",
               model_name="tiny"):
    model = _base(seq_len, model_name)
    ranks = RANKS[:k_jobs]
    apply_multi_lora(model, ranks=ranks, alphas=[2.0 * r for r in ranks], targets=TARGETS,
                     rngs=nnx.Rngs(1), implementation=implementation)
    for path, layer in multi_lora_layers(model):  # same init as the sequential runs
        for k in range(k_jobs):
            layer.set_adapter(k, *inits[k][path])
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = per_job_adamw(LRS[:k_jobs], weight_decays=[WEIGHT_DECAY] * k_jobs)
    ids = jnp.repeat(jnp.arange(k_jobs), batch)

    packed = make_packed_step(graph, rest, ids, tx, k_jobs)  # the library's packed step

    def step(lora, opt, x, y):
        lora, opt, per_job = packed(lora, opt, x, y)
        return (lora, opt), per_job

    def packed_batch(t):
        parts = [batch_at(tokens, t, batch, seq_len, seed=k) for k in range(k_jobs)]
        return tuple(jnp.asarray(np.concatenate([p[i] for p in parts])) for i in (0, 1))

    batches = [packed_batch(t) for t in range(steps + 1)]
    dt, _, losses = _time_steps(step, (lora, tx.init(lora)), batches)
    return dt, [[float(x[k]) for x in losses] for k in range(k_jobs)]


def planner_sim(num_jobs: int = 48, devices: int = 8) -> dict:
    models = {
        "smollm2-135m": ModelSpec("smollm2-135m", params=1.35e8, layers=30,
                                  lora_dims=4 * 1152 + 2 * (576 + 1536) + 576 + 1536 - 576,
                                  act_bytes_per_token=3e5),
        "llama-1b": ModelSpec("llama-1b", params=1.24e9, layers=16,
                              lora_dims=2 * 4096 + 2 * (2048 + 512) + 3 * (2048 + 8192),
                              act_bytes_per_token=1.5e6),
    }
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(num_jobs):
        model = "llama-1b" if i % 4 == 3 else "smollm2-135m"
        jobs.append(JobSpec(f"job{i}", model, rank=int(rng.choice([8, 16, 32, 64, 128])),
                            batch=int(rng.choice([1, 2, 4])), seq_len=512,
                            steps=int(rng.integers(200, 1000))))
    return compare_plans(jobs, models, CostModel(memory_bytes=80e9), devices)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_plora")
    parser.add_argument("--quick", action="store_true", help="batch 2 only, 4 timed steps")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="smollm2: the real 135M model (byte ids as tokens; slow on CPU)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="*", default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 20)
    batches = args.batches or ([2] if args.quick else [1, 2, 8])
    tokens = corpus_bytes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    bar = tqdm(total=len(batches) * (args.jobs + 2), desc="bench_plora")
    for batch in batches:
        seq_s, seq_losses, inits = run_sequential(tokens, args.jobs, batch, args.seq_len, steps,
                                                  bar, args.model)
        n_tok = args.jobs * batch * args.seq_len * steps
        row = {"batch_per_job": batch, "jobs": args.jobs, "steps": steps,
               "sequential_s": seq_s, "sequential_tok_s": n_tok / seq_s}
        for impl in ("ragged", "gather"):
            pk_s, pk_losses = run_packed(tokens, args.jobs, batch, args.seq_len, steps, inits,
                                         implementation=impl, model_name=args.model)
            bar.update(1)
            gap = max(abs(a - b) for s, p in zip(seq_losses, pk_losses) for a, b in zip(s, p))
            row.update({f"packed_{impl}_s": pk_s, f"packed_{impl}_tok_s": n_tok / pk_s,
                        f"speedup_{impl}": seq_s / pk_s, f"max_loss_gap_{impl}": gap})
        rows.append(row)
    bar.close()
    plans = planner_sim()
    label = "SmolLM2-135M" if args.model == "smollm2" else "tiny Llama (2x128)"
    print(f"\nK={args.jobs} jobs, {label}, S={args.seq_len}, {steps} timed steps/job, "
          f"backend {jax.default_backend()}")
    print(f"{'batch/job':>9} {'sequential tok/s':>17} {'packed ragged':>14} {'speedup':>8} "
          f"{'packed gather':>14} {'speedup':>8} {'max |Δloss|':>12}")
    for r in rows:
        gap = max(r["max_loss_gap_ragged"], r["max_loss_gap_gather"])
        print(f"{r['batch_per_job']:>9} {r['sequential_tok_s']:>17.0f} "
              f"{r['packed_ragged_tok_s']:>14.0f} {r['speedup_ragged']:>8.2f} "
              f"{r['packed_gather_tok_s']:>14.0f} {r['speedup_gather']:>8.2f} {gap:>12.2e}")
    print("\nPlanner (48 jobs, 8 devices, roofline cost model):")
    for name in ("plora", "one_per_device", "greedy_fill"):
        print(f"  {name:15s} makespan {plans[name]['makespan'] / 3600:8.3f} h  "
              f"packs {len(plans[name]['packs'])}")
    print(f"  lower bound     {plans['lower_bound'] / 3600:8.3f} h;  speedup vs one-per-device "
          f"{plans['speedup_vs_one_per_device']:.2f}x, vs greedy {plans['speedup_vs_greedy']:.2f}x")
    result = {"rows": rows, "planner": plans, "backend": jax.default_backend(), "model": args.model,
              "devices": len(jax.devices()), "seq_len": args.seq_len}
    (out / "bench_plora.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for impl in ("ragged", "gather"):
            ax.plot([r["batch_per_job"] for r in rows], [r[f"speedup_{impl}"] for r in rows],
                    "o-", label=f"packed ({impl})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend()
        ax.set_xlabel("per-job batch (sequences)")
        ax.set_ylabel("packed / sequential throughput")
        ax.set_xscale("log", base=2)
        ax.set_title(f"PLoRA packing, K={args.jobs}, CPU")
        fig.tight_layout()
        fig.savefig(out / "bench_plora.png", dpi=120)
    except ImportError as err:
        print(f"no plot ({err}); pip install matplotlib")
    print(f"wrote {out / 'bench_plora.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
