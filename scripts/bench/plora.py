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
import functools
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.bench.packed import RANKS, packed_lora_jobs, sequential_lora_jobs
from lowrank_jax.data import corpus_bytes
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.train.multi_job import CostModel, JobSpec, ModelSpec, compare_plans

LRS = (1e-3, 3e-3) * 4


@functools.cache
def smollm2() -> Llama:
    from lowrank_jax.hub import load_model

    return load_model("smollm2")[0]


def base_model(seq_len: int, model: str = "tiny") -> Llama:
    if model == "smollm2":  # real weights, loaded once; every run gets its own copy
        return nnx.clone(smollm2())
    cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                      d_ff=512, max_seq_len=seq_len)
    return Llama(cfg, rngs=nnx.Rngs(0))


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
    jobs = dict(ranks=RANKS[:args.jobs], lrs=LRS[:args.jobs], seq_len=args.seq_len, steps=steps)
    base_fn = lambda: base_model(args.seq_len, args.model)  # noqa: E731
    for batch in batches:
        seq_s, seq_losses, inits = sequential_lora_jobs(base_fn, tokens, batch=batch, **jobs,
                                                        on_job=lambda k: bar.update(1))
        n_tok = args.jobs * batch * args.seq_len * steps
        row = {"batch_per_job": batch, "jobs": args.jobs, "steps": steps,
               "sequential_s": seq_s, "sequential_tok_s": n_tok / seq_s}
        for impl in ("ragged", "gather"):
            pk_s, pk_losses = packed_lora_jobs(base_fn, tokens, batch=batch, **jobs, inits=inits,
                                               implementation=impl)
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
    plot_panels([{"curves": [{"x": [r["batch_per_job"] for r in rows],
                              "y": [r[f"speedup_{impl}"] for r in rows], "style": "o-",
                              "label": f"packed ({impl})"} for impl in ("ragged", "gather")],
                  "hlines": [(1.0, None, "-")], "xlabel": "per-job batch (sequences)",
                  "ylabel": "packed / sequential throughput", "xscale": "log2",
                  "title": f"PLoRA packing, K={args.jobs}, CPU", "legend_fontsize": 10}],
                out / "bench_plora.png", figsize=(5, 3.5))
    print(f"wrote {out / 'bench_plora.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
