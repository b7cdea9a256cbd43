"""Training: configs, the jitted loop, orbax checkpoints, sharding."""

from lowrank_jax.train.config import RunConfig, load_config
from lowrank_jax.train.loop import (
    TrainResult,
    TrainState,
    init_state,
    make_eval_fn,
    make_train_step,
    train,
)
from lowrank_jax.train.losses import lm_loss
from lowrank_jax.core.step import make_step

__all__ = ["RunConfig", "TrainResult", "TrainState", "init_state", "lm_loss", "load_config",
           "make_eval_fn", "make_step", "make_train_step", "train"]
