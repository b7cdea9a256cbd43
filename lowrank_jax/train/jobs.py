"""Several LoRA jobs trained at once on one frozen base (PLoRA packing): the application behind
``lowrank-jax jobs jobs.yaml`` (also ``lowrank-jax finetune --jobs jobs.yaml``).

``jobs.yaml``::

    model: tiny            # or smollm2, a .gguf file, an HF folder
    targets: [gate_proj, up_proj, down_proj]
    seq_len: 64
    steps: 50
    out: runs/jobs
    jobs:
      - {name: small, rank: 4, alpha: 8, lr: 1.0e-3, batch: 2}
      - {name: big, rank: 16, alpha: 32, lr: 3.0e-4, batch: 4, data: my_text.txt}

All jobs share one frozen base (``MultiLoRALinear``); the loss is the sum of per-job mean
losses; each job has its own AdamW learning rate, clipping and step counter
(:func:`lowrank_jax.train.multi_job.per_job_adamw`). Each job's adapter is exported in PEFT
format to ``out/<name>/adapter``.
"""

from __future__ import annotations

import json
import os

import numpy as np

JOB_KEYS = {"name", "rank", "alpha", "lr", "batch", "data", "clip", "weight_decay"}
TOP_KEYS = {"model", "targets", "seq_len", "steps", "out", "jobs", "seed"}


def load_jobs(path: str) -> dict:
    """Read and validate a jobs YAML (clear errors naming the job and the key)."""
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"jobs file {path}: not found; pass a YAML file of jobs.")
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    unknown = set(spec) - TOP_KEYS
    if unknown:
        raise ValueError(f"jobs file {path}: unknown keys {sorted(unknown)}; "
                         f"known: {sorted(TOP_KEYS)}.")
    jobs = spec.get("jobs") or []
    if not jobs:
        raise ValueError(f"jobs file {path}: no jobs listed under 'jobs:'; add at least one, "
                         "e.g. jobs: [{name: small, rank: 4}].")
    names = set()
    for i, job in enumerate(jobs):
        bad = set(job) - JOB_KEYS
        if bad:
            raise ValueError(f"jobs file {path}: job {i} has unknown keys {sorted(bad)}; known: "
                             f"{sorted(JOB_KEYS)}.")
        job.setdefault("name", f"job{i}")
        if job["name"] in names:
            raise ValueError(f"jobs file {path}: two jobs are named {job['name']!r}; "
                             "give each job its own name.")
        names.add(job["name"])
        for key in ("rank", "batch"):
            job.setdefault(key, 8 if key == "rank" else 2)
            if not isinstance(job[key], int) or job[key] < 1:
                raise ValueError(f"jobs file {path}: job {job['name']!r} {key}={job[key]!r} "
                                 "must be a positive integer.")
        job.setdefault("alpha", 2.0 * job["rank"])
        job.setdefault("lr", 1e-3)
        if not float(job["lr"]) > 0:
            raise ValueError(f"jobs file {path}: job {job['name']!r} lr={job['lr']} must be > 0.")
    return spec


def make_packed_step(graph, rest, ids, tx, k_jobs: int):
    """The jitted packed step ``(lora, opt, x, y) -> (lora, opt, per_job_losses)``.

    One forward over the concatenated batches of all jobs (``ids`` says which rows belong to
    which job), loss = sum of per-job mean next-token losses
    (:func:`~lowrank_jax.train.multi_job.packed_loss`), one update with ``tx``. The frozen base
    ``rest`` is a jit argument, not a closure: closed over, its arrays became compile-time
    constants that XLA constant-folds (minutes for SmolLM2's embedding on CPU).
    """
    import jax
    from flax import nnx

    from lowrank_jax.core.losses import token_nll
    from lowrank_jax.nn.multi_lora import set_adapter_ids
    from lowrank_jax.core.step import make_step
    from lowrank_jax.train.multi_job import packed_loss

    def loss_fn(lora, rest, x, y):  # fresh Variables in this trace: set_adapter_ids mutates them
        m = nnx.merge(graph, lora, jax.tree.map(lambda v: v, rest))
        set_adapter_ids(m, ids)
        logits, _ = m(x)
        return packed_loss(token_nll(logits, y).mean(-1), ids, k_jobs)

    jitted = make_step(loss_fn, tx, has_aux=True)

    def step(lora, opt, x, y):
        lora, opt, (_, per_job) = jitted(lora, opt, rest, x, y)
        return lora, opt, per_job

    return step


def run_jobs(spec: dict, *, model: str = "tiny", out: str = "runs/finetune",
             progress: bool = True, log=print) -> list[dict]:
    """Train the jobs of a validated ``spec`` (:func:`load_jobs`) and export their adapters.

    ``model`` / ``out`` are the defaults when the spec names none. Returns one summary dict per
    job (also written to ``out/jobs_summary.json``).
    """
    import jax.numpy as jnp
    from flax import nnx

    from lowrank_jax.core.loop import run_steps
    from lowrank_jax.data import batch_at
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.models.presets import PRESETS
    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers, remove_lora
    from lowrank_jax.nn.multi_lora import apply_multi_lora, multi_lora_layers
    from lowrank_jax.runs.outputs import atomic_write_text
    from lowrank_jax.train import multihost
    from lowrank_jax.train.finetune import load_model_and_tokens
    from lowrank_jax.train.multi_job import per_job_adamw

    jobs = spec["jobs"]
    k_jobs = len(jobs)
    targets = tuple(spec.get("targets") or ("q_proj", "v_proj"))
    seq_len, steps = int(spec.get("seq_len", 64)), int(spec.get("steps", 50))
    out = spec.get("out", out)
    model_name = spec.get("model", model)
    model, tokens, base_name, _ = load_model_and_tokens(model_name, None)
    job_tokens = []
    for job in jobs:
        if job.get("data"):
            if model_name not in PRESETS:
                raise ValueError(f"job {job['name']!r}: per-job 'data' files need a byte-level "
                                 "preset (model: tiny); with a real model leave 'data' out (the "
                                 "jobs train on the embedded corpus).")
            job_tokens.append(load_model_and_tokens(model_name, job["data"])[1])
        else:
            job_tokens.append(tokens)
        if len(job_tokens[-1]) < seq_len + 2:
            raise ValueError(f"job {job['name']!r}: its text has {len(job_tokens[-1])} tokens, "
                             f"fewer than seq_len + 2 = {seq_len + 2}; give more text or a smaller "
                             "seq_len.")
    ranks = [job["rank"] for job in jobs]
    n = apply_multi_lora(model, ranks=ranks, alphas=[float(j["alpha"]) for j in jobs],
                         targets=targets, rngs=nnx.Rngs(int(spec.get("seed", 0))))
    if n == 0:
        raise ValueError(f"targets {list(targets)} match no nnx.Linear layer of the model.")
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = per_job_adamw([float(j["lr"]) for j in jobs],
                       clip_norms=[float(j.get("clip", 1.0)) for j in jobs],
                       weight_decays=[float(j.get("weight_decay", 0.0)) for j in jobs])
    ids = jnp.repeat(jnp.arange(k_jobs), jnp.asarray([j["batch"] for j in jobs]),
                     total_repeat_length=sum(j["batch"] for j in jobs))

    step = make_packed_step(graph, rest, ids, tx, k_jobs)
    opt = tx.init(lora)
    history = []

    def batches(t):
        parts = [batch_at(job_tokens[k], t, jobs[k]["batch"], seq_len, seed=k)
                 for k in range(k_jobs)]
        return (jnp.asarray(np.concatenate([p[0] for p in parts])),
                jnp.asarray(np.concatenate([p[1] for p in parts])))

    def record(run):
        history.append([float(v) for v in run.value])

    what = f"finetune {k_jobs} jobs"
    lora = run_steps(step, lora, opt, batches, steps=steps, what=what, on_step=record,
                     hint="lower the jobs' lr.", progress=what if progress else None).params
    nnx.update(model, lora)
    summary = []
    for k, job in enumerate(jobs):
        first, last = history[0][k], float(np.mean([h[k] for h in history[-5:]]))
        summary.append({"name": job["name"], "rank": job["rank"], "first_loss": first,
                        "final_loss": last,
                        "adapter": os.path.join(out, job["name"], "adapter")})

    def export():  # one plain LoRA per job on the same base, then removed again (unmerged)
        multi = dict(multi_lora_layers(model))
        export_base = load_model_and_tokens(model_name, None)[0]
        os.makedirs(out, exist_ok=True)
        pattern = "(" + "|".join(targets) + ")$"
        for k, (job, row) in enumerate(zip(jobs, summary)):
            apply_lora(export_base, LoRARule(pattern, rank=job["rank"],
                                             alpha=float(job["alpha"])), rngs=nnx.Rngs(0))
            for path, layer in lora_layers(export_base):
                a, b = multi[path].adapter(k)
                layer.lora_a[...] = a
                layer.lora_b[...] = b
            export_peft(export_base, row["adapter"], base_model_name_or_path=base_name)
            remove_lora(export_base, merge=False)
            log(f"{job['name']}: rank {job['rank']}, loss {row['first_loss']:.4f} -> "
                f"{row['final_loss']:.4f}; PEFT adapter in {row['adapter']}")
        atomic_write_text(os.path.join(out, "jobs_summary.json"),
                          json.dumps({"jobs": summary, "history": history}, indent=1))

    # every process trained the same jobs; the files are written once, by process 0
    multihost.on_main_process(export, what="exporting the jobs' adapters")
    return summary


def run_jobs_file(path: str, *, model: str = "tiny", out: str = "runs/finetune",
                  overwrite: bool = False, progress: bool = True, log=print,
                  argument: str = "jobs file") -> list[dict]:
    """Check the jobs file ``path`` and its output folder before any work, then
    :func:`run_jobs` (what ``lowrank-jax jobs JOBS.yaml`` does).

    Args:
        path: the jobs YAML (format in the module docstring).
        model, out: used when the file names none.
        overwrite: write into an output folder that is not empty or holds another run.
        progress, log: a progress bar; where the per-job lines go.
        argument: how messages name the file (``"jobs file"``; the CLI's ``"`jobs`"``).

    Returns:
        One summary dict per job, as :func:`run_jobs`.
    """
    from lowrank_jax.runs.outputs import prepare_output
    from lowrank_jax.runs.validate import check_jobs_file
    from lowrank_jax.train import multihost

    jobs_out = check_jobs_file(path, out, argument=argument)[1]
    multihost.on_main_process(  # the folder is claimed once, by process 0 (it writes the files)
        lambda: prepare_output(jobs_out, command="finetune", argument="`out`",
                               overwrite=overwrite, reads={argument: path, "`model`": model}),
        what="checking the jobs' out folder")
    return run_jobs(load_jobs(path), model=model, out=out, progress=progress, log=log)


__all__ = ["JOB_KEYS", "TOP_KEYS", "load_jobs", "make_packed_step", "run_jobs", "run_jobs_file"]
