"""Quantize every projection of a :class:`~lowrank_jax.models.llama.Llama`, layer by layer.

``quantize_model`` walks the decoder blocks in order. For each block it runs the FP block on the
FP activations entering it (captured from the model's own forward), accumulates the input Hessian
``E[x xᵀ]`` of each projection, replaces the 7 projections by :class:`QuantizedLinear`
(UniSVQ) or :class:`RTNLinear`, and (UniSVQ) fine-tunes the float parameters on the block output
error. ``save_quantized`` / ``load_quantized`` write and read a self-contained folder.

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.models.llama import PROJECTIONS, Llama, LlamaConfig
from lowrank_jax.quant.packing import rtn_bits_per_weight, unisvq_bits_per_weight
from lowrank_jax.quant.rtn import (
    RTNWeight,
    check_bits,
    check_group_size,
    rtn_dequantize,
    rtn_from_arrays,
    rtn_quantize,
    rtn_to_arrays,
)
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    UniSVQWeight,
    finetune_block,
    initial_lattice,
    quantize_linear,
)
from pallas_kernels.lattice_matmul.api import lattice_matmul

METHODS = ("unisvq", "rtn", "kmeans")
UNISVQ_BITS = (2,)
FORMAT_VERSION = 1
_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class QuantCodes(nnx.Variable):
    """Frozen integer codes of a quantized layer (never trained)."""


class QuantScale(nnx.Param):
    """Per-channel float scales ``s_in`` / ``s_out`` (fine-tuned, lr ``lr_scale``)."""


class LatticeParam(nnx.Param):
    """The lattice transform ``A [4,4]`` and ``b [4]`` (fine-tuned, lr ``lr_affine``)."""


class QuantizedLinear(nnx.Module):
    """A bias-free linear layer whose weight is UniSVQ-quantized; ``y = x Wᵀ`` via the kernel API.

    .. math::
        W = \\mathrm{diag}(s_{out}) H_m^\\top C H_n \\mathrm{diag}(s_{in}),\\quad
        C_{i,4g:4g+4} = A z_{i,g} + b

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from lowrank_jax.quant.unisvq import quantize_linear, UniSVQConfig
        >>> w = quantize_linear(jax.random.normal(jax.random.PRNGKey(0), (8, 16)), None,
        ...                     UniSVQConfig(hadamard_block=8))
        >>> QuantizedLinear.from_weight(w)(jnp.ones((2, 16))).shape
        (2, 8)

    Args:
        weight: a :class:`UniSVQWeight` (``[out, in]``).
        mode: ``"fold"`` or ``"dequant"`` (see ``pallas_kernels.lattice_matmul``).
        implementation: ``"auto"`` | ``"pallas"`` | ``"xla"``.
    """

    def __init__(self, weight: UniSVQWeight, *, mode: str = "fold",
                 implementation: str = "auto"):
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.block_in, self.block_out = int(weight.block_in), int(weight.block_out)
        self.mode, self.implementation = mode, implementation
        self.codes = QuantCodes(jnp.asarray(weight.codes, jnp.uint8))
        self.scale_in = QuantScale(jnp.asarray(weight.scale_in, jnp.float32))
        self.scale_out = QuantScale(jnp.asarray(weight.scale_out, jnp.float32))
        self.affine = LatticeParam(jnp.asarray(weight.affine, jnp.float32))
        self.offset = LatticeParam(jnp.asarray(weight.offset, jnp.float32))

    @classmethod
    def from_weight(cls, weight: UniSVQWeight, **kwargs) -> "QuantizedLinear":
        return cls(weight, **kwargs)

    def weight(self) -> UniSVQWeight:
        return UniSVQWeight(self.codes[...], self.scale_in[...], self.scale_out[...],
                            self.affine[...], self.offset[...], self.block_in, self.block_out)

    def bits_per_weight(self) -> float:
        return unisvq_bits_per_weight(self.out_features, self.in_features)

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        return lattice_matmul(
            x, self.codes[...], self.scale_in[...], self.scale_out[...], self.affine[...],
            self.offset[...], block_in=self.block_in, block_out=self.block_out, mode=self.mode,
            implementation=self.implementation,
        )


class RTNLinear(nnx.Module):
    """A bias-free linear layer holding group-wise RTN codes; dequantizes on the fly (baseline)."""

    def __init__(self, weight: RTNWeight):
        self.out_features, self.in_features = (int(s) for s in weight.codes.shape)
        self.bits, self.group_size = int(weight.bits), int(weight.group_size)
        self.codes = QuantCodes(jnp.asarray(weight.codes, jnp.uint8))
        self.scale = QuantScale(jnp.asarray(weight.scale, jnp.float32))
        self.zero = QuantScale(jnp.asarray(weight.zero, jnp.float32))

    def weight(self) -> RTNWeight:
        return RTNWeight(self.codes[...], self.scale[...], self.zero[...], self.bits,
                         self.group_size)

    def bits_per_weight(self) -> float:
        return rtn_bits_per_weight(self.out_features, self.in_features, self.bits,
                                   self.group_size)

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        w = rtn_dequantize(self.weight())
        return jnp.einsum("...n,mn->...m", x.astype(jnp.float32), w).astype(x.dtype)


def _fp16(x):
    return jnp.asarray(x, jnp.float32).astype(jnp.float16).astype(jnp.float32)


def _round_floats_to_storage(layer: QuantizedLinear) -> None:
    """Round the float parameters to fp16, so memory holds exactly what the folder stores."""
    for name in ("scale_in", "scale_out", "affine", "offset"):
        getattr(layer, name).set_value(_fp16(getattr(layer, name)[...]))


class _Tap(nnx.Module):
    """Wraps a projection and adds ``Σ x xᵀ`` of its inputs to a Hessian accumulator."""

    def __init__(self, inner, sink: Callable[[Array], None]):
        self.inner = inner
        self.sink = sink

    def __call__(self, x):
        self.sink(x)
        return self.inner(x)


class _BlockApply:
    """Hashable ``(params, frozen, x) -> block(x)`` for one decoder-block structure, so the jitted
    fine-tuning step compiles once for all blocks with the same graph."""

    def __init__(self, graph):
        self.graph = graph

    def __hash__(self):  # GraphDef holds an unhashable LlamaConfig; equality decides
        return hash(type(self.graph).__name__)

    def __eq__(self, other):
        return isinstance(other, _BlockApply) and self.graph == other.graph

    def __call__(self, params, frozen, x):
        block = nnx.merge(self.graph, params[0], params[1], frozen)
        return block(x, _positions(x))[0]


def _scale_affine_labels(params):
    return (jax.tree.map(lambda _: "scale", params[0]),
            jax.tree.map(lambda _: "affine", params[1]))


def _positions(x: Array) -> Array:
    b, t = x.shape[:2]
    return jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))


def _block_forward(layer, x: Array, chunk: int) -> Array:
    outs = []
    for start in range(0, x.shape[0], chunk):
        xs = x[start:start + chunk]
        outs.append(layer(xs, _positions(xs))[0])
    return jnp.concatenate(outs, axis=0)


def _capture_hessians(layer, x: Array, chunk: int) -> tuple[Array, dict[str, Array]]:
    """FP block output and ``E[x xᵀ]`` (undamped) of the input of every projection."""
    sums: dict[str, list] = {}

    def make_sink(name):
        def sink(inp):
            x2 = inp.reshape(-1, inp.shape[-1]).astype(jnp.float32)
            acc = sums.setdefault(name, [0.0, 0])
            acc[0] = acc[0] + x2.T @ x2
            acc[1] += x2.shape[0]
        return sink

    originals = {}
    for proj, block_name in _BLOCKS.items():
        block = getattr(layer, block_name)
        originals[proj] = getattr(block, proj)
        setattr(block, proj, _Tap(originals[proj], make_sink(proj)))
    try:
        y = _block_forward(layer, x, chunk)
    finally:
        for proj, block_name in _BLOCKS.items():
            setattr(getattr(layer, block_name), proj, originals[proj])
    return y, {name: total / count for name, (total, count) in sums.items()}


def _damped(h: Array, damp: float) -> Array:
    return h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(h.shape[0])


def _dense_weight(linear) -> Array:
    if not isinstance(linear, nnx.Linear):
        raise ValueError(
            f"quantize_model: found a {type(linear).__name__} projection; only dense nnx.Linear "
            "projections can be quantized (merge LoRA / load the dense model first)."
        )
    return linear.kernel[...].astype(jnp.float32).T  # [out, in]


def quantize_model(
    model: Llama,
    calib_tokens: Int[Array, "n t"] | None,
    *,
    method: str = "unisvq",
    bits: int = 2,
    group_size: int | None = 64,
    cfg: UniSVQConfig = UniSVQConfig(),
    layers: list[int] | None = None,
    chunk: int = 8,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replace the projections of ``model`` (in place) by quantized layers; return a report.

    Args:
        model: a dense :class:`Llama`.
        calib_tokens: ``[n_seq, seq_len]`` int token ids (required for UniSVQ: Hessians and
            block fine-tuning; ignored by RTN).
        method: ``"unisvq"`` (2 bits), ``"rtn"`` (2, 3, 4 or 8 bits) or ``"kmeans"`` (2-bit
            k-means VQ baseline, simulated: the dequantized weight stays in a dense layer).
        bits: bits per weight of the codes.
        group_size: RTN group size (must divide every input dim); ignored by UniSVQ.
        cfg: :class:`UniSVQConfig`.
        layers: indices of the blocks to quantize (default: all; ``--quick`` uses a subset).
        chunk: sequences per forward chunk (memory bound).
        progress: show a tqdm bar per block.
        log: optional callable for one line per block.

    Returns:
        ``{"method", "bits", "bits_per_weight", "seconds", "blocks": [...]}`` where
        ``bits_per_weight`` averages over the quantized weights (exact, see ``packing``).

    Example::

        >>> report = quantize_model(model, tokens, method="rtn", bits=4)  # doctest: +SKIP
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {METHODS}.")
    check_bits(bits, (2, 3, 4, 8) if method == "rtn" else UNISVQ_BITS,
               where=f"bits (method={method})")
    n_layers = len(model.layers)
    layers = list(range(n_layers)) if layers is None else sorted(set(layers))
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers={bad} out of range for a {n_layers}-layer model.")
    if method == "rtn":
        for i in layers:
            for proj, block_name in _BLOCKS.items():
                w = getattr(getattr(model.layers[i], block_name), proj)
                check_group_size(group_size, _dense_weight(w).shape[1])
    if method in ("unisvq", "kmeans"):
        if calib_tokens is None or np.asarray(calib_tokens).size == 0:
            raise ValueError(
                "calib_tokens is missing: UniSVQ needs calibration text for its Hessians and "
                "block fine-tuning; pass token ids [n_seq, seq_len] (e.g. from corpus_text())."
            )
        calib_tokens = jnp.asarray(calib_tokens, jnp.int32)
        if calib_tokens.ndim != 2:
            raise ValueError(
                f"calib_tokens has shape {calib_tokens.shape}; expected [n_seq, seq_len]."
            )

    start = time.perf_counter()
    blocks_report = []
    total_bits = total_weights = 0.0
    x = None
    if method in ("unisvq", "kmeans"):
        x = model.embed_tokens(calib_tokens).astype(jnp.dtype(model.cfg.dtype))
    iterator = range(max(layers) + 1 if layers else 0)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(layers), desc=f"quantize {method}-{bits}", unit="block")
    key = jax.random.PRNGKey(cfg.seed)
    for i in iterator:
        layer = model.layers[i]
        if i not in layers:
            if x is not None:
                x = _block_forward(layer, x, chunk)
            continue
        t0 = time.perf_counter()
        info: dict[str, Any] = {"layer": i}
        if method == "rtn":
            for proj, block_name in _BLOCKS.items():
                block = getattr(layer, block_name)
                q = rtn_quantize(_dense_weight(getattr(block, proj)), bits, group_size)
                new = RTNLinear(q)
                setattr(block, proj, new)
                total_bits += new.bits_per_weight() * q.codes.size
                total_weights += q.codes.size
        else:
            y, hessians = _capture_hessians(layer, x, chunk)
            info["seconds_calibrate"] = time.perf_counter() - t0
            for j, (proj, block_name) in enumerate(_BLOCKS.items()):
                block = getattr(layer, block_name)
                w = _dense_weight(getattr(block, proj))
                h = _damped(hessians[proj], cfg.damp)
                sub_key = jax.random.fold_in(key, 7 * i + j)
                if method == "kmeans":
                    from lowrank_jax.quant.kmeans_vq import kmeans_vq_quantize

                    w_hat, bpw = kmeans_vq_quantize(w, h, cfg, key=sub_key)
                    lin = getattr(block, proj)
                    lin.kernel.set_value(w_hat.T.astype(lin.kernel[...].dtype))
                else:
                    setattr(block, proj, QuantizedLinear(quantize_linear(w, h, cfg, key=sub_key)))
                    bpw = unisvq_bits_per_weight(*w.shape)
                total_bits += bpw * w.size
                total_weights += w.size
            info["seconds_round"] = time.perf_counter() - t0 - info["seconds_calibrate"]
            if cfg.finetune_steps > 0 and method == "unisvq":
                graph, scales, lattice, rest = nnx.split(layer, QuantScale, LatticeParam, ...)
                best, ft = finetune_block(_BlockApply(graph), (scales, lattice), x, y, cfg,
                                          frozen=rest, labels=_scale_affine_labels)
                nnx.update(layer, best[0], best[1])
                info.update(ft)
            for proj, block_name in _BLOCKS.items():
                lin = getattr(getattr(layer, block_name), proj)
                if isinstance(lin, QuantizedLinear):
                    _round_floats_to_storage(lin)
            x = y
        info["seconds"] = time.perf_counter() - t0
        blocks_report.append(info)
        if log is not None:
            log(json.dumps(info))
        if bar is not None:
            bar.update(1)
            if "val_mse_after" in info:
                bar.set_postfix(mse=f"{info['val_mse_before']:.2e}->{info['val_mse_after']:.2e}")
    if bar is not None:
        bar.close()
    return {
        "method": method,
        "bits": bits,
        "group_size": group_size if method == "rtn" else None,
        "bits_per_weight": total_bits / max(total_weights, 1.0),
        "seconds": time.perf_counter() - start,
        "layers": layers,
        "blocks": blocks_report,
    }


def _quant_layers(model: Llama):
    for i, layer in enumerate(model.layers):
        for proj, block_name in _BLOCKS.items():
            yield i, proj, block_name, getattr(getattr(layer, block_name), proj)


def save_quantized(model: Llama, folder: str | os.PathLike, *, tokenizer=None,
                   report: dict | None = None) -> str:
    """Write ``quantization.json``, ``model.safetensors`` (and the tokenizer) into ``folder``.

    Quantized layers store packed codes and fp16 floats; every other parameter (embeddings, norms,
    dense projections not quantized) is stored in fp32.

    Returns:
        The folder path.
    """
    from safetensors.numpy import save_file

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        "embed_tokens": np.asarray(model.embed_tokens.embedding[...], np.float32),
        "norm": np.asarray(model.norm.weight[...], np.float32),
    }
    if model.lm_head is not None:
        arrays["lm_head"] = np.asarray(model.lm_head.kernel[...], np.float32)
    layers_meta = {}
    for i, layer in enumerate(model.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            arrays[f"layers.{i}.{norm}"] = np.asarray(getattr(layer, norm).weight[...], np.float32)
    for i, proj, _, lin in _quant_layers(model):
        prefix = f"layers.{i}.{proj}"
        if isinstance(lin, QuantizedLinear):
            meta = {"method": "unisvq", "shape": [lin.out_features, lin.in_features],
                    "block_in": lin.block_in, "block_out": lin.block_out}
            arrays[prefix + ".codes"] = np.asarray(lin.codes[...], np.uint8)
            for name in ("scale_in", "scale_out", "affine", "offset"):
                arrays[f"{prefix}.{name}"] = np.asarray(getattr(lin, name)[...], np.float16)
        elif isinstance(lin, RTNLinear):
            meta = {"method": "rtn", "shape": [lin.out_features, lin.in_features],
                    "bits": lin.bits, "group_size": lin.group_size}
            for name, value in rtn_to_arrays(lin.weight()).items():
                arrays[f"{prefix}.{name}"] = value
        else:
            meta = {"method": "dense"}
            arrays[prefix + ".kernel"] = np.asarray(_dense_weight(lin).T, np.float32)
        layers_meta[prefix] = meta
    save_file(arrays, os.path.join(folder, "model.safetensors"))
    manifest = {
        "format": "lowrank_jax.quantized",
        "version": FORMAT_VERSION,
        "config": dataclasses.asdict(model.cfg),
        "layers": layers_meta,
        "report": {k: v for k, v in (report or {}).items() if k != "blocks"},
        "tokenizer": tokenizer is not None,
    }
    with open(os.path.join(folder, "quantization.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(folder)
    return folder


def is_quantized_folder(path: str | os.PathLike) -> bool:
    """True if ``path`` is a folder written by :func:`save_quantized`."""
    return os.path.isfile(os.path.join(os.fspath(path), "quantization.json"))


def load_quantized(folder: str | os.PathLike) -> tuple[Llama, Any]:
    """Read a folder written by :func:`save_quantized`: ``(model, tokenizer or None)``.

    Example::

        >>> model, tok = load_quantized("runs/smollm2-unisvq2")  # doctest: +SKIP
    """
    from safetensors.numpy import load_file

    from lowrank_jax.models.safetensors_io import abstract_llama

    folder = os.fspath(folder)
    manifest_path = os.path.join(folder, "quantization.json")
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(
            f"{folder}: no quantization.json; write the folder with `lowrank-jax quantize`."
        )
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format") != "lowrank_jax.quantized":
        raise ValueError(f"{manifest_path}: not a lowrank_jax quantized model manifest.")
    cfg = LlamaConfig(**manifest["config"])
    arrays = load_file(os.path.join(folder, "model.safetensors"))
    model = abstract_llama(cfg)
    pdt = jnp.dtype(cfg.param_dtype)

    def put(variable, value):
        variable.set_value(jnp.asarray(np.asarray(value, np.float32), dtype=pdt))

    put(model.embed_tokens.embedding, arrays["embed_tokens"])
    put(model.norm.weight, arrays["norm"])
    if model.lm_head is not None:
        put(model.lm_head.kernel, arrays["lm_head"])
    for i, layer in enumerate(model.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(getattr(layer, norm).weight, arrays[f"layers.{i}.{norm}"])
        for proj, block_name in _BLOCKS.items():
            prefix = f"layers.{i}.{proj}"
            meta = manifest["layers"][prefix]
            block = getattr(layer, block_name)
            if meta["method"] == "unisvq":
                w = UniSVQWeight(
                    jnp.asarray(arrays[prefix + ".codes"]),
                    *(jnp.asarray(arrays[f"{prefix}.{n}"], jnp.float32)
                      for n in ("scale_in", "scale_out", "affine", "offset")),
                    block_in=meta["block_in"], block_out=meta["block_out"],
                )
                setattr(block, proj, QuantizedLinear(w))
            elif meta["method"] == "rtn":
                sub = {k: arrays[f"{prefix}.{k}"] for k in ("codes", "scale", "zero")}
                setattr(block, proj, RTNLinear(
                    rtn_from_arrays(sub, tuple(meta["shape"]), meta["bits"], meta["group_size"])))
            else:
                put(getattr(block, proj).kernel, arrays[prefix + ".kernel"])
    tokenizer = None
    if manifest.get("tokenizer") and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from lowrank_jax.models.tokenizer import BPETokenizer

        tokenizer = BPETokenizer.from_folder(folder)
    return model, tokenizer


def model_bits_per_weight(model: Llama) -> float:
    """Average stored bits per projection weight (dense projections count 16)."""
    bits = weights = 0.0
    for _, _, _, lin in _quant_layers(model):
        if isinstance(lin, (QuantizedLinear, RTNLinear)):
            size = lin.in_features * lin.out_features
            bits += lin.bits_per_weight() * size
        else:
            size = lin.kernel[...].size
            bits += 16 * size
        weights += size
    return bits / weights


def perplexity(model: Llama, tokens: np.ndarray, *, seq_len: int = 256, batch_size: int = 4,
               max_batches: int | None = None) -> float:
    """``exp(mean next-token NLL)`` over non-overlapping windows of ``tokens`` (jit-compiled)."""
    from lowrank_jax.data import eval_batches

    graph, state = nnx.split(model)

    @jax.jit
    def nll(state, inputs, targets):
        logits, _ = nnx.merge(graph, state)(inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()

    total, count = 0.0, 0
    for inputs, targets in eval_batches(np.asarray(tokens), batch_size, seq_len, max_batches):
        total += float(nll(state, jnp.asarray(inputs), jnp.asarray(targets)))
        count += targets.size
    return float(np.exp(total / count))


__all__ = [
    "LatticeParam",
    "METHODS",
    "QuantCodes",
    "QuantScale",
    "QuantizedLinear",
    "RTNLinear",
    "is_quantized_folder",
    "load_quantized",
    "model_bits_per_weight",
    "perplexity",
    "quantize_model",
    "save_quantized",
]
