"""LoRA-family fine-tuning of a model's adapters (LoRA, BaLoRA, PiSSA, OLoRA, Gap-Init, LoKRA).

The application behind ``lowrank-jax finetune``, callable from Python with the same defaults.
Only ``nnx.LoRAParam`` leaves train (``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

METHODS = ("lora", "balora", "pissa", "olora", "gap", "lokra")


@dataclasses.dataclass
class FinetuneResult:
    """What :func:`finetune` returns: per-step training losses and the adapted paths."""

    losses: list[float]
    adapted: list[str]
    ranks: dict[str, int]
    initial_adapters: dict[str, tuple[Any, Any]]
    seconds: float
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # nn.qlora.memory_bytes


def token_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """``step -> (inputs, targets)`` windows drawn reproducibly from ``tokens``."""
    from lowrank_jax.data import batch_at

    return lambda step: batch_at(tokens, step, batch_size, seq_len, seed=seed)


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
    from lowrank_jax.nn.qlora import memory_bytes

    memory = memory_bytes(model, optimizer)
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
    return FinetuneResult(losses, adapted, layer_ranks, initial, seconds, memory)


_STEP_CACHE: dict[float, Callable] = {}


def _train_step(penalty: float):
    """One jitted AdamW step on the LoRA params (cached so repeated runs do not recompile)."""
    if penalty in _STEP_CACHE:
        return _STEP_CACHE[penalty]
    from flax import nnx

    from lowrank_jax.nn.lokra import lokra_regularizer
    from lowrank_jax.train.losses import cross_entropy

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


def load_model_and_tokens(model_name: str, data: str | None = None):
    """``(model, tokens, base_model_name_or_path)`` for fine-tuning.

    ``model_name`` is anything :func:`lowrank_jax.models.hub.load_model` reads. ``data`` is a
    UTF-8 text file (default: the embedded corpus: its bytes for the byte-level ``"tiny"``
    preset, the first 200,000 characters of its text otherwise).
    """
    from lowrank_jax.data import corpus_bytes
    from lowrank_jax.models.hub import SMOLLM2_HF_NAME, load_model
    from lowrank_jax.models.presets import PRESETS, preset_model

    text = None
    if data is not None:
        if not os.path.isfile(data):
            raise FileNotFoundError(f"--data {data}: file not found; pass a UTF-8 text file.")
        with open(data, encoding="utf-8") as f:
            text = f.read()
    if model_name in PRESETS:
        tokens = (np.frombuffer(text.encode("utf-8"), np.uint8) if text is not None
                  else corpus_bytes())
        return preset_model(model_name), tokens.astype(np.int32), None

    model, tokenizer = load_model(model_name)
    from lowrank_jax.train.structure import BYTE_TOKENIZER_FILE

    if tokenizer is None and os.path.isfile(os.path.join(str(model_name), BYTE_TOKENIZER_FILE)):
        from lowrank_jax.models.tokenizer import ByteTokenizer  # a byte-level folder (`tiny`)

        tokenizer = ByteTokenizer()
    if tokenizer is None:
        raise ValueError(f"--model {model_name}: no tokenizer found next to the checkpoint.")
    if text is None:
        from lowrank_jax.data import corpus_text

        text = corpus_text()[:200_000]
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    name = SMOLLM2_HF_NAME if model_name == "smollm2" else str(model_name)
    return model, tokens, name


__all__ = ["FinetuneResult", "METHODS", "finetune", "load_model_and_tokens", "token_batches"]
