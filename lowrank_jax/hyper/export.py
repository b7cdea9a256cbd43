"""A generated Doc-to-LoRA adapter as a PEFT LoRA folder, and hypernetwork weights on disk.

PEFT scales an adapter by ``lora_alpha / r``; D2L applies ``s = 2 r^{3/2}`` directly to a rank
``R = (C + 1) r`` adapter, so the export writes ``r = R`` and ``lora_alpha = s · R``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.hyper.doc_to_lora import DocToLoRA, DocToLoRAConfig, LoRABank
from lowrank_jax.runs.outputs import atomic_write_text
from lowrank_jax.io.peft import export_peft
from lowrank_jax.nn.inject import LoRARule, apply_lora, lora_layers, remove_lora

HYPER_CONFIG = "doc_to_lora.json"
HYPER_WEIGHTS = "weights"


def export_generated_adapter(model, bank: LoRABank, config: DocToLoRAConfig, folder, *,
                   base_model_name_or_path: str | None = None, doc: int = 0) -> dict:
    """Write document ``doc`` of ``bank`` as a PEFT adapter folder for ``model``.

    The model is left unchanged (its projections get :class:`~lowrank_jax.nn.LoRALinear`
    wrappers for the export, removed afterwards without merging).

    Returns:
        The PEFT config dict that was written.

    Raises:
        ValueError: the model already has LoRA layers, or the total rank exceeds what a
            ``[d_in, d_out]`` projection can hold (use fewer / longer chunks).
    """
    if lora_layers(model):
        raise ValueError("export_generated_adapter: the model already has LoRA layers; export "
                         "from the plain base model (lowrank_jax.nn.remove_lora first).")
    rank = int(bank.a.shape[2])
    limit = min(config.d_in, config.d_out)
    if rank > limit:
        raise ValueError(f"export_generated_adapter: the adapter has rank {rank} (chunks + bias) "
                         f"but {config.target} is [{config.d_in}, {config.d_out}]; at most {limit} "
                         "fits. Use fewer, longer chunks (a larger chunk_len).")
    rules = [LoRARule("^" + re.escape(p) + "$", rank=rank, alpha=config.scale * rank)
             for p in config.paths]
    apply_lora(model, rules, rngs=nnx.Rngs(0))
    try:
        layers = dict(lora_layers(model))
        for i, path in enumerate(config.paths):
            layer = layers[path]
            layer.lora_a[...] = jnp.asarray(bank.a[doc, i].T, layer.param_dtype)
            layer.lora_b[...] = jnp.asarray(bank.b[doc, i], layer.param_dtype)
        return export_peft(model, folder, base_model_name_or_path=base_model_name_or_path)
    finally:
        remove_lora(model, merge=False)


def save_hypernetwork(hyper: DocToLoRA, folder) -> pathlib.Path:
    """Write ``hyper``'s config (JSON) and weights (orbax) into ``folder``."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / HYPER_WEIGHTS
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(weights, nnx.state(hyper, nnx.Param), force=True)
    checkpointer.wait_until_finished()
    atomic_write_text(folder / HYPER_CONFIG,
                      json.dumps(dataclasses.asdict(hyper.config), indent=1))
    return folder


def load_hypernetwork(folder) -> DocToLoRA:
    """Read a hypernetwork written by :func:`save_hypernetwork` (or a training run folder that
    holds one under ``hypernetwork/``)."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    if not (folder / HYPER_CONFIG).is_file() and (folder / "hypernetwork" / HYPER_CONFIG).is_file():
        folder = folder / "hypernetwork"
    config_path = folder / HYPER_CONFIG
    if not config_path.is_file():
        raise ValueError(f"hyper={folder}: no {HYPER_CONFIG} there; pass a folder written by "
                         "lowrank_jax.hyper.save_hypernetwork or train_doc_to_lora(run_dir=...).")
    try:
        config = DocToLoRAConfig(**json.loads(config_path.read_text()))
    except (ValueError, TypeError) as error:
        raise ValueError(f"hyper={config_path}: not a Doc-to-LoRA config ({error}).") from None
    hyper = DocToLoRA(config, rngs=nnx.Rngs(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            nnx.state(hyper, nnx.Param))
    try:
        restored = ocp.StandardCheckpointer().restore(folder / HYPER_WEIGHTS, abstract)
    except Exception as error:  # noqa: BLE001 - any orbax failure means unreadable weights
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"hyper={folder}: cannot read the weights ({first}); save the "
                         "hypernetwork again.") from None
    nnx.update(hyper, restored)
    return hyper


def adapter_bytes(bank: LoRABank, dtype=np.float32) -> int:
    """Bytes of one document's adapter (``A`` and ``B`` of every layer)."""
    per_doc = int(np.prod(bank.a.shape[1:])) + int(np.prod(bank.b.shape[1:]))
    return per_doc * np.dtype(dtype).itemsize


def kv_cache_bytes(model_config, n_tokens: int, dtype=np.float32) -> int:
    """Bytes of the exact KV cache that keeping ``n_tokens`` of context costs."""
    c = model_config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * int(n_tokens) * np.dtype(dtype).itemsize


__all__ = ["HYPER_CONFIG", "adapter_bytes", "export_generated_adapter", "kv_cache_bytes",
           "load_hypernetwork", "save_hypernetwork"]
