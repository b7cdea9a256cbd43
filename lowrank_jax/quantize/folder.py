"""Save and load a quantized model as a self-contained folder (``quantization.json`` +
``model.safetensors`` + tokenizer), readable by every command that takes ``--model``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowrank_jax.runs.outputs import atomic_write_text
from lowrank_jax.models.llama import (
    Llama,
    LlamaConfig,
    layer_norms,
    projections,
    replace_projections,
)
from lowrank_jax.nn.projection import dense_matrix
from lowrank_jax.quant.layers import QuantizedLinear, RTNLinear, VQLinear, check_dense
from lowrank_jax.quant.nf4 import NF4Linear, NF4Weight
from lowrank_jax.quant.packing import pack_bits, unpack_bits
from lowrank_jax.quant.rtn import rtn_from_arrays, rtn_to_arrays
from lowrank_jax.quant.unisvq import UniSVQWeight

FORMAT_VERSION = 1


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
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, "quantization.json"))
    arrays: dict[str, np.ndarray] = {
        "embed_tokens": np.asarray(model.embed_tokens.embedding[...], np.float32),
        "norm": np.asarray(model.norm.weight[...], np.float32),
    }
    if model.lm_head is not None:
        arrays["lm_head"] = np.asarray(model.lm_head.kernel[...], np.float32)
    layers_meta = {}
    for i, norm, module in layer_norms(model):
        arrays[f"layers.{i}.{norm}"] = np.asarray(module.weight[...], np.float32)
    for i, proj, _, lin in projections(model):
        prefix = f"layers.{i}.{proj}"
        if isinstance(lin, QuantizedLinear):
            meta = {"method": "unisvq", "shape": [lin.out_features, lin.in_features],
                    "block_in": lin.block_in, "block_out": lin.block_out, "bits": lin.bits}
            if lin.bits == 2:
                arrays[prefix + ".codes"] = np.asarray(lin.codes[...], np.uint8)
            else:  # 12- or 16-bit codes as a bit stream: exactly 3 or 4 bits per weight on disk
                width = 4 * lin.bits
                arrays[f"{prefix}.codes{width}"] = pack_bits(np.asarray(lin.codes[...]), width)
            for name in ("scale_in", "scale_out", "affine", "offset"):
                arrays[f"{prefix}.{name}"] = np.asarray(getattr(lin, name)[...], np.float16)
        elif isinstance(lin, VQLinear):
            meta = {"method": "kmeans", "shape": [lin.out_features, lin.in_features],
                    "block_in": lin.block_in, "block_out": lin.block_out}
            arrays[prefix + ".codes"] = np.asarray(lin.codes[...], np.uint8)
            for name in ("scale_in", "scale_out", "codebook"):
                arrays[f"{prefix}.{name}"] = np.asarray(getattr(lin, name)[...], np.float16)
        elif isinstance(lin, NF4Linear):  # QLoRA's NF4 base (lowrank_jax.quant.nf4)
            w = lin.weight()
            meta = {"method": "nf4", "shape": [lin.out_features, lin.in_features],
                    "block_size": lin.block_size, "double_quant": lin.double_quant}
            arrays[prefix + ".packed"] = np.asarray(w.packed, np.uint8)
            arrays[prefix + ".absmax"] = np.asarray(w.absmax)
            if lin.double_quant:
                arrays[prefix + ".absmax_scale"] = np.asarray(w.absmax_scale, np.float32)
                arrays[prefix + ".absmax_offset"] = np.asarray(w.absmax_offset, np.float32)
        elif isinstance(lin, RTNLinear):
            meta = {"method": "rtn", "shape": [lin.out_features, lin.in_features],
                    "bits": lin.bits, "group_size": lin.group_size,
                    "zero_point": lin.zero_point}
            for name, value in rtn_to_arrays(lin.weight()).items():
                arrays[f"{prefix}.{name}"] = value
        else:
            meta = {"method": "dense"}
            arrays[prefix + ".kernel"] = np.asarray(dense_matrix(check_dense(lin)), np.float32)
        layers_meta[prefix] = meta
    save_file(arrays, os.path.join(folder, "model.safetensors"))
    manifest = {
        "format": "lowrank_jax.quantized",
        "version": FORMAT_VERSION,
        "config": dataclasses.asdict(model.cfg),
        "layers": layers_meta,
        "report": {k: v for k, v in (report or {}).items()
                   if k not in ("blocks", "unfinetuned")},
        "tokenizer": tokenizer is not None,
    }
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(folder)
    # the manifest marks a complete folder: written last, through a temp file and a rename, so
    # an interrupted save never leaves a folder that loads (a stale manifest is removed first)
    atomic_write_text(os.path.join(folder, "quantization.json"), json.dumps(manifest, indent=1))
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
    for i, norm, module in layer_norms(model):
        put(module.weight, arrays[f"layers.{i}.{norm}"])

    def stored(i, proj, linear):
        prefix = f"layers.{i}.{proj}"
        meta = manifest["layers"][prefix]
        if meta["method"] == "unisvq":
            bits = int(meta.get("bits", 2))  # folders before the 3-bit lattice have no "bits"
            if bits == 2:
                codes = arrays[prefix + ".codes"]
            else:
                m, n = meta["shape"]
                width = 4 * bits
                codes = unpack_bits(arrays[f"{prefix}.codes{width}"], width, m * (n // 4))
                codes = codes.reshape(m, n // 4)
            return QuantizedLinear(UniSVQWeight(
                jnp.asarray(codes),
                *(jnp.asarray(arrays[f"{prefix}.{n}"], jnp.float32)
                  for n in ("scale_in", "scale_out", "affine", "offset")),
                block_in=meta["block_in"], block_out=meta["block_out"], bits=bits,
            ))
        if meta["method"] == "kmeans":
            from lowrank_jax.quant.kmeans_vq import VQWeight

            codes, codebook, s_in, s_out = (
                jnp.asarray(arrays[f"{prefix}.{n}"], jnp.uint8 if n == "codes" else jnp.float32)
                for n in ("codes", "codebook", "scale_in", "scale_out"))
            return VQLinear(VQWeight(codes, codebook, s_in, s_out, meta["block_in"],
                                     meta["block_out"]))
        if meta["method"] == "nf4":
            dq = meta["double_quant"]
            return NF4Linear(NF4Weight(
                jnp.asarray(arrays[prefix + ".packed"]), jnp.asarray(arrays[prefix + ".absmax"]),
                jnp.asarray(arrays[prefix + ".absmax_scale"]) if dq else None,
                jnp.asarray(arrays[prefix + ".absmax_offset"]) if dq else None,
                meta["block_size"]))
        if meta["method"] == "rtn":
            sub = {k: arrays[f"{prefix}.{k}"] for k in ("codes", "scale", "zero")}
            return RTNLinear(
                rtn_from_arrays(sub, tuple(meta["shape"]), meta["bits"], meta["group_size"],
                                meta.get("zero_point", "float")))
        put(linear.kernel, arrays[prefix + ".kernel"])
        return None

    replace_projections(model, stored)
    from lowrank_jax.models.tokenizer import folder_tokenizer

    return model, folder_tokenizer(folder)


__all__ = ["FORMAT_VERSION", "is_quantized_folder", "load_quantized", "save_quantized"]
