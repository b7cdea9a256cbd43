"""Build the optax transform a run config asks for (Spectron, AdamW, SGD) with its schedule."""

from __future__ import annotations

import optax

from lowrank_jax.train.config import OptimizerConfig


def schedule(peak: float, steps: int, warmup_fraction: float, kind: str):
    """Linear warmup then cosine decay to 10% (or constant), as an optax schedule."""
    warmup = int(round(warmup_fraction * steps))
    if kind == "constant":
        if warmup == 0:
            return optax.constant_schedule(peak)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
        )
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, warmup_steps=max(warmup, 1), decay_steps=max(steps, warmup + 1),
        end_value=0.1 * peak,
    )


def build_optimizer(cfg: OptimizerConfig, steps: int) -> optax.GradientTransformation:
    """The transform for a whole model's ``nnx.Param`` state.

    ``spectron``: Spectron on every ``LowRankFactor`` pair, AdamW on everything else (embeddings,
    norms, LM head), routed by :func:`lowrank_jax.optim.label_factors`. ``adamw``: AdamW on every
    leaf (on a factorized model this is the "naive" low-rank baseline).
    """
    lr = schedule(cfg.learning_rate, steps, cfg.warmup_fraction, cfg.schedule)
    parts = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    if cfg.name == "spectron":
        from lowrank_jax.optim import label_factors, spectron

        adam_lr = schedule(cfg.adamw_learning_rate, steps, cfg.warmup_fraction, cfg.schedule)
        parts.append(
            optax.partition(
                {
                    "spectron": spectron(lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay),
                    "adamw": optax.adamw(adam_lr, weight_decay=cfg.weight_decay),
                },
                label_factors,
            )
        )
    elif cfg.name == "lordo":  # one process = one worker: the sync is a displacement refresh
        from lowrank_jax.optim import lordo

        parts = [lordo(lr, cfg.rank, omega=cfg.omega, clip_norm=cfg.grad_clip or None,
                       weight_decay=cfg.weight_decay, refresh_every=cfg.sync_every,
                       refresh_from="displacement")]
    elif cfg.name == "adamw":
        parts.append(optax.adamw(lr, weight_decay=cfg.weight_decay))
    else:
        parts.append(optax.sgd(lr, momentum=cfg.momentum))
    return optax.chain(*parts)
