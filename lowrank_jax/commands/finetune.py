"""``lowrank-jax finetune``: LoRA fine-tuning (LoRA, BaLoRA, PiSSA, OLoRA, Gap-Init, LoKRA) on CPU.

Only ``nnx.LoRAParam`` leaves train (``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``); the
adapter is saved in HuggingFace PEFT format (``adapter_config.json`` +
``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import numpy as np

from lowrank_jax.io.validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

METHODS = ("lora", "balora", "pissa", "olora", "gap", "lokra")
SMOLLM2_HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="LoRA fine-tuning (lora|balora|pissa|olora|gap|lokra), PEFT export",
        description="Fine-tune LoRA adapters on a text file and save them in HuggingFace PEFT "
                    "format. Only the adapters train; the base model stays frozen.",
    )
    p.add_argument("--model", default="tiny",
                   help="'smollm2' (the packaged GGUF), a .gguf / HF folder, or 'tiny' "
                        "(a small random byte-level Llama, for smoke tests)")
    p.add_argument("--data", default=None,
                   help="UTF-8 text file to fine-tune on (default: the embedded byte corpus)")
    p.add_argument("--method", default="lora", choices=METHODS)
    p.add_argument("--rank-plan", action="store_true",
                   help="CSPLoRA: probe the base model and allocate per-module ranks under the "
                        "parameter budget of uniform --rank")
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--alpha", type=positive_float, default=16.0)
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate (default 1e-3; 1e-4 for balora)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--targets", default=r"(q|v)_proj",
                   help="regex on module paths such as layers/3/self_attn/q_proj")
    p.add_argument("--lokra-lambda", type=non_negative_float, default=1e-3,
                   help="weight of the Kruskal-rank penalty (--method lokra)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", default="runs/finetune", help="output folder (adapter + metrics)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--jobs", default=None, metavar="JOBS.yaml",
                   help="train several LoRA jobs at once on one base (PLoRA packing); see "
                        "lowrank_jax/commands/_jobs.py for the file format")
    p.set_defaults(func=run)


@dataclasses.dataclass
class FinetuneResult:
    """What :func:`finetune` returns: per-step training losses and the adapted paths."""

    losses: list[float]
    adapted: list[str]
    ranks: dict[str, int]
    initial_adapters: dict[str, tuple[Any, Any]]
    seconds: float


def token_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """``step -> (inputs, targets)`` windows drawn reproducibly from ``tokens``."""
    from lowrank_jax.data import batch_at

    return lambda step: batch_at(tokens, step, batch_size, seq_len, seed=seed)


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in nats."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def finetune(
    model,
    batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]],
    *,
    method: str = "lora",
    targets: str = r"(q|v)_proj",
    rank: int = 8,
    alpha: float = 16.0,
    steps: int = 100,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
    ranks: dict[str, int] | None = None,
    lokra_lambda: float = 1e-3,
    progress: bool = True,
    description: str = "finetune",
) -> FinetuneResult:
    """Add adapters to ``model`` (in place), initialise them by ``method``, train them.

    Args:
        model: an NNX model returning ``(logits, cache)`` (``lowrank_jax.models.Llama``).
        batch_fn: ``step -> (inputs [b, t], targets [b, t])``.
        method: ``lora`` (standard init), ``balora`` (standard init + BaLoRA projection after
            AdamW), ``pissa``, ``olora``, ``gap`` (Gap-Init from the first batches), ``lokra``
            (standard init + Kruskal-rank penalty).
        targets: regex of module paths to adapt.
        rank, alpha: LoRA rank and alpha (scale ``alpha / rank``).
        steps, lr, weight_decay: AdamW settings (the same base optimizer for every method).
        seed: adapter init seed.
        ranks: optional per-path ranks (CSPLoRA plan).
        lokra_lambda: penalty weight for ``lokra``.
        progress: show a tqdm bar.

    Returns:
        A :class:`FinetuneResult`.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm import tqdm

    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
    from lowrank_jax.nn.init import init_lora_model
    from lowrank_jax.optim.balora import balora

    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {', '.join(METHODS)}.")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1.")
    adapted = apply_lora(model, LoRARule(targets, rank=rank, alpha=alpha), ranks=ranks,
                         rngs=nnx.Rngs(seed))
    init_key = jax.random.key(seed)
    if method in ("pissa", "olora"):
        init_lora_model(model, method, key=init_key)
    elif method == "gap":
        calib = [batch_fn(20_000_000 + i)[0] for i in range(4)]
        init_lora_model(model, "gap", key=init_key,
                        calibration_forward=lambda m: [m(jnp.asarray(x)) for x in calib])
    initial = {}
    if method in ("pissa", "olora"):
        initial = {p: (np.asarray(m.lora_a[...]), np.asarray(m.lora_b[...]))
                   for p, m in lora_layers(model)}
    base = optax.adamw(lr, weight_decay=weight_decay)
    tx = balora(base) if method == "balora" else base
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    penalty = lokra_lambda if method == "lokra" else 0.0

    step_fn = _train_step(penalty)

    losses = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=description, disable=not progress, leave=False)
    for step in bar:
        inputs, labels = batch_fn(step)
        loss = float(step_fn(model, optimizer, jnp.asarray(inputs), jnp.asarray(labels)))
        if not np.isfinite(loss):
            raise FloatingPointError(f"{method}: loss became {loss} at step {step}; lower --lr.")
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
    seconds = time.perf_counter() - start
    layer_ranks = {p: m.rank for p, m in lora_layers(model)}
    return FinetuneResult(losses, adapted, layer_ranks, initial, seconds)


_STEP_CACHE: dict[float, Callable] = {}


def _train_step(penalty: float):
    """One jitted AdamW step on the LoRA params (cached so repeated runs do not recompile)."""
    if penalty in _STEP_CACHE:
        return _STEP_CACHE[penalty]
    from flax import nnx

    from lowrank_jax.nn.lokra import lokra_regularizer

    def loss_fn(model, inputs, labels):
        logits, _ = model(inputs)
        loss = cross_entropy(logits, labels)
        if penalty:
            loss = loss + penalty * lokra_regularizer(model)
        return loss

    @nnx.jit
    def step_fn(model, optimizer, inputs, labels):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, inputs, labels)
        optimizer.update(model, grads)
        return loss

    _STEP_CACHE[penalty] = step_fn
    return step_fn


def tiny_model(seed: int = 0, vocab_size: int = 256):
    """The small byte-level Llama used by ``--model tiny`` and the reproduction script."""
    from flax import nnx

    from lowrank_jax.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=128, max_seq_len=256)
    return Llama(cfg, rngs=nnx.Rngs(seed))


def _load(model_name: str, data: str | None):
    """``(model, tokens, base_model_name_or_path)``."""
    from lowrank_jax.data import corpus_bytes

    text = None
    if data is not None:
        if not os.path.isfile(data):
            raise FileNotFoundError(f"--data {data}: file not found; pass a UTF-8 text file.")
        with open(data, encoding="utf-8") as f:
            text = f.read()
    if model_name == "tiny":
        tokens = (np.frombuffer(text.encode("utf-8"), np.uint8) if text is not None
                  else corpus_bytes())
        return tiny_model(), tokens.astype(np.int32), None
    from lowrank_jax.models.hub import load_model

    model, tokenizer = load_model(model_name)
    if tokenizer is None:
        raise ValueError(f"--model {model_name}: no tokenizer found next to the checkpoint.")
    if text is None:
        from lowrank_jax.data import corpus_text

        text = corpus_text()[:200_000]
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    name = SMOLLM2_HF_NAME if model_name == "smollm2" else str(model_name)
    return model, tokens, name


def run(args) -> int:
    from lowrank_jax.io.outputs import prepare_output
    from lowrank_jax.io.validate import check_jobs_file, check_regex, check_text_file

    if getattr(args, "jobs", None):
        from lowrank_jax.commands._jobs import run_jobs

        prepare_output(check_jobs_file(args.jobs, args.out)[1], command="finetune",
                       overwrite=args.overwrite)

        return run_jobs(args)
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.nn.rank_plan import plan_ranks

    check_regex(args.targets, "--targets")
    check_text_file(args.data, "--data")
    prepare_output(args.out, command="finetune", overwrite=args.overwrite)

    for name in ("rank", "steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1.")
    lr = args.lr if args.lr is not None else (1e-4 if args.method == "balora" else 1e-3)
    model, tokens, base_name = _load(args.model, args.data)
    if len(tokens) < args.seq_len + 2:
        raise ValueError(f"--data has {len(tokens)} tokens, fewer than --seq-len + 2 = "
                         f"{args.seq_len + 2}; pass more text or a smaller --seq-len.")
    batch_fn = token_batches(tokens, args.batch_size, args.seq_len, args.seed)
    ranks, scores = None, None
    if args.rank_plan:
        probe = [batch_fn(10_000_000 + i) for i in range(8)]
        ranks, scores = plan_ranks(model, probe, targets=args.targets, average_rank=args.rank,
                                   r_min=max(1, args.rank // 4), r_max=4 * args.rank)
    result = finetune(model, batch_fn, method=args.method, targets=args.targets,
                      rank=args.rank, alpha=args.alpha, steps=args.steps, lr=lr,
                      seed=args.seed, ranks=ranks, lokra_lambda=args.lokra_lambda,
                      progress=not args.no_progress, description=f"finetune {args.method}")
    os.makedirs(args.out, exist_ok=True)
    adapter_dir = os.path.join(args.out, "adapter")
    config = export_peft(model, adapter_dir, base_model_name_or_path=base_name,
                         initial_adapters=result.initial_adapters or None)
    summary = {
        "model": args.model, "method": args.method, "steps": args.steps, "lr": lr,
        "rank": args.rank, "alpha": args.alpha, "targets": args.targets,
        "first_loss": result.losses[0], "final_loss": float(np.mean(result.losses[-10:])),
        "seconds": result.seconds, "adapted_modules": len(result.adapted),
        "ranks": result.ranks, "probe_scores": scores, "peft_r": config["r"],
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(result.losses, f)
    print(f"{args.method}: loss {result.losses[0]:.4f} -> {summary['final_loss']:.4f} "
          f"(mean of the last 10 steps) in {args.steps} steps, {result.seconds:.1f} s; "
          f"{len(result.adapted)} modules adapted")
    print(f"PEFT adapter: {adapter_dir} (load with peft.PeftModel.from_pretrained)")
    return 0
