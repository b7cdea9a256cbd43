"""Training: configs, the jitted loop, LoRA fine-tuning (one job or packed jobs), orbax
checkpoints, sharding."""

from lowrank_jax.train.config import RunConfig, load_config
from lowrank_jax.train.finetune import FinetuneResult
from lowrank_jax.train.job import FinetuneJob, JobResult
from lowrank_jax.train.jobs import run_jobs, run_jobs_file
from lowrank_jax.train.loop import (
    TrainResult,
    TrainState,
    init_state,
    make_eval_fn,
    make_lm_step,
    train,
    train_windows,
)
from lowrank_jax.train.losses import lm_loss
from lowrank_jax.core.step import make_step

# ``finetune`` (the function) stays in lowrank_jax.train.finetune: exported here it would hide
# the module of the same name (``lowrank_jax.train.finetune.save_merged`` …)
__all__ = ["FinetuneJob", "FinetuneResult", "JobResult", "RunConfig", "TrainResult",
           "TrainState", "init_state", "lm_loss", "load_config", "make_eval_fn", "make_lm_step",
           "make_step", "run_jobs", "run_jobs_file", "train", "train_windows"]
