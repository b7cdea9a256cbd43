"""Training: configs, the jitted loop, orbax checkpoints, sharding."""

from lowrank_jax.train.config import RunConfig, load_config
from lowrank_jax.train.loop import TrainResult, TrainState, init_state, make_train_step, train

__all__ = ["RunConfig", "TrainResult", "TrainState", "init_state", "load_config",
           "make_train_step", "train"]
