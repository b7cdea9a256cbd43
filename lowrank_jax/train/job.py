"""One fine-tuning job, whole: the application behind ``lowrank-jax finetune``.

:class:`FinetuneJob` holds the settings of a run with the CLI's defaults (a test keeps them
equal) and :meth:`FinetuneJob.run` does all of it: load the model and the text, claim the output
folders, quantize the base (QLoRA), probe the model for a rank plan (CSPLoRA), train the
adapters (:func:`lowrank_jax.train.finetune.finetune`), export them in PEFT format, optionally
save the merged model, and write ``summary.json`` and ``losses.json``.

Messages name the fields (``batch_size=0: ...``); the CLI shows them as its flags
(``--batch-size 0: ...``).

Several processes (``mesh=`` spanning them): every process builds the same job and calls
:meth:`~FinetuneJob.run`; files are written once, by process 0, and only process 0 gets a
summary.

Example::

    >>> import tempfile
    >>> job = FinetuneJob(model="tiny", steps=2, batch_size=2, seq_len=16, rank=2,
    ...                   out=tempfile.mkdtemp(), progress=False)  # doctest: +SKIP
    >>> result = job.run(log=None)                                  # doctest: +SKIP
    >>> result.summary["final_loss"] < result.summary["first_loss"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import numpy as np

from lowrank_jax.quantize.qlora_base import QUANTIZE_METHODS as QUANTIZE
from lowrank_jax.train.finetune import FINETUNE_METHODS, FinetuneResult, default_lr

# methods that keep the base weights as they are (PiSSA, OLoRA, Gap-Init rewrite them, which a
# quantized base cannot hold)
QUANTIZABLE_METHODS = ("lora", "balora", "lokra")
# the batches the rank plan probes the base with (drawn apart from the training steps)
PROBE_BATCHES, PROBE_OFFSET = 8, 10_000_000


@dataclasses.dataclass
class JobResult:
    """What :meth:`FinetuneJob.run` returns.

    Attributes:
        result: the training's :class:`~lowrank_jax.train.finetune.FinetuneResult`.
        adapter: the PEFT adapter folder (``out/adapter``).
        summary: what ``summary.json`` holds (``None`` on processes other than 0).
        lr: the learning rate used (the method's default when ``lr`` was ``None``).
        saved_base, saved_merged: the folders written for ``save_base`` / ``save_merged``.
    """

    result: FinetuneResult
    adapter: str
    summary: dict[str, Any] | None
    lr: float
    saved_base: str | None = None
    saved_merged: str | None = None


def _positive_int(name: str, value, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer, e.g. {name}={example}.")


def _number(name: str, value, *, low: float, strict: bool, example: float) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.floating))
          and math.isfinite(value) and (value > low if strict else value >= low))
    if not ok:
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"{name}={value!r}: must be a finite number {bound}, e.g. "
                         f"{name}={example:g}.")


@dataclasses.dataclass(frozen=True)
class FinetuneJob:
    """LoRA-family fine-tuning of one model, with the defaults of ``lowrank-jax finetune``.

    Attributes:
        model: ``"tiny"`` (a small random byte-level Llama), ``"smollm2"``, a ``.gguf`` file or
            a model folder (a quantized folder needs no ``quantize``).
        quantize: QLoRA, the base quantized first: ``"nf4"``, ``"rtn4"`` or ``"unisvq2"``
            (``None``: as loaded). Only ``lora``, ``balora`` and ``lokra`` combine with it, and
            not ``rank_plan``.
        save_base: with ``quantize``, also write the quantized base to this folder (loadable
            as ``model`` later).
        data: a UTF-8 text file to train on (``None``: the embedded corpus).
        method: ``lora``, ``balora``, ``pissa``, ``olora``, ``gap`` or ``lokra``.
        rank_plan: CSPLoRA: probe the base and give each module its own rank, under the
            parameter budget of a uniform ``rank``.
        rank, alpha: LoRA rank and alpha (scale ``alpha / rank``).
        steps, lr: AdamW steps and learning rate (``lr=None``: :func:`default_lr` of
            ``method``).
        batch_size, seq_len: windows per step and tokens per window.
        targets: regex on module paths such as ``layers/3/self_attn/q_proj``.
        lokra_lambda: weight of the Kruskal-rank penalty (``method="lokra"``).
        seed: adapter init and batch order.
        out: the output folder (``adapter/``, ``summary.json``, ``losses.json``).
        progress: show a progress bar.
        overwrite: write into an output folder that is not empty or holds another run.
        mesh: a device mesh, ``"data=2,fsdp=4"`` or a :class:`jax.sharding.Mesh`
            (``None``: one device).
        save_merged: also save the model with the adapters merged into its weights there.
    """

    model: str = "tiny"
    quantize: str | None = None
    save_base: str | None = None
    data: str | None = None
    method: str = "lora"
    rank_plan: bool = False
    rank: int = 8
    alpha: float = 16.0
    steps: int = 100
    lr: float | None = None
    batch_size: int = 4
    seq_len: int = 64
    targets: str = r"(q|v)_proj"
    lokra_lambda: float = 1e-3
    seed: int = 0
    out: str = "runs/finetune"
    progress: bool = True
    overwrite: bool = False
    mesh: Any = None
    save_merged: str | None = None

    def __post_init__(self):
        from lowrank_jax.runs.validate import check_regex

        if self.method not in FINETUNE_METHODS:
            raise ValueError(f"method={self.method!r}: unknown; use one of "
                             f"{', '.join(FINETUNE_METHODS)}.")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize={self.quantize!r}: unknown; use one of "
                             f"{', '.join(QUANTIZE)} (or None).")
        for name, example in (("rank", 8), ("steps", 100), ("batch_size", 8), ("seq_len", 64)):
            _positive_int(name, getattr(self, name), example)
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: must be an integer >= 0, e.g. seed=0.")
        _number("alpha", self.alpha, low=0, strict=True, example=16)
        _number("lokra_lambda", self.lokra_lambda, low=0, strict=False, example=1e-3)
        if self.lr is not None:
            _number("lr", self.lr, low=0, strict=True, example=1e-3)
        check_regex(self.targets, "`targets`")
        if self.save_base and not self.quantize:
            raise ValueError("`save_base` writes the quantized base; it needs `quantize` "
                             "nf4|rtn4|unisvq2.")
        if self.quantize and self.rank_plan:
            raise ValueError("`rank_plan` probes the dense linear layers, which `quantize` "
                             "replaces; drop one of them.")
        if self.quantize and self.method not in QUANTIZABLE_METHODS:
            raise ValueError(f"`method` {self.method} rewrites the base weights; with `quantize` "
                             f"use {', '.join(QUANTIZABLE_METHODS[:-1])} or "
                             f"{QUANTIZABLE_METHODS[-1]}.")

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default of ``method`` when ``lr`` is ``None``."""
        return self.lr if self.lr is not None else default_lr(self.method)

    def run(self, *, log: Callable[[str], object] | None = print) -> JobResult:
        """Train and export; see the module docstring. ``log`` gets the lines a user reads
        (the results on process 0 only; ``None``: silent)."""
        from lowrank_jax.runs.outputs import atomic_write_text, prepare_output, staged_folder
        from lowrank_jax.runs.validate import check_text_file
        from lowrank_jax.train import multihost
        from lowrank_jax.train.finetune import (
            export_adapter,
            finetune,
            load_model_and_tokens,
            token_batches,
        )

        say = (lambda line: None) if log is None else log  # noqa: E731
        mesh = self.device_mesh()
        check_text_file(self.data, "`data`")
        reads = {"`model`": self.model, "`data`": self.data}
        multihost.on_main_process(  # files are written once, by process 0
            lambda: prepare_output(self.out, command="finetune", argument="`out`",
                                   overwrite=self.overwrite, reads=reads),
            what="checking `out`")
        for name in ("save_base", "save_merged"):  # extra outputs: the same rule as out
            folder = getattr(self, name)
            if folder:
                extra = {**reads, "`out`": self.out}
                multihost.on_main_process(
                    lambda folder=folder, name=name, extra=extra: prepare_output(
                        folder, command="finetune", argument=f"`{name}`",
                        overwrite=self.overwrite, reads=extra),
                    what=f"checking `{name}`")
        lr = self.learning_rate
        model, tokens, base_name, tokenizer = load_model_and_tokens(self.model, self.data)
        if self.quantize:
            from lowrank_jax.hub import save_model
            from lowrank_jax.quantize import quantize_base

            quantize_base(model, self.quantize)
            if self.save_base:
                with staged_folder(self.save_base) as tmp:  # all or nothing
                    save_model(model, tmp, tokenizer=tokenizer)
                say(f"quantized base: {self.save_base}")
        if len(tokens) < self.seq_len + 2:
            raise ValueError(f"`data` has {len(tokens)} tokens, fewer than `seq_len` + 2 = "
                             f"{self.seq_len + 2}; pass more text or a smaller `seq_len`.")
        batch_fn = token_batches(tokens, self.batch_size, self.seq_len, self.seed)
        ranks, scores = self._rank_plan(model, batch_fn)
        result = finetune(model, batch_fn, method=self.method, targets=self.targets,
                          rank=self.rank, alpha=self.alpha, steps=self.steps, lr=lr,
                          seed=self.seed, ranks=ranks, lokra_lambda=self.lokra_lambda,
                          progress=self.progress, description=f"finetune {self.method}",
                          mesh=mesh)
        adapter_dir = os.path.join(self.out, "adapter")
        config = export_adapter(model, adapter_dir,  # a preset's name: model=ADAPTER loads it
                                base_model_name_or_path=base_name or self.model,
                                initial_adapters=result.initial_adapters or None)
        main = multihost.is_main_process()  # export_adapter returns the config on process 0
        summary = None
        if main:  # the trained work is on disk before any last step that may fail
            summary = {
                "model": self.model, "method": self.method, "steps": self.steps, "lr": lr,
                "rank": self.rank, "alpha": self.alpha, "targets": self.targets,
                "first_loss": result.losses[0],
                "final_loss": float(np.mean(result.losses[-10:])),
                "seconds": result.seconds, "adapted_modules": len(result.adapted),
                "ranks": result.ranks, "probe_scores": scores, "peft_r": config["r"],
                "quantize": self.quantize, "memory_bytes": result.memory,
            }
            atomic_write_text(os.path.join(self.out, "summary.json"),
                              json.dumps(summary, indent=2))
            atomic_write_text(os.path.join(self.out, "losses.json"), json.dumps(result.losses))
            say(f"{self.method}: loss {result.losses[0]:.4f} -> {summary['final_loss']:.4f} "
                f"(mean of the last 10 steps) in {self.steps} steps, {result.seconds:.1f} s; "
                f"{len(result.adapted)} modules adapted")
            say(f"PEFT adapter: {adapter_dir} (load with peft.PeftModel.from_pretrained)")
        if self.save_merged:  # PiSSA / OLoRA: the residual base plus the adapter, the tuned W
            self._save_merged(model, adapter_dir, tokenizer)
            if main:
                say(f"merged model: {self.save_merged} (a model folder that generate, eval "
                    "and finetune load)")
        return JobResult(result, adapter_dir, summary, lr, self.save_base, self.save_merged)

    __call__ = run

    def device_mesh(self):
        """:func:`device_mesh` of ``mesh``."""
        return device_mesh(self.mesh)

    def _rank_plan(self, model, batch_fn):
        """CSPLoRA's ``(ranks, scores)`` from probe batches, or ``(None, None)``."""
        if not self.rank_plan:
            return None, None
        import jax.numpy as jnp

        from lowrank_jax.nn.rank_plan import plan_ranks

        probe = [tuple(jnp.asarray(a) for a in batch_fn(PROBE_OFFSET + i))
                 for i in range(PROBE_BATCHES)]
        return plan_ranks(model, probe, targets=self.targets, average_rank=self.rank,
                          r_min=max(1, self.rank // 4), r_max=4 * self.rank)

    def _save_merged(self, model, adapter_dir: str, tokenizer) -> None:
        """Write ``save_merged`` (weights + the base's tokenizer) all or nothing; on a failure
        say that the adapter is kept and how to merge it later (a full disk: ``ValueError``;
        anything else: ``RuntimeError``)."""
        from lowrank_jax.runs.outputs import describe_os_error, os_error_of, staged_folder
        from lowrank_jax.train import multihost
        from lowrank_jax.train.finetune import save_merged

        try:
            if multihost.is_main_process():
                with staged_folder(self.save_merged) as tmp:
                    save_merged(model, tmp)
                    if tokenizer is not None:  # model=DIR needs it (generate, eval)
                        tokenizer.save(tmp)
            else:
                save_merged(model, self.save_merged)  # the gather; process 0 writes
        except Exception as error:
            quantize = f" --quantize {self.quantize}" if self.quantize else ""
            kept = (f"the adapter and summary.json are saved in {self.out}; merge later with "
                    f"`lowrank-jax merge --model {self.model}{quantize} --adapter {adapter_dir} "
                    f"--to fp --out MERGED`")
            io_error = os_error_of(error)
            if io_error is not None:
                raise ValueError(f"save_merged={self.save_merged}: not written "
                                 f"({describe_os_error(io_error).rstrip('.')}); {kept}."
                                 ) from error
            reason = str(error).splitlines()[0] if str(error) else ""
            raise RuntimeError(f"save_merged={self.save_merged}: not written "
                               f"({type(error).__name__}: {reason}); {kept}.") from error


def device_mesh(mesh):
    """The :class:`jax.sharding.Mesh` of ``mesh`` (``"data=2,fsdp=4"``, a mesh, or ``None``
    for one device), after joining the other processes if any
    (:func:`lowrank_jax.train.sharding.maybe_initialize_distributed`)."""
    from lowrank_jax.train import sharding

    sharding.maybe_initialize_distributed()
    if mesh is None or mesh == "":
        return None
    if not isinstance(mesh, str):
        return mesh
    sizes = sharding.parse_mesh(mesh)
    return sharding.make_mesh(sizes["data"], sizes["fsdp"], sizes["tensor"])


__all__ = ["FinetuneJob", "JobResult", "QUANTIZE", "QUANTIZABLE_METHODS", "device_mesh"]
