"""LoRA-family fine-tuning of a model's adapters (LoRA, BaLoRA, PiSSA, OLoRA, Gap-Init, LoKRA).

The application behind ``lowrank-jax finetune``, callable from Python with the same defaults.
Only ``nnx.LoRAParam`` leaves train (:func:`lowrank_jax.core.step.make_step` with
``wrt=nnx.LoRAParam``).

On a ``(data, fsdp, tensor)`` mesh (``mesh=``, the CLI's ``--mesh``; one process or several) the
model, its adapters and the optimizer state are sharded by the rules of
:mod:`lowrank_jax.train.sharding`, the step is compiled with those shardings as in and out
shardings (they never drift), and each process builds only its rows of each batch.
:func:`export_adapter` / :func:`save_merged` gather the arrays that span several processes and
write once, from process 0.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

FINETUNE_METHODS = ("lora", "balora", "pissa", "olora", "gap", "lokra")
# BaLoRA trains with a small learning rate (its paper: AdamW, large adapter scale, small lr)
DEFAULT_LR = {"balora": 1e-4}
FALLBACK_LR = 1e-3


def default_lr(method: str) -> float:
    """The learning rate :func:`finetune` (and ``lowrank-jax finetune``) uses when none is given.

    Example::

        >>> default_lr("lora"), default_lr("balora")
        (0.001, 0.0001)
    """
    return DEFAULT_LR.get(method, FALLBACK_LR)


@dataclasses.dataclass
class FinetuneResult:
    """What :func:`finetune` returns: per-step training losses and the adapted paths."""

    losses: list[float]
    adapted: list[str]
    ranks: dict[str, int]
    initial_adapters: dict[str, tuple[Any, Any]]
    seconds: float
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # nn.qlora.memory_bytes


@dataclasses.dataclass(frozen=True)
class TokenBatches:
    """``step -> (inputs, targets)`` windows drawn reproducibly from ``tokens``.

    ``rows=`` builds only some rows of the batch (the ones a process's devices hold), with the
    same values as the whole batch's rows.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int

    def __call__(self, step: int, rows: slice | None = None):
        from lowrank_jax.data import batch_at

        return batch_at(self.tokens, step, self.batch_size, self.seq_len, seed=self.seed,
                        rows=rows)


def token_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> TokenBatches:
    """``step -> (inputs, targets)`` windows drawn reproducibly from ``tokens``."""
    return TokenBatches(tokens, batch_size, seq_len, seed)


def _global_batch(batch_fn, step: int, sharding):
    """The batch of ``step`` as two arrays on ``sharding``; each process builds its own rows."""
    import jax

    from lowrank_jax.train import multihost

    if isinstance(batch_fn, TokenBatches):
        return multihost.sharded_batch(batch_fn.tokens, step, batch_fn.batch_size,
                                       batch_fn.seq_len, batch_fn.seed, sharding)
    arrays = [np.asarray(a) for a in batch_fn(step)]  # any batch_fn: the same on every process
    return tuple(jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
                 for a in arrays)


def finetune(
    model,
    batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]],
    *,
    method: str = "lora",
    targets: str = r"(q|v)_proj",
    rank: int = 8,
    alpha: float = 16.0,
    steps: int = 100,
    lr: float | None = None,
    weight_decay: float = 0.0,
    seed: int = 0,
    ranks: dict[str, int] | None = None,
    lokra_lambda: float = 1e-3,
    progress: bool = True,
    description: str = "finetune",
    mesh=None,
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
        steps, lr, weight_decay: AdamW settings (the same base optimizer for every method);
            ``lr=None`` takes :func:`default_lr` (1e-4 for ``balora``, 1e-3 otherwise).
        seed: adapter init seed.
        ranks: optional per-path ranks (CSPLoRA plan).
        lokra_lambda: penalty weight for ``lokra``.
        progress: show a tqdm bar.
        mesh: a ``(data, fsdp, tensor)`` mesh (:func:`lowrank_jax.train.sharding.make_mesh`),
            possibly spanning several processes: the model (adapters included) and the
            optimizer state are sharded by the rules of :mod:`lowrank_jax.train.sharding`; the
            batch is split over ``data`` x ``fsdp``. Every process calls :func:`finetune` with
            the same arguments.

    Returns:
        A :class:`FinetuneResult`.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from lowrank_jax.core.loop import NonFiniteLoss, iterate_steps
    from lowrank_jax.core.step import trainable
    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
    from lowrank_jax.nn.init import init_lora_model
    from lowrank_jax.optim.balora import balora

    if method not in FINETUNE_METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {', '.join(FINETUNE_METHODS)}.")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1.")
    batch_spec = None
    if mesh is not None:
        from lowrank_jax.train import sharding as shard_lib

        split = mesh.shape["data"] * mesh.shape["fsdp"]
        rows = len(np.asarray(batch_fn(0)[0])) if not isinstance(batch_fn, TokenBatches) \
            else batch_fn.batch_size
        if rows % split:
            raise ValueError(f"batch size {rows} is not divisible by the mesh's data x fsdp = "
                             f"{split}; use a multiple of {split} (`batch_size`).")
        batch_spec = shard_lib.batch_sharding(mesh)
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
    lr = default_lr(method) if lr is None else lr
    base = optax.adamw(lr, weight_decay=weight_decay)
    tx = balora(base) if method == "balora" else base
    if mesh is not None:
        shard_lib.shard_model(model, mesh)
    graph, params = nnx.split(model)
    opt_state = tx.init(trainable(params, nnx.LoRAParam))
    if mesh is not None:  # step counts come out of init on one device
        opt_state = shard_lib.place_on_mesh(opt_state, mesh)
    from lowrank_jax.nn.qlora import memory_bytes

    memory = memory_bytes(model, opt_state)
    penalty = lokra_lambda if method == "lokra" else 0.0
    step_fn = _finetune_step(graph, tx, penalty, params, opt_state, batch_spec)
    if mesh is None:
        batch_of = lambda step: tuple(jnp.asarray(a) for a in batch_fn(step))  # noqa: E731
    else:
        batch_of = lambda step: _global_batch(batch_fn, step, batch_spec)  # noqa: E731
    main = jax.process_index() == 0

    losses = []
    start = time.perf_counter()
    try:
        for run in iterate_steps(step_fn, params, opt_state, batch_of, steps=steps, what=method,
                                 hint="lower `lr`.",
                                 progress=description if progress and main else None):
            params, losses = run.params, run.losses
    except NonFiniteLoss as e:
        params = e.params
        raise
    finally:  # the model holds the last parameters, also when a step fails
        nnx.update(model, params)
    seconds = time.perf_counter() - start
    layer_ranks = {p: m.rank for p, m in lora_layers(model)}
    return FinetuneResult(losses, adapted, layer_ranks, initial, seconds, memory)


def _finetune_step(graph, tx, penalty: float, params, opt_state, batch_sharding):
    """The fine-tuning step (:func:`lowrank_jax.core.step.make_step` on the ``LoRAParam``
    leaves): next-token cross-entropy, plus ``penalty`` times the LoKRA regularizer.

    On a mesh (``batch_sharding`` given) it is compiled with the current shardings of
    ``params`` and ``opt_state`` as in *and* out shardings, so they stay on the rules, and it
    consumes (donates) them.
    """
    import jax
    from flax import nnx

    from lowrank_jax.core.losses import cross_entropy
    from lowrank_jax.core.step import make_step
    from lowrank_jax.nn.lokra import lokra_regularizer

    def loss_fn(params, inputs, labels):
        model = nnx.merge(graph, params)
        logits, _ = model(inputs)
        loss = cross_entropy(logits, labels)
        if penalty:
            loss = loss + penalty * lokra_regularizer(model)
        return loss

    if batch_sharding is None:
        return make_step(loss_fn, tx, wrt=nnx.LoRAParam)
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    return make_step(loss_fn, tx, wrt=nnx.LoRAParam, donate=True, shardings=(
        sharding_of(params), sharding_of(opt_state), (batch_sharding, batch_sharding)))


def export_adapter(model, folder, *, base_model_name_or_path=None, initial_adapters=None) -> dict:
    """:func:`lowrank_jax.io.peft.export_peft` of ``model``, in one process or several.

    Arrays sharded over several processes are gathered first
    (:func:`lowrank_jax.train.multihost.host_copy`, a collective: every process calls this);
    process 0 writes the folder; every process returns the PEFT config.
    """
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.train import multihost

    local = multihost.host_copy(model)
    return multihost.on_main_process(
        lambda: export_peft(local, folder, base_model_name_or_path=base_model_name_or_path,
                            initial_adapters=initial_adapters), what="exporting the adapter")


def save_merged(model, folder) -> str:
    """Merge the adapters of a copy of ``model`` into its kernels and save it as a model folder
    (:func:`lowrank_jax.hub.save_model`; ``--model`` reads it). ``model`` is left as it
    is. Multi-process: gathered, then written by process 0 (every process calls this)."""
    from lowrank_jax.hub import save_model
    from lowrank_jax.nn import remove_lora
    from lowrank_jax.train import multihost

    local = multihost.host_copy(model)
    remove_lora(local, merge=True)  # merge_lora, then plain nnx.Linear layers
    return multihost.on_main_process(lambda: save_model(local, folder), what="saving the merge")


def load_model_and_tokens(model_name: str, data: str | None = None):
    """``(model, tokens, base_model_name_or_path, tokenizer)`` for fine-tuning (the tokenizer:
    the preset's bytes, else the one :func:`lowrank_jax.hub.load_model` found).

    ``model_name`` is anything :func:`lowrank_jax.hub.load_model` reads. ``data`` is a
    UTF-8 text file (default: the embedded corpus: its bytes for the byte-level ``"tiny"``
    preset, the first 200,000 characters of its text otherwise).
    """
    from lowrank_jax.data import corpus_bytes
    from lowrank_jax.hub import SMOLLM2_HF_NAME, load_model
    from lowrank_jax.models.presets import PRESETS, preset_model
    from lowrank_jax.models.tokenizer import ByteTokenizer

    text = None
    if data is not None:
        if not os.path.isfile(data):
            raise FileNotFoundError(f"data={data}: file not found; pass a UTF-8 text file.")
        with open(data, encoding="utf-8") as f:
            text = f.read()
    if model_name in PRESETS:
        tokens = (np.frombuffer(text.encode("utf-8"), np.uint8) if text is not None
                  else corpus_bytes())
        return preset_model(model_name), tokens.astype(np.int32), None, ByteTokenizer()

    model, tokenizer = load_model(model_name)
    if tokenizer is None:
        raise ValueError(f"model={model_name}: no tokenizer found next to the checkpoint; "
                         "pass a folder with tokenizer.json or a .gguf file.")
    if text is None:
        from lowrank_jax.data import corpus_text

        text = corpus_text()[:200_000]
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    name = SMOLLM2_HF_NAME if model_name == "smollm2" else str(model_name)
    return model, tokens, name, tokenizer


__all__ = ["FinetuneResult", "FINETUNE_METHODS", "TokenBatches", "export_adapter", "finetune",
           "load_model_and_tokens", "save_merged", "token_batches"]
