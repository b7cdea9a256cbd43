"""GGUF files (llama.cpp's format) of the checkpoint families into the NNX :class:`Llama`.

A GGUF file holds key/value metadata (``llama.block_count``, ``tokenizer.ggml.tokens``, ...) and
named tensors (``token_embd.weight``, ``blk.N.attn_q.weight``, ..., ``output_norm.weight``,
``output.weight``), each stored as F32/F16/BF16 or block-quantized (Q4_0, Q4_1, Q8_0, k-quants).
The tensors are dequantized with ``gguf.quants.dequantize`` to float32, renamed to HF's
``LlamaForCausalLM`` names and handed to :func:`llama_from_state_dict`.

RoPE pairing. llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders
the rows of ``W_q`` and ``W_k`` so that its interleaved RoPE (pairs ``(2i, 2i+1)``) equals HF's
"rotate half" RoPE (pairs ``(i, i + d/2)``). Per head of size ``d`` it maps HF row
``(half, i)`` to GGUF row ``(i, half)``:

.. math:: W^{\\text{gguf}}[h, i, \\text{half}] = W^{\\text{hf}}[h, \\text{half}, i],
          \\quad h < n_{\\text{heads}}, \\ i < d/2, \\ \\text{half} \\in \\{0, 1\\}

(``n_kv_heads`` for ``W_k``). We undo it, so our HF-style :func:`apply_rope` sees HF rows. The
check: SmolLM2-135M-Instruct gives perplexity ≈ 10 on English with the undo, and hundreds or more
without it (see ``tests/models/test_loading.py``).

Other families (``general.architecture`` ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``)
run llama.cpp's "NeoX" RoPE, which is HF's pairing: their rows are not permuted. Their converter
differences are undone here: Gemma's norms are stored as ``1 + w`` (we subtract 1 back), Phi-3
keeps its fused ``attn_qkv`` / ``ffn_up`` (gate and up) and its longrope factors as the tensors
``rope_factors_short`` / ``rope_factors_long``; Gemma 3's local layers use base 1e4 and every
sixth layer is global, as llama.cpp assumes. Mistral files are ``llama`` files.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import numpy as np

from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.models.safetensors_io import check_load_dtype, llama_from_state_dict

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
#: GGUF architecture -> the HF family (``LlamaConfig.family``) it loads as.
FAMILY_OF_ARCHITECTURE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                          "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
GGUF_MAGIC = b"GGUF"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 (sandwich norms): llama.cpp's names for the four norms of a layer.
_SANDWICH_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def open_gguf(path: str | os.PathLike):
    """``gguf.GGUFReader`` for ``path``, with a one-line ``ValueError`` if it is not a valid GGUF.

    Example::

        >>> reader = open_gguf("model.gguf")  # doctest: +SKIP
    """
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF').")
    try:
        reader = gguf.GGUFReader(path, "r")
        _check_extent(reader, path)
    except ValueError as err:
        if str(err).startswith(path):
            raise
        raise ValueError(f"{path}: truncated or corrupt GGUF ({_first_line(err)}).") from None
    except Exception as err:  # struct/index errors from a damaged header
        raise ValueError(f"{path}: truncated or corrupt GGUF ({_first_line(err)}).") from None
    return reader


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_extent(reader, path: str) -> None:
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"{path}: truncated GGUF: tensor {tensor.name!r} needs bytes up to {end} but the "
                f"file has {size}; re-download or re-convert it."
            )


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
    """The key/value metadata of a GGUF file whose keys start with ``prefix``, read straight from
    the header (no tensor index): the tokenizer of SmolLM2 in 0.2 s where ``gguf.GGUFReader``,
    which parses every field into numpy views, takes 7 s. Values are Python scalars, strings and
    lists, as :func:`gguf_metadata` gives them.

    Example::

        >>> read_gguf_metadata("model.gguf", "tokenizer.")["tokenizer.ggml.model"]  # doctest: +SKIP
        'gpt2'
    """
    import mmap
    import struct

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file.")
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic bytes {head[:4]!r}, expected "
                             "b'GGUF').")
        version, _, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or later is read).")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    at, out = 24, {}

    def string():
        nonlocal at
        (length,) = struct.unpack_from("<Q", data, at)
        at += 8 + length
        return data[at - length:at].decode("utf-8", errors="replace")

    def value(kind):
        nonlocal at
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _GGUF_SCALARS:
                dtype = np.dtype(_GGUF_SCALARS[item])
                values = np.frombuffer(data, dtype, count, at).tolist()
                at += dtype.itemsize * count
                return values
            return [value(item) for _ in range(count)]
        fmt = _GGUF_SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"{path}: unknown GGUF value type {kind} at byte {at}.")
        (scalar,) = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return scalar

    try:
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            read = value(kind)
            if key.startswith(prefix):
                out[key] = read
    except (struct.error, ValueError) as err:
        if str(err).startswith(path):
            raise
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({err}).") from None
    finally:
        data.close()
    return out


def gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata as Python values (token lists included)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an odd field we do not need: skip rather than fail the load
            continue
    return out


def config_from_gguf(meta: dict[str, Any], *, source: str = "gguf") -> LlamaConfig:
    """Hyperparameters from GGUF metadata (``llama.*`` keys) as a dense :class:`LlamaConfig`.

    Tied embeddings are decided by the tensors (no ``output.weight`` means tied), so the caller
    sets ``tie_embeddings``; here it defaults to ``True``.

    Example::

        >>> meta = {"general.architecture": "llama", "llama.block_count": 2,
        ...     "llama.embedding_length": 16, "llama.feed_forward_length": 32,
        ...     "llama.attention.head_count": 2, "llama.context_length": 64,
        ...     "tokenizer.ggml.tokens": ["a", "b"]}
        >>> config_from_gguf(meta).n_kv_heads
        2
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: general.architecture={arch!r} is not a supported architecture; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )

    def get(key: str, default=None, *, required: bool = False):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ValueError(f"{source}: metadata key {full!r} is missing.")
            return default
        return meta[full]

    family = FAMILY_OF_ARCHITECTURE[arch]
    n_heads = int(get("attention.head_count", required=True))
    d_model = int(get("embedding_length", required=True))
    n_layers = int(get("block_count", required=True))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise ValueError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dim} < head_dim="
            f"{head_dim}) is only implemented for phi3."
        )
    scaling_type = get("rope.scaling.type")
    scaling = None
    if arch == "gemma3" and scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{source}: {arch}.rope.scaling.type={scaling_type!r} is not "
                         "implemented for GGUF files.")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ValueError(f"{source}: cannot tell the vocabulary size ({arch}.vocab_size missing).")
    window = get("attention.sliding_window")
    window = int(window) if window else None
    layer_types = None
    if window and arch == "gemma2":  # llama.cpp: even layers slide
        layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(n_layers))
    elif window and arch == "gemma3":  # llama.cpp: every sixth layer is global
        layer_types = tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                            for i in range(n_layers))
    elif arch in ("qwen2", "qwen3", "llama"):
        window = None  # llama.cpp runs these with full attention
    gemma = arch in ("gemma2", "gemma3")
    original = get("rope.scaling.original_context_length")
    return LlamaConfig(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length", required=True)),
        max_seq_len=int(get("context_length", 2048)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5 if not gemma else 1e-6)),
        tie_embeddings=True,
        family=family,
        rope_scaling=scaling,
        rope_local_theta=10000.0 if arch == "gemma3" else None,
        partial_rotary_factor=rope_dim / head_dim,
        original_max_seq_len=None if original is None else int(original),
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        sandwich_norms=gemma,
        attn_logit_softcap=_positive(get("attn_logit_softcapping")),
        final_logit_softcap=_positive(get("final_logit_softcapping")),
        # llama.cpp scales Gemma's scores by 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim)
        query_pre_attn_scalar=float(head_dim) if gemma else None,
        sliding_window=window,
        layer_types=layer_types,
    )


def _positive(value):
    return None if value in (None, 0) else float(value)


def dequantize_tensor(tensor, *, source: str = "gguf") -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major) order, i.e. torch's ``[out, in]``.

    GGUF lists dimensions fastest-first (``ne = [in, out]``); the numpy view is the reverse.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"{source}: tensor {tensor.name!r} has type {qtype.name}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)} (re-quantize the file)."
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if qtype.name in ("F32", "F16"):
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = gguf.quants.dequantize(np.asarray(tensor.data), qtype).astype(np.float32)
    return array.reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGUF rows ``(h, i, half)`` → HF ``(h, half, i)``.

    Args:
        weight: ``[n_heads · head_dim, in]`` in GGUF order.
        n_heads: query heads for ``W_q``, KV heads for ``W_k``.

    Returns:
        The same rows in HF "rotate half" order.

    Example::

        >>> w = np.arange(8)[:, None]  # one head, head_dim 8: GGUF rows 0..7
        >>> unpermute_rope_rows(w, 1)[:, 0].tolist()
        [0, 2, 4, 6, 1, 3, 5, 7]
    """
    out_dim = weight.shape[0]
    return (
        weight.reshape(n_heads, out_dim // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF → GGUF row order), inverse of :func:`unpermute_rope_rows`."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, out_dim // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@contextlib.contextmanager
def gguf_rope_order(model: Llama):
    """Temporarily put llama.cpp's Q/K row order back into a loaded model (the wrong RoPE
    pairing for our HF-style :func:`~lowrank_jax.models.llama.apply_rope`), to show what the
    un-permutation of :func:`unpermute_rope_rows` is worth; the kernels are restored on exit.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> cfg = LlamaConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
        ...                   d_ff=8)
        >>> model = Llama(cfg, rngs=nnx.Rngs(0))
        >>> before = model.layers[0].self_attn.q_proj.kernel[...]
        >>> with gguf_rope_order(model):
        ...     moved = model.layers[0].self_attn.q_proj.kernel[...]
        >>> bool(jnp.all(moved[:, 1] == before[:, 4])), bool(jnp.all(
        ...     model.layers[0].self_attn.q_proj.kernel[...] == before))
        (True, True)
    """
    import jax.numpy as jnp

    from lowrank_jax.models.llama import projections

    heads = {"q_proj": model.cfg.n_heads, "k_proj": model.cfg.n_kv_heads}
    linears = [(linear, heads[name]) for _, name, _, linear in projections(model)
               if name in heads]
    originals = [linear.kernel[...] for linear, _ in linears]
    try:
        for linear, n_heads in linears:
            kernel = np.asarray(linear.kernel[...])  # [in, out]: rows of W are its columns
            linear.kernel[...] = jnp.asarray(permute_rope_rows(kernel.T, n_heads).T)
        yield model
    finally:
        for (linear, _), kernel in zip(linears, originals):
            linear.kernel[...] = kernel


def hf_name(gguf_name: str, family: str = "llama") -> str | None:
    """HF name of a GGUF tensor (``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.
    weight``), or ``None`` for tensors the model does not use. Phi-3's fused ``ffn_up`` (gate
    and up) is ``mlp.gate_up_proj``; Gemma's norms have their own names."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if family in ("gemma2", "gemma3_text") and part in _SANDWICH_NAMES:
            return f"model.layers.{index}.{_SANDWICH_NAMES[part]}.{kind}"
        if family == "phi3" and part == "ffn_up":
            return f"model.layers.{index}.mlp.gate_up_proj.{kind}"
        if part in _LAYER_NAMES:
            return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    return None


def hf_state_from_gguf(
    reader, cfg: LlamaConfig, *, source: str = "gguf"
) -> dict[str, Callable[[], np.ndarray]]:
    """Lazily dequantized HF-named tensors (callables), with Q/K rows un-permuted."""
    state: dict[str, Callable[[], np.ndarray]] = {}
    permuted = cfg.family == "llama"  # the other families run llama.cpp's NeoX (HF) RoPE
    for tensor in reader.tensors:
        if cfg.family == "phi3" and tensor.name in ("rope_factors_short.weight",
                                                    "rope_factors_long.weight"):
            continue  # read by load_gguf into cfg.rope_scaling
        name = hf_name(tensor.name, cfg.family)
        if name is None:
            if tensor.name in ("rope_freqs.weight", "rope_factors_long.weight",
                               "rope_factors_short.weight"):
                raise ValueError(
                    f"{source}: the file carries {tensor.name} (RoPE frequency factors, as "
                    "Llama 3.1 files do), which is not implemented for GGUF."
                )
            raise ValueError(
                f"{source}: unexpected tensor {tensor.name!r} for a {cfg.family} GGUF."
            )

        def load(tensor=tensor, name=name):
            array = dequantize_tensor(tensor, source=source)
            if permuted and name.endswith("self_attn.q_proj.weight"):
                array = unpermute_rope_rows(array, cfg.n_heads)
            elif permuted and name.endswith("self_attn.k_proj.weight"):
                array = unpermute_rope_rows(array, cfg.n_kv_heads)
            if cfg.norm_offset and name.endswith("norm.weight"):
                array = array - cfg.norm_offset  # llama.cpp stores Gemma's 1 + w
            return array

        state[name] = load
    return state


def load_gguf(
    path: str | os.PathLike, *, dtype: str = "float32", attention: str = "reference"
) -> tuple[Llama, dict[str, Any]]:
    """Load a GGUF file of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`) into a
    dense :class:`Llama`.

    Args:
        path: the ``.gguf`` file.
        dtype: parameter and compute dtype, ``"float32"`` or ``"bfloat16"``.
        attention: attention implementation name.

    Returns:
        ``(model, metadata)``; ``metadata`` (tokenizer vocabulary, chat template, ...) feeds
        :func:`lowrank_jax.models.tokenizer.tokenizer_from_gguf_metadata`.

    Example::

        >>> model, meta = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> model.cfg.n_layers  # doctest: +SKIP
        30
    """
    path = os.fspath(path)
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    cfg = config_from_gguf(meta, source=path)
    names = {t.name for t in reader.tensors}
    cfg.tie_embeddings = "output.weight" not in names
    cfg.dtype = cfg.param_dtype = check_load_dtype(dtype)
    cfg.attention = attention
    if cfg.family == "phi3":
        factors = {t.name: dequantize_tensor(t, source=path).reshape(-1) for t in reader.tensors
                   if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
        if len(factors) == 2:
            cfg.rope_scaling = {"rope_type": "longrope",
                                "short_factor": factors["rope_factors_short.weight"].tolist(),
                                "long_factor": factors["rope_factors_long.weight"].tolist()}
            attn_factor = meta.get("phi3.rope.scaling.attn_factor")
            if attn_factor is not None:
                cfg.rope_scaling["attention_factor"] = float(attn_factor)
            cfg.rope_for(0)  # checks the factors' sizes now
    state = hf_state_from_gguf(reader, cfg, source=path)
    model = llama_from_state_dict(cfg, state, source=path)
    return model, meta


__all__ = [
    "FAMILY_OF_ARCHITECTURE",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "config_from_gguf",
    "dequantize_tensor",
    "gguf_metadata",
    "gguf_rope_order",
    "read_gguf_metadata",
    "hf_name",
    "hf_state_from_gguf",
    "load_gguf",
    "open_gguf",
    "permute_rope_rows",
    "unpermute_rope_rows",
]
