"""HuggingFace-style Llama checkpoints (``config.json`` + ``*.safetensors``) in and out of NNX.

A folder written by ``transformers`` for ``LlamaForCausalLM`` holds ``config.json`` and either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Weights are stored in
torch's ``[out, in]`` layout; our ``nnx.Linear`` kernels are ``[in, out]``, so every projection is
transposed on the way in and out:

.. math:: \\text{kernel} = W_{\\text{torch}}^\\top, \\qquad y = x\\,\\text{kernel} = x W^\\top.

The Q/K rows are in HF's "rotate half" order here, which is what
:func:`lowrank_jax.models.llama.apply_rope` expects (GGUF files differ; see ``gguf.py``).
The helpers :func:`config_from_hf` and :func:`llama_from_state_dict` are shared with the GGUF
loader: both formats go through one HF-named dictionary of numpy arrays.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.models.llama import DecoderLayer, Llama, LlamaConfig
from lowrank_jax.nn.lora import LoRALinear
from lowrank_jax.nn.projection import dense_matrix

from lowrank_jax.models.families import (  # noqa: F401  (re-exported: the loaders' API)
    SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf, fuse_for_family, hf_tensor_names,
    split_fused, text_tensors)

# Tensors a checkpoint may carry that the model recomputes (safe to ignore).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    return hf_tensor_names(cfg)


def _parameter_map(model: Llama):
    """``(HF name, variable holder, attribute, transpose)`` for every tensor of ``model``."""
    out = [("model.embed_tokens.weight", model.embed_tokens, "embedding", False),
           ("model.norm.weight", model.norm, "weight", False)]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            if hasattr(layer, name):
                out.append((p + name + ".weight", getattr(layer, name), "weight", False))
        attn = layer.self_attn
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name):
                out.append((p + f"self_attn.{name}.weight", getattr(attn, name), "weight", False))
        for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                linear = getattr(getattr(layer, block), name)
                out.append((p + f"{block}.{name}.weight", linear, "kernel", True))
                if getattr(linear, "bias", None) is not None:
                    out.append((p + f"{block}.{name}.bias", linear, "bias", False))
    if model.lm_head is not None:
        out.append(("lm_head.weight", model.lm_head, "kernel", True))
    return out


def abstract_llama(cfg: LlamaConfig) -> Llama:
    """A :class:`Llama` whose variables hold ``jax.ShapeDtypeStruct`` placeholders (no init).

    Only one decoder layer is traced with ``nnx.eval_shape``; the others are structural copies
    (``nnx.merge`` of its graph with a fresh copy of its abstract state), so building the shell of
    a 30-layer model costs about as much as one layer.
    """
    empty = dataclasses.replace(cfg, n_layers=0, layer_types=None, attention="reference")
    shell = nnx.eval_shape(lambda: Llama(empty, rngs=nnx.Rngs(0)))
    shell.cfg = cfg
    layer = nnx.eval_shape(lambda: DecoderLayer(cfg, rngs=nnx.Rngs(0)))
    graph, state = nnx.split(layer)
    shell.layers = nnx.List(
        [nnx.merge(graph, jax.tree.map(lambda x: x, state)) for _ in range(cfg.n_layers)]
    )
    return shell


def llama_from_state_dict(
    cfg: LlamaConfig, tensors: Mapping[str, np.ndarray], *, source: str = "checkpoint"
) -> Llama:
    """Build a dense :class:`Llama` whose weights are the HF-named ``tensors``.

    The model is created abstractly (``nnx.eval_shape``: no random init of 100M+ parameters)
    and every variable is filled from ``tensors``; projections are transposed from torch's
    ``[out, in]`` to our ``[in, out]``.

    Args:
        cfg: architecture (``projection`` must be ``"dense"``; factorize afterwards).
        tensors: HF names (``model.layers.0.self_attn.q_proj.weight`` ...) to arrays (or
            callables returning arrays, evaluated lazily one at a time to bound memory).
        source: named in error messages.

    Returns:
        The loaded model, parameters in ``cfg.param_dtype``.

    Example::

        >>> import numpy as np
        >>> from flax import nnx
        >>> cfg = LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2,
        ...                   d_ff=16)
        >>> m = Llama(cfg, rngs=nnx.Rngs(0))
        >>> m2 = llama_from_state_dict(cfg, state_dict_from_llama(m))
        >>> bool((m2.norm.weight[...] == m.norm.weight[...]).all())
        True
    """
    if cfg.projection != "dense":
        raise ValueError(
            f"llama_from_state_dict: cfg.projection={cfg.projection!r}; load dense, then "
            "factorize with lowrank_jax.hub.factorize_projections."
        )
    expected = _expected_shapes(cfg)
    tensors = split_fused(cfg, text_tensors(tensors), source=source)
    extra = [
        k for k in tensors
        if k not in expected and not k.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and k == "lm_head.weight")
    ]
    if extra:
        raise ValueError(
            f"{source}: unexpected tensors {sorted(extra)[:4]} (total {len(extra)}) for a "
            f"{cfg.family} model with this config: config and checkpoint disagree (biases? "
            "norms? another architecture?)."
        )
    pdt = jnp.dtype(cfg.param_dtype)
    model = abstract_llama(cfg)

    def fetch(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing; the checkpoint is incomplete.")
        value = tensors[name]
        value = value() if callable(value) else value
        if tuple(value.shape) != expected[name]:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, expected "
                f"{expected[name]} from the config; config and weights do not match."
            )
        value = np.asarray(value, np.float32)
        if not np.isfinite(value).all():
            raise ValueError(
                f"{source}: tensor {name!r} holds non-finite values (NaN or inf, "
                f"{int((~np.isfinite(value)).sum())} of {value.size}); the checkpoint is "
                "corrupt or was saved after a diverged step.")
        return value

    for name, holder, attribute, transpose in _parameter_map(model):
        value = fetch(name)
        getattr(holder, attribute).set_value(jnp.asarray(value.T if transpose else value,
                                                         dtype=pdt))
    return model


def state_dict_from_llama(model: Llama) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (torch ``[out, in]`` layout, projections unfused) for ``model``.

    Factorized projections are exported as their product ``a @ b`` and LoRA projections with
    the adapter merged in, so any variant saves as its family's plain HF model.
    """
    out = {}
    for name, holder, attribute, transpose in _parameter_map(model):
        if attribute == "kernel":  # [in, out]: a @ b of a factorized one, else the kernel
            weight = dense_matrix(holder)
            if isinstance(holder, LoRALinear):  # in the kernel's dtype, the adapter merged in
                dtype = holder.kernel[...].dtype
                weight = weight.astype(dtype)
                if not holder.merged:  # a merged kernel holds the delta already
                    weight = weight + holder.delta().astype(dtype)
            out[name] = np.ascontiguousarray(np.asarray(weight).T)
        else:
            out[name] = np.asarray(getattr(holder, attribute)[...])
    return out


def save_hf_checkpoint(model: Llama, folder: str | os.PathLike, *, tokenizer=None) -> str:
    """Write ``model`` as its family's HF folder (config.json + model.safetensors).

    ``model.cfg.family`` names the HF class (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ...);
    Phi-3's projections are fused back into ``qkv_proj`` / ``gate_up_proj``.

    Args:
        model: a :class:`Llama` (dense, factorized or with LoRA: exported as dense weights).
        folder: output directory (created).
        tokenizer: optional tokenizer with a ``save(folder)`` method (writes tokenizer.json).

    Returns:
        The folder path.

    Example::

        >>> import tempfile
        >>> from flax import nnx
        >>> cfg = LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2,
        ...                   d_ff=16)
        >>> path = save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0)), tempfile.mkdtemp())
        >>> load_hf_checkpoint(path).cfg.d_model
        8
    """
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_to_hf(model.cfg), f, indent=2)
    tensors = fuse_for_family(model.cfg, state_dict_from_llama(model))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(folder)
    return str(folder)


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{index}: not a valid safetensors index ({err}).") from None
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files next to config.json.")
    return [os.path.join(folder, name) for name in files]


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as numpy arrays (clear error if corrupt)."""
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: safetensors shard is missing.")
    try:
        out = {}
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
        return out
    except Exception as err:  # SafetensorError, OSError, ...: one clear line
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"{path}: not a readable safetensors file (truncated or corrupt: {msg})."
        ) from None


def load_hf_checkpoint(
    folder: str | os.PathLike, *, dtype: str = "float32", attention: str = "reference"
) -> Llama:
    """Load a HF folder of a supported family (``config.json`` + one or sharded
    ``*.safetensors``; see :mod:`lowrank_jax.models.families`).

    Args:
        folder: the checkpoint directory.
        dtype: parameter and compute dtype, ``"float32"`` or ``"bfloat16"``.
        attention: attention implementation name (see :mod:`lowrank_jax.attention`).

    Returns:
        A dense :class:`Llama`.

    Example::

        >>> model = load_hf_checkpoint("path/to/llama")  # doctest: +SKIP
    """
    folder = os.fspath(folder)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder}: no config.json; not a HF checkpoint folder.")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except ValueError as err:
        raise ValueError(f"{config_path}: invalid JSON ({err}).") from None
    cfg = config_from_hf(hf, source=config_path)
    cfg.dtype = cfg.param_dtype = check_load_dtype(dtype)
    cfg.attention = attention
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(folder):
        tensors.update(read_safetensors(path))
    tensors = text_tensors(tensors)
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
        cfg.tie_embeddings = True  # save_pretrained drops lm_head.weight when tied
    return llama_from_state_dict(cfg, tensors, source=folder)


def check_load_dtype(dtype: str) -> str:
    """``dtype`` if a checkpoint can be loaded in it (``"float32"`` or ``"bfloat16"``), else a
    ``ValueError`` that names the two choices (shared by the safetensors and GGUF loaders)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not supported; use 'float32' or 'bfloat16'.")
    return dtype


__all__ = [
    "abstract_llama",
    "check_load_dtype",
    "config_from_hf",
    "config_to_hf",
    "llama_from_state_dict",
    "load_hf_checkpoint",
    "read_safetensors",
    "save_hf_checkpoint",
    "state_dict_from_llama",
]
