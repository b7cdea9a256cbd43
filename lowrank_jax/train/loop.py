"""The training loop behind ``lowrank-jax pretrain``: jitted step, evaluation, orbax checkpoints.

The step is a pure function of ``(params, opt_state, batch)``; the batch of step ``t`` depends
only on ``(seed, t)``; so a run interrupted after ``N`` steps and resumed from its checkpoint ends
bit-identical (CPU, fp32) to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from lowrank_jax.data import (
    batch_at,
    corpus_bytes,
    eval_batches,
    nats_to_bits,
    train_val_split,
    unigram_entropy_bits,
)
from lowrank_jax.runs import lock as run_lock
from lowrank_jax.runs import signals
from lowrank_jax.runs.outputs import atomic_write_text, prepare_output
from lowrank_jax.models.llama import Llama, count_params
from lowrank_jax.train import multihost
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.io.checkpoint import (  # re-exported for existing callers
    checkpoint_manager,
    restore_checkpoint,
    save_checkpoint,
    truncate_metrics,
)
from lowrank_jax.train.config import RunConfig
from lowrank_jax.train.losses import evaluate_windows, lm_loss
from lowrank_jax.train.text_data import open_training_data
from lowrank_jax.train.optimizers import build_optimizer, with_structure
from lowrank_jax.core.loop import NonFiniteLoss, iterate_steps, run_steps
from lowrank_jax.core.step import make_step


@dataclasses.dataclass
class TrainState:
    graphdef: nnx.GraphDef
    params: nnx.State
    opt_state: optax.OptState
    step: int


def init_state(cfg: RunConfig, mesh=None, *,
               abstract: bool = False) -> tuple[TrainState, optax.GradientTransformation]:
    """Build model and optimizer state; on a mesh, parameters are created already sharded.

    With ``abstract`` nothing is allocated: the state's leaves are ``jax.ShapeDtypeStruct``s
    carrying the shardings the real state would have on ``mesh`` (what ``lowrank-jax compile``
    lowers the step with, for a pod this host does not have).
    """
    tx = with_structure(build_optimizer(cfg.optimizer, cfg.train.steps), cfg)
    make = lambda: nnx.split(Llama(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), nnx.Param)
    graphdef, abstract_params = nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0))), None
    graphdef, abstract_params = nnx.split(graphdef, nnx.Param)
    if abstract:
        if mesh is None:
            raise ValueError("init_state(abstract=True) needs the mesh the state is laid on.")
        with_sharding = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
        params = with_sharding(abstract_params,
                               shard_lib.param_shardings(abstract_params, mesh))
        opt_state = jax.eval_shape(tx.init, params)
        opt_state = with_sharding(opt_state, shard_lib.state_shardings(opt_state, params, mesh))
        return TrainState(graphdef, params, opt_state, 0), tx
    if mesh is None:
        params = make()[1]
        opt_state = jax.jit(tx.init)(params)
    else:
        shardings = shard_lib.param_shardings(abstract_params, mesh)
        params = jax.jit(lambda: make()[1], out_shardings=shardings)()
        # moments on their parameters' shardings, the rest (step counts) replicated
        opt_state = shard_lib.init_optimizer_state(tx, params, mesh)
    return TrainState(graphdef, params, opt_state, 0), tx


def make_lm_step(graphdef, tx, *, params=None, opt_state=None, batch_sharding=None,
                 packed: bool = False) -> Callable:
    """``step(params, opt_state, inputs, targets) -> (params, opt_state, metrics)``, jitted: the
    one step builder (:func:`lowrank_jax.core.step.make_step`) with the language-model loss of
    ``graphdef``, non-finite updates skipped and, on a mesh, the state's shardings.

    On a mesh, pass the (sharded) ``params``/``opt_state`` and the ``batch_sharding``: the step
    is then compiled with explicit in/out shardings equal to the current ones, so the state's
    sharding never drifts from the rules between steps. ``packed=True``: the batch is the five
    fields of a :class:`lowrank_jax.data.PackedBatch` (``step(params, opt_state, *batch)``).
    """
    loss_fn = lm_loss(graphdef)
    # never apply a non-finite update: keep the old state and report it in the metrics
    if params is None:
        return make_step(loss_fn, tx, skip_nonfinite=True)
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    fields = 5 if packed else 2
    return make_step(loss_fn, tx, skip_nonfinite=True, shardings=(
        sharding_of(params), sharding_of(opt_state), (batch_sharding,) * fields))


def pretrain_step(state: TrainState, tx, mesh=None, *, packed: bool = False):
    """``(step, batch_sharding)``: the train step of ``pretrain`` for ``state`` on ``mesh``.

    The one construction shared by :func:`train` and ``lowrank-jax compile`` (which passes an
    abstract state from ``init_state(..., abstract=True)`` and calls ``step.lower``);
    ``batch_sharding`` is ``None`` without a mesh. On a mesh the step is traced and run under
    ``jax.set_mesh(mesh)``, so the loss keeps the logits split over the batch
    (:func:`~lowrank_jax.train.losses.batch_sharded`).
    """
    if mesh is None:
        return make_lm_step(state.graphdef, tx), None
    batch_spec = shard_lib.batch_sharding(mesh)
    jitted = make_lm_step(state.graphdef, tx, params=state.params, opt_state=state.opt_state,
                             batch_sharding=batch_spec, packed=packed)

    def on_mesh(method):
        def call(*args):
            with jax.set_mesh(mesh):
                return method(*args)
        return call

    step = on_mesh(jitted)
    step.lower = on_mesh(jitted.lower)
    return step, batch_spec


def make_eval_fn(graphdef) -> Callable:
    """``evaluate(params, inputs, targets) -> loss``: :func:`lm_loss`, jitted."""
    return jax.jit(lm_loss(graphdef))


def evaluate(eval_fn, params, tokens, batch_size, seq_len, max_batches) -> float:
    """Mean of ``eval_fn(params, inputs, targets)`` (e.g. :func:`make_eval_fn`) over the
    held-out windows of ``eval_batches(tokens, batch_size, seq_len, max_batches)``: the
    :func:`~lowrank_jax.train.losses.evaluate_windows` loop on those windows."""
    windows = np.concatenate([np.concatenate([x, y[:, -1:]], 1)
                              for x, y in eval_batches(tokens, batch_size, seq_len, max_batches)])
    return evaluate_windows(lambda states, w: eval_fn(*states, w[:, :-1], w[:, 1:]), (params,),
                            windows, batch_size=batch_size)


def train_steps(step: Callable, params, opt_state, tokens, *, steps: int, batch_size: int,
                seq_len: int, seed: int, desc: str | None = None):
    """``steps`` updates of ``step`` on the corpus batches ``batch_at(tokens, t, batch_size,
    seq_len, seed)``, ``t = 0 .. steps - 1``: ``(params, opt_state, losses)``.

    ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss)`` is a step of
    :func:`lowrank_jax.core.step.make_step` (e.g. on :func:`lm_loss`); ``losses`` are its
    per-step values as floats. ``desc`` shows a progress bar with the running loss. A
    non-finite loss raises (:func:`~lowrank_jax.core.loop.run_steps`).

    Example::

        >>> import jax.numpy as jnp, optax
        >>> tokens = jnp.arange(64) % 4
        >>> loss = lambda w, x, y: jnp.mean((w * x - y) ** 2)
        >>> tx = optax.sgd(0.01)
        >>> w, _, losses = train_steps(make_step(loss, tx), jnp.float32(0.0), tx.init(0.0),
        ...                            tokens, steps=3, batch_size=2, seq_len=8, seed=0)
        >>> len(losses), losses[-1] < losses[0]
        (3, True)
    """
    def batches(t):
        return batch_at(tokens, t, batch_size, seq_len, seed=seed)

    run = run_steps(step, params, opt_state, batches, steps=steps, progress=desc)
    return run.params, run.opt_state, run.losses


def train_windows(step: Callable, params, opt_state, windows, *, steps: int, batch_size: int,
                  rng: np.random.Generator, evaluate: Callable | None = None,
                  eval_every: int = 0):
    """``steps`` updates of ``step`` on batches of ``batch_size`` rows of ``windows`` drawn with
    ``rng.integers`` (with replacement); ``(params, opt_state, losses, curve)``.

    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` (close over the frozen
    state and extra arguments of a :func:`lowrank_jax.core.step.make_step` step); ``windows``
    is ``[n, length]`` tokens. ``rng`` is the caller's generator, so a run over several tasks
    draws one stream. With ``evaluate(params) -> float``, ``curve`` holds ``(0, value)``, then
    ``(t, value)`` every ``eval_every`` steps and at the last one. Training stops at a
    non-finite loss or evaluation (a diverged run: :func:`~lowrank_jax.core.loop.run_steps`
    with ``nonfinite="stop"``). Without ``evaluate`` ``curve`` is empty.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> from lowrank_jax.core.step import make_step
        >>> windows = np.arange(40).reshape(10, 4) % 3
        >>> loss = lambda w, batch: jnp.mean((w * batch[:, :-1] - batch[:, 1:]) ** 2)
        >>> tx = optax.sgd(0.01)
        >>> w, _, losses, curve = train_windows(
        ...     make_step(loss, tx), jnp.float32(0.0), tx.init(0.0), windows, steps=4,
        ...     batch_size=2, rng=np.random.default_rng(0), evaluate=float, eval_every=2)
        >>> len(losses), [t for t, _ in curve]
        (4, [0, 2, 4])
    """
    import jax.numpy as jnp

    def batches(t):
        return (jnp.asarray(windows[rng.integers(0, len(windows), batch_size)]),)

    run = run_steps(step, params, opt_state, batches, steps=steps, nonfinite="stop",
                    evaluate=evaluate, eval_every=max(eval_every, 1), eval_first=True)
    return run.params, run.opt_state, run.losses, run.curve


def plot_losses(metrics_path: pathlib.Path, out_png: pathlib.Path, entropy_bits: float,
                unit: str = "byte") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.axhline(entropy_bits * math.log(2), color="gray", ls="--",
               label=f"unigram {unit} entropy ({entropy_bits:.2f} bits)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross entropy (nats / {unit})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


class Throughput:
    """Tokens/s, tokens/s/device and MFU of the steps since the last logged one.

    The clock restarts after the run's first step when that step is not logged, so its
    compilation is not counted. MFU is model FLOPs
    (:func:`~lowrank_jax.models.flops.training_flops_per_token`, factorized layers at their
    factors' cost) per device over the chip's bf16 peak (``train.peak_tflops``, else the
    :data:`~lowrank_jax.models.flops.CHIPS` entry of ``jax.devices()[0].device_kind``); on a
    CPU without ``train.peak_tflops`` it is ``None`` (``null`` in metrics.jsonl).

    Example::

        >>> from lowrank_jax.train.config import load_config
        >>> meter = Throughput(load_config("tiny", ["train.peak_tflops=1"]), devices=1)
        >>> sorted(meter.step(2048, logged=True))
        ['mfu', 'tokens_per_s', 'tokens_per_s_per_device']
    """

    #: the keys of :meth:`step`'s rates: wall-clock measurements, which differ between two
    #: runs that are otherwise bit-identical.
    FIELDS = ("tokens_per_s", "tokens_per_s_per_device", "mfu")

    def __init__(self, cfg: RunConfig, devices: int):
        from lowrank_jax.models.flops import peak_flops, training_flops_per_token

        self.devices = devices
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak = peak_flops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
        self.start, self.tokens, self.steps = time.perf_counter(), 0, 0

    def step(self, tokens: int, logged: bool) -> dict | None:
        """Count a step of ``tokens`` (global) tokens; the rates when ``logged``, else None."""
        from lowrank_jax.models.flops import mfu

        self.steps += 1
        self.tokens += tokens
        if not logged:
            if self.steps == 1:  # the first step compiled the step: keep it out of the rates
                self.start, self.tokens = time.perf_counter(), 0
            return None
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        per_device = rate / self.devices
        return {"tokens_per_s": rate, "tokens_per_s_per_device": per_device,
                "mfu": mfu(self.flops_per_token, per_device, self.peak)}

    @staticmethod
    def postfix(speed: dict) -> dict:
        """The progress bar's fields of :meth:`step`'s rates."""
        shown = {"tok_s": f"{speed['tokens_per_s']:,.0f}",
                 "tok_s_dev": f"{speed['tokens_per_s_per_device']:,.0f}"}
        if speed["mfu"] is not None:
            shown["mfu"] = f"{speed['mfu']:.1%}"
        return shown


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    val_loss: float
    val_bits_per_byte: float
    unigram_entropy_bits: float
    run_dir: pathlib.Path
    losses: list[float]
    unit: str = "byte"  # what a token is: a byte (embedded corpus, byte tokenizer) or a token


RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "summary.json", "loss.png")


def _finished_summary(run_dir: pathlib.Path, step: int, steps: int) -> dict | None:
    """The ``summary.json`` of a run that completed ``steps`` steps at ``step``, else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    keys = ("val_loss", "val_bits_per_byte", "unigram_entropy_bits_per_byte")
    if (not isinstance(summary, dict) or summary.get("step") != step or step < steps
            or "stopped" in summary or not all(k in summary for k in keys)):
        return None
    return summary


@run_lock.releasing  # the run_dir's lock is held while train runs
def train(cfg: RunConfig, *, resume: bool = False, stop_after: int | None = None,
          progress: bool = True, mesh=None, log=print, overwrite: bool = False) -> TrainResult:
    """Pretrain ``cfg.model`` on the embedded corpus, or on ``cfg.data.path`` through grain
    (:mod:`lowrank_jax.train.text_data`: packed documents, the iterator in the checkpoint);
    checkpoints, metrics and plot in ``run_dir``.

    Args:
        cfg: the run configuration.
        resume: continue from the latest checkpoint in ``cfg.run_dir`` (error when none).
        stop_after: stop (with a checkpoint) after this many steps in total, as if interrupted.
        progress: show a tqdm progress bar.
        mesh: a ``(data, fsdp, tensor)`` mesh; by default one is built from ``cfg.mesh`` when it
            has more than one device.
        overwrite: start afresh in a ``run_dir`` that holds another run or files of the user
            (its previous checkpoints and metrics are removed; other files are kept).
            Without it such a folder is refused before any work (see
            :func:`lowrank_jax.runs.outputs.prepare_output`).
    """
    run_dir = pathlib.Path(cfg.run_dir)
    if mesh is None and cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor > 1:
        mesh = shard_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    if mesh is not None:
        split = mesh.shape["data"] * mesh.shape["fsdp"]
        if cfg.train.batch_size % split:
            raise ValueError(
                f"train.batch_size={cfg.train.batch_size} is not divisible by data x fsdp = "
                f"{split}; use a multiple of {split}."
            )
    multihost.check_shared_folder(run_dir, argument="run_dir")  # not shared: an error, not a hang
    main = multihost.is_main_process()  # files are written once, by process 0
    checkpoints = run_dir / "checkpoints"
    has_steps = checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())
    if resume and not has_steps:
        started = run_dir.is_dir() and (run_dir / "config.yaml").is_file()
        raise FileNotFoundError(
            f"`resume`: no checkpoint in {checkpoints}; " + (
                "the run stopped before its first checkpoint, so start it again: drop "
                "`resume` and pass `overwrite`." if started else
                "run without `resume` first."))
    multihost.on_main_process(  # one lock per run, held by process 0 (it writes the files)
        lambda: prepare_output(run_dir, command="pretrain", argument="run_dir",
                               overwrite=overwrite, resume=resume, owned_names=RUN_FILES,
                               lock=True, log=log),
        what="checking run_dir")
    data = None  # the user's corpus (checked here, before anything is compiled)
    if cfg.data.path is None:
        tokens = corpus_bytes()
        train_tokens, val_tokens = train_val_split(tokens, cfg.train.val_fraction)
        entropy = unigram_entropy_bits(train_tokens)
    else:
        data, val_tokens = open_training_data(cfg, mesh), None
        entropy = data.entropy_bits
    manager = checkpoint_manager(run_dir, data_iterator=data is not None)
    if not resume and manager.latest_step() is not None:
        raise FileExistsError(
            f"{run_dir} already holds a checkpoint (step {manager.latest_step()}); pass `resume` "
            f"to continue it or choose another run_dir (`run_dir=runs/new`)."
        )
    state, tx = init_state(cfg, mesh)
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        state, manager = restore_checkpoint(manager, state, cfg, log=log,
                                            data_iterator=None if data is None else data.rows)
        finished = _finished_summary(run_dir, state.step, cfg.train.steps)
        if finished is not None:  # nothing to do: no second eval row, no new files
            log(f"the run already finished at step {state.step} ({run_dir / 'summary.json'}); "
                "nothing to do (raise train.steps to train further)")
            return TrainResult(state, finished["val_loss"], finished["val_bits_per_byte"],
                               finished["unigram_entropy_bits_per_byte"], run_dir, [])
        dropped = truncate_metrics(metrics_path, state.step) if main else 0
        log(f"resumed from step {state.step}"
            + (f" ({dropped} metrics rows after it dropped)" if dropped else ""))
    if main:
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    step_fn, batch_spec = pretrain_step(state, tx, mesh, packed=data is not None)
    eval_fn = make_eval_fn(state.graphdef)
    if main and not resume and metrics_path.exists():
        metrics_path.unlink()  # a stale file of ours (prepare_output refused anyone else's)
    n_params = count_params(nnx.merge(state.graphdef, state.params))
    log(f"model: {n_params:,} parameters ({cfg.model.projection}); optimizer: "
        f"{cfg.optimizer.name}; {cfg.train.steps} steps of {cfg.train.batch_size}x"
        f"{cfg.train.seq_len} {'bytes' if data is None else data.unit + 's'}")
    last = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
    position = lambda: None if data is None else data.iterator_at(state.step)  # noqa: E731
    throughput = Throughput(cfg, 1 if mesh is None else mesh.devices.size)

    inputs = [None]  # the inputs of the last batch: the tokens the step counted

    def batches(t):
        if data is not None:  # this process's packed rows, as global arrays
            batch = data.next_batch()
        elif batch_spec is None:
            batch = batch_at(train_tokens, t, cfg.train.batch_size, cfg.train.seq_len,
                             cfg.train.seed)
        else:  # each process builds only the rows of its devices
            batch = multihost.sharded_batch(train_tokens, t, cfg.train.batch_size,
                                            cfg.train.seq_len, cfg.train.seed, batch_spec)
        inputs[0] = batch[0]
        return batch

    loop = iterate_steps(step_fn, state.params, state.opt_state, batches, steps=last,
                         start=state.step, progress="pretrain" if progress and main else None)
    run = None
    try:
        with open(metrics_path if main else os.devnull, "a") as metrics_file:
            if state.step < last and signals.stop_agreed():  # SIGTERM: stop at this boundary
                raise signals.Stopped(state.step)
            try:
                for run in loop:
                    state = dataclasses.replace(state, params=run.params,
                                                opt_state=run.opt_state, step=run.step)
                    loss, m = run.loss, run.value
                    logged = state.step % cfg.train.log_every == 0 or state.step == last
                    speed = throughput.step(inputs[0].size, logged)
                    if logged:
                        run.postfix.update(throughput.postfix(speed))
                        metrics_file.write(json.dumps({"kind": "train", "step": state.step,
                                                       "loss": loss,
                                                       "grad_norm": float(m["grad_norm"]),
                                                       **speed}) + "\n")
                        metrics_file.flush()
                    if state.step % cfg.train.eval_every == 0 and state.step < last:
                        vl = _held_out_loss(data, eval_fn, state.params, val_tokens, cfg)
                        metrics_file.write(json.dumps({"kind": "eval", "step": state.step,
                                                       "val_loss": vl}) + "\n")
                    if state.step % cfg.train.checkpoint_every == 0 and state.step < last:
                        save_checkpoint(manager, state, cfg, position())
                    if state.step < last and signals.stop_agreed():  # SIGTERM: stop here
                        raise signals.Stopped(state.step)
            except NonFiniteLoss as e:  # the step did not apply the update
                state = dataclasses.replace(state, params=e.params, opt_state=e.opt_state,
                                            step=e.step + 1)
                save_checkpoint(manager, state, cfg, position())
                raise FloatingPointError(
                    f"non-finite loss/update at step {state.step} (loss={e.loss}); the update "
                    f"was not applied and a checkpoint was saved in {run_dir}. Lower "
                    "optimizer.learning_rate or enable optimizer.grad_clip."
                ) from None
            losses = [] if run is None else run.losses
            val_loss = _held_out_loss(data, eval_fn, state.params, val_tokens, cfg)
            metrics_file.write(json.dumps({"kind": "eval", "step": state.step,
                                           "val_loss": val_loss}) + "\n")
    except signals.Stopped:
        save_checkpoint(manager, state, cfg, position())
        loop.close()
        if main:
            atomic_write_text(run_dir / "summary.json", json.dumps(
                {"step": state.step, "stopped": "SIGTERM", "steps": cfg.train.steps},
                indent=2))
        raise signals.Stopped(
            f"stopped by SIGTERM at step {state.step} of {cfg.train.steps}; checkpoint and "
            f"summary.json saved in {run_dir} — continue with `resume`") from None
    except KeyboardInterrupt:
        try:
            save_checkpoint(manager, state, cfg, position())
        except KeyboardInterrupt:  # pressed again during the save: it completed all the same
            pass
        loop.close()
        log(f"interrupted at step {state.step}; checkpoint saved — continue with --resume")
        raise
    save_checkpoint(manager, state, cfg, position())
    unit = "byte" if data is None else data.unit
    if main:
        plot_losses(metrics_path, run_dir / "loss.png", entropy, unit)
    bpb = nats_to_bits(val_loss)
    summary = {"step": state.step, "val_loss": val_loss, f"val_bits_per_{unit}": bpb,
               f"unigram_entropy_bits_per_{unit}": entropy, "params": n_params}
    if main:
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return TrainResult(state, val_loss, bpb, entropy, run_dir, losses, unit)


def _held_out_loss(data, eval_fn, params, val_tokens, cfg) -> float:
    """The validation loss: of the held-out documents (``data``) or of the corpus's tail."""
    if data is not None:
        return data.evaluate(eval_fn, params)
    return evaluate(eval_fn, params, val_tokens, cfg.train.batch_size, cfg.train.seq_len,
                    cfg.train.eval_batches)
