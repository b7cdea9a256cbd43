"""The one check of a PEFT LoRA adapter folder, shared by every reader and writer.

``generate --adapter`` (:func:`lowrank_jax.serve.read_peft_adapter`), ``merge`` and
``--model ADAPTER`` (:func:`lowrank_jax.io.peft.import_peft`) read adapters, and
:func:`lowrank_jax.io.peft.export_peft` checks what it wrote before it replaces anything: all
through :func:`read_adapter`, so an adapter one of them refuses, all refuse, with the same
message. Checked, before any model is touched:

- the folder holds ``adapter_config.json`` (valid JSON: ``r``, ``lora_alpha`` and the patterns
  positive) and ``adapter_model.safetensors`` (readable: not truncated);
- a plain LoRA adapter (``peft_type`` ``LORA``, no DoRA) with at least one tensor;
- every tensor named ``base_model.model.<module>.lora_A|lora_B[.default].weight``, each module
  with both factors, ``lora_A [r, in]`` and ``lora_B [out, r]`` of one rank ``r`` that is the
  rank the config gives the module (``r`` / ``rank_pattern``), every value finite.

Example::

    >>> import tempfile
    >>> from flax import nnx
    >>> from lowrank_jax.io.peft import export_peft
    >>> from lowrank_jax.models import Llama, LlamaConfig
    >>> from lowrank_jax.nn import apply_lora
    >>> model = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32),
    ...               rngs=nnx.Rngs(0))
    >>> _ = apply_lora(model, {"v_proj": 2}, rngs=nnx.Rngs(1))
    >>> folder = tempfile.mkdtemp()
    >>> _ = export_peft(model, folder)
    >>> config, modules = read_adapter(folder)
    >>> config["r"], sorted(modules), modules["model.layers.0.self_attn.v_proj"]["lora_A"].shape
    (2, ['model.layers.0.self_attn.v_proj'], (2, 16))
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_A|lora_B)(?:\.default)?\.weight")


def read_adapter(folder: str | os.PathLike, *, who: str | None = None
                 ) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """Read and check a PEFT LoRA adapter folder.

    Args:
        folder: the adapter folder.
        who: how messages start (``"adapter=DIR"``, ``"import_peft"``); default
            ``"adapter DIR"``.

    Returns:
        ``(config, modules)``: the checked ``adapter_config.json`` and ``{HF module name:
        {"lora_A": [r, in], "lora_B": [out, r]}}`` as stored.

    Raises:
        FileNotFoundError: the config or the weights file is missing (or the folder).
        ValueError: anything else listed in the module docstring, naming the file, the tensor
            or the key.
    """
    from safetensors.numpy import load_file

    folder = os.fspath(folder)
    who = who or f"adapter {folder}"
    config_path = os.path.join(folder, CONFIG_NAME)
    weights_path = os.path.join(folder, WEIGHTS_NAME)
    for p in (config_path, weights_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"{who}: {p} not found; a PEFT adapter folder holds "
                                    f"{CONFIG_NAME} and {WEIGHTS_NAME}.")
    config = read_adapter_config(config_path)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{who}: only plain LoRA adapters are supported "
                         f"(peft_type={config.get('peft_type')!r}, "
                         f"use_dora={config.get('use_dora')}).")
    try:
        tensors = load_file(weights_path)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{who}: {weights_path} is not a readable safetensors file "
                         f"({reason}); export the adapter again.") from None
    if not tensors:
        raise ValueError(f"{who}: {weights_path} holds no tensors, so the adapter would change "
                         "nothing; export the adapter again.")
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{who}: unexpected tensor {key!r}; expected "
                             "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight'.")
        if not np.all(np.isfinite(np.asarray(value, np.float32))):
            raise ValueError(f"{who}: {weights_path} tensor {key!r} holds NaN or inf values; "
                             "the adapter is broken (retrain it with a lower lr).")
        modules.setdefault(match.group(1), {})[match.group(2)] = value
    r_default = int(config.get("r", 8))
    for name, pair in sorted(modules.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{who}: module {name!r} lacks lora_A or lora_B.")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{who}: {name} has lora_A {a.shape} and lora_B {b.shape}; "
                             "expected [r, in] and [out, r] of one rank r.")
        expected = int(pattern_value(name, config.get("rank_pattern") or {}, r_default))
        if a.shape[0] != expected:
            raise ValueError(f"{who}: {name} stores rank {a.shape[0]} but {CONFIG_NAME} says "
                             f"r={expected}; the adapter folder is inconsistent (export it "
                             "again).")
    return config, modules


def read_adapter_config(path: str | os.PathLike) -> dict:
    """A PEFT ``adapter_config.json`` as a dict, checked: valid JSON holding an object, ``r`` a
    positive integer and ``lora_alpha`` a positive number (and so every value of
    ``rank_pattern`` / ``alpha_pattern``); a ``ValueError`` names the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"import_peft: {path} is not valid JSON ({error}); export the "
                         "adapter again or fix the file.") from None
    if not isinstance(config, dict):
        raise ValueError(f"import_peft: {path} must hold a JSON object, got "
                         f"{type(config).__name__}.")

    def check(key, value, positive_int=False):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and value > 0
        if positive_int:
            ok = ok and float(value).is_integer()
        if not ok:
            kind = "a positive integer" if positive_int else "a positive number"
            raise ValueError(f"import_peft: {path}: {key}={value!r} must be {kind}.")

    if "r" in config:
        check("r", config["r"], positive_int=True)
    if "lora_alpha" in config:
        check("lora_alpha", config["lora_alpha"])
    for pattern, is_int in (("rank_pattern", True), ("alpha_pattern", False)):
        values = config.get(pattern) or {}
        if not isinstance(values, dict):
            raise ValueError(f"import_peft: {path}: {pattern} must be an object "
                             "{module: value}.")
        for name, value in values.items():
            check(f"{pattern}[{name!r}]", value, positive_int=is_int)
    return config


def pattern_value(name: str, pattern: Mapping[str, Any], default):
    """The value a PEFT ``rank_pattern`` / ``alpha_pattern`` gives module ``name``, else
    ``default``: the first key that matches the end of the dotted name as a regular expression
    (PEFT's rule: ``"q_proj"`` matches ``"model.layers.0.self_attn.q_proj"``).

    Example::

        >>> pattern_value("model.layers.0.self_attn.q_proj", {"q_proj": 16}, 8)
        16
        >>> pattern_value("model.layers.0.mlp.up_proj", {"q_proj": 16}, 8)
        8
    """
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


__all__ = ["pattern_value", "read_adapter", "read_adapter_config"]
