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
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.models.llama import DecoderLayer, Llama, LlamaConfig

# Names of the per-layer tensors in HF's LlamaForCausalLM (torch layout [out, in]).
_LAYER_LINEARS = {
    "self_attn.q_proj": ("self_attn", "q_proj"),
    "self_attn.k_proj": ("self_attn", "k_proj"),
    "self_attn.v_proj": ("self_attn", "v_proj"),
    "self_attn.o_proj": ("self_attn", "o_proj"),
    "mlp.gate_proj": ("mlp", "gate_proj"),
    "mlp.up_proj": ("mlp", "up_proj"),
    "mlp.down_proj": ("mlp", "down_proj"),
}
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
# Tensors a checkpoint may carry that the model recomputes (safe to ignore).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SUPPORTED_MODEL_TYPES = ("llama",)


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> LlamaConfig:
    """Translate a HF ``LlamaConfig`` dictionary into our :class:`LlamaConfig`.

    Args:
        hf: the parsed ``config.json``.
        source: where it came from (named in error messages).

    Returns:
        A dense :class:`LlamaConfig` in float32.

    Example::

        >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
        ...     "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32})
        >>> cfg.n_kv_heads, cfg.head_dim
        (2, 8)
    """
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES and "LlamaForCausalLM" not in archs:
        raise ValueError(
            f"{source}: model_type={model_type!r} (architectures={archs}) is not Llama-family; "
            f"only {SUPPORTED_MODEL_TYPES} checkpoints (LlamaForCausalLM) can be loaded."
        )
    scaling = hf.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise ValueError(
            f"{source}: rope_scaling={scaling} is not supported; only plain RoPE "
            "(rope_scaling=null) checkpoints load."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{source}: {flag}=true is not supported (the model has no biases).")
    try:
        n_heads = int(hf["num_attention_heads"])
        d_model = int(hf["hidden_size"])
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise ValueError(f"{source}: required field {err.args[0]!r} is missing.") from None


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """The HF ``config.json`` dictionary for ``cfg`` (inverse of :func:`config_from_hf`)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": cfg.param_dtype,
    }


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, hd, ff = cfg.d_model, cfg.head_dim, cfg.d_ff
    per_layer = {
        "self_attn.q_proj": (cfg.n_heads * hd, d),
        "self_attn.k_proj": (cfg.n_kv_heads * hd, d),
        "self_attn.v_proj": (cfg.n_kv_heads * hd, d),
        "self_attn.o_proj": (d, cfg.n_heads * hd),
        "mlp.gate_proj": (ff, d),
        "mlp.up_proj": (ff, d),
        "mlp.down_proj": (d, ff),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
        for norm in _LAYER_NORMS:
            shapes[f"model.layers.{i}.{norm}.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def abstract_llama(cfg: LlamaConfig) -> Llama:
    """A :class:`Llama` whose variables hold ``jax.ShapeDtypeStruct`` placeholders (no init).

    Only one decoder layer is traced with ``nnx.eval_shape``; the others are structural copies
    (``nnx.merge`` of its graph with a fresh copy of its abstract state), so building the shell of
    a 30-layer model costs about as much as one layer.
    """
    shell = nnx.eval_shape(lambda: Llama(dataclasses.replace(cfg, n_layers=0), rngs=nnx.Rngs(0)))
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
    extra = [
        k for k in tensors
        if k not in expected and not k.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and k == "lm_head.weight")
    ]
    if extra:
        raise ValueError(
            f"{source}: unexpected tensors {sorted(extra)[:4]} (total {len(extra)}) for a "
            "Llama model: the checkpoint is not a plain LlamaForCausalLM (biases? another "
            "architecture?)."
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
        return value

    def put(variable, array: np.ndarray) -> None:
        variable.set_value(jnp.asarray(np.asarray(array, np.float32), dtype=pdt))

    put(model.embed_tokens.embedding, fetch("model.embed_tokens.weight"))
    put(model.norm.weight, fetch("model.norm.weight"))
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for norm in _LAYER_NORMS:
            put(getattr(layer, norm).weight, fetch(prefix + norm + ".weight"))
        for name, (block, proj) in _LAYER_LINEARS.items():
            put(getattr(getattr(layer, block), proj).kernel, fetch(prefix + name + ".weight").T)
    if not cfg.tie_embeddings:
        put(model.lm_head.kernel, fetch("lm_head.weight").T)
    return model


def _dense_kernel(linear) -> np.ndarray:
    """``[in, out]`` weight of a dense, LoRA (merged view) or factorized projection."""
    from lowrank_jax.nn.factorized import FactorizedLinear
    from lowrank_jax.nn.lora import LoRALinear

    if isinstance(linear, FactorizedLinear):
        return np.asarray(linear.dense_matrix())
    if isinstance(linear, LoRALinear) and not linear.merged:  # a merged kernel holds the delta
        return np.asarray(linear.kernel[...] + linear.delta().astype(linear.kernel[...].dtype))
    return np.asarray(linear.kernel[...])


def state_dict_from_llama(model: Llama) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (torch ``[out, in]`` layout) for ``model``.

    Factorized projections are exported as their product ``a @ b`` and LoRA projections with
    the adapter merged in, so any variant saves as a plain ``LlamaForCausalLM``.
    """
    out = {
        "model.embed_tokens.weight": np.asarray(model.embed_tokens.embedding[...]),
        "model.norm.weight": np.asarray(model.norm.weight[...]),
    }
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for norm in _LAYER_NORMS:
            out[prefix + norm + ".weight"] = np.asarray(getattr(layer, norm).weight[...])
        for name, (block, proj) in _LAYER_LINEARS.items():
            kernel = _dense_kernel(getattr(getattr(layer, block), proj))
            out[prefix + name + ".weight"] = np.ascontiguousarray(kernel.T)
    if model.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(_dense_kernel(model.lm_head).T)
    return out


def save_hf_checkpoint(model: Llama, folder: str | os.PathLike, *, tokenizer=None) -> str:
    """Write ``model`` as a HF ``LlamaForCausalLM`` folder (config.json + model.safetensors).

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
    tensors = state_dict_from_llama(model)
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
    """Load a HF Llama folder (``config.json`` + one or sharded ``*.safetensors``).

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
