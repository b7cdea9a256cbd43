"""Build the optax transform a run config asks for (Spectron, AdamW, SGD) with its schedule."""

from __future__ import annotations

import optax

from lowrank_jax.optim.salaad import scale_by_salaad
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
    """The transform for a whole model's ``nnx.Param`` state, built from public constructors.

    ``spectron``: :func:`lowrank_jax.optim.spectron_with_adamw` (Spectron on every factor pair,
    AdamW with the library's documented betas 0.9 / 0.95 on everything else), the very transform
    a user would build; ``cfg.weight_decay`` is passed as both of its decays (AdamW's and
    Spectron's ``λ``). ``adamw``: ``optax.adamw`` on every leaf (on a factorized model this is the
    "naive" low-rank baseline). ``sgd``: ``optax.sgd`` with momentum. A positive
    ``cfg.grad_clip`` clips the global gradient norm first.
    """
    learning_rate = schedule(cfg.learning_rate, steps, cfg.warmup_fraction, cfg.schedule)
    clip_norm = cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0 else None
    if cfg.name == "spectron":
        from lowrank_jax.optim import spectron_with_adamw

        adamw_learning_rate = schedule(
            cfg.adamw_learning_rate, steps, cfg.warmup_fraction, cfg.schedule
        )
        return spectron_with_adamw(
            learning_rate,
            adamw_learning_rate,
            weight_decay=cfg.weight_decay,
            spectron_weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            clip_norm=clip_norm,
        )
    if cfg.name == "lordo":  # one process = one worker: the sync is a displacement refresh
        from lowrank_jax.optim import lordo

        return lordo(learning_rate, cfg.rank, omega=cfg.omega, clip_norm=clip_norm,
                     weight_decay=cfg.weight_decay, refresh_every=cfg.sync_every,
                     refresh_from="displacement")
    if cfg.name == "adamw":
        tx = optax.adamw(learning_rate, weight_decay=cfg.weight_decay)
    else:
        tx = optax.sgd(learning_rate, momentum=cfg.momentum)
    if clip_norm is None:
        return tx
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx)


def with_structure(tx: optax.GradientTransformation, cfg) -> optax.GradientTransformation:
    """``tx`` with the structure ``cfg.structure`` asks for (``"none"``: ``tx`` itself).

    ``"salaad"``: ``optax.chain(scale_by_salaad(cfg.salaad), tx)`` — the penalty gradient goes
    through ``tx``'s clipping and moments (the reference's "coupled" variant).
    """
    if cfg.structure == "none":
        return tx
    if cfg.structure == "salaad":
        return optax.chain(scale_by_salaad(cfg.salaad), tx)
    raise ValueError(f"structure={cfg.structure!r} is unknown; use none or salaad.")
