"""SALE sparse prefill measured on a model: per-layer error and block density against dense
attention on the model's own attention inputs, the NLL with SALE in every layer, and per-head
thresholds calibrated on a text window (spec §6).

SALE runs its jnp reference path (``implementation="xla"``) here: on CPU the Pallas kernels run
only in interpret mode, and the kernel tests show kernel and reference give the same block mask
and output.

References:
    Ji et al., `SALE <https://arxiv.org/abs/2505.24179>`_, 2025.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lowrank_jax.attention import reference_attention, register_sale_per_layer
from lowrank_jax.kv.model import attention_inputs
from lowrank_jax.models.generate import perplexity
from lowrank_jax.models.llama import with_attention
from pallas_kernels.sparse_attention import api as sale_api
from pallas_kernels.sparse_attention import reference as sale_ref


def sale_vs_dense(model, ids, qkv, taus, cfg, *, desc: str | None = None):
    """SALE at thresholds ``taus`` against dense causal attention, layer by layer and whole-model.

    Args:
        model: a :class:`~lowrank_jax.models.llama.Llama`.
        ids: ``[n]`` token ids (one sequence).
        qkv: the dense model's post-RoPE ``(q, k, v)`` of ``ids``
            (:func:`~lowrank_jax.kv.model.attention_inputs` of ``ids[None]``).
        taus: ``[n_layers, heads]`` (or ``[n_layers]``) thresholds.
        cfg: the :class:`pallas_kernels.sparse_attention.SaleConfig`.
        desc: a progress bar over the layers, with this title.

    Returns:
        ``(per_layer, nll)``: one ``{"layer", "rel_err", "density"}`` per layer
        (``‖O_sale − O_dense‖ / ‖O_dense‖`` and the fraction of causal key blocks SALE
        computes), and the mean NLL of ``ids`` with SALE in every layer.
    """
    sale_fn = jax.jit(lambda q, k, v, tau: sale_api.sale_prefill_attention(
        q, k, v, tau, cfg, implementation="xla", return_mask=True))
    dense_fn = jax.jit(lambda q, k, v: reference_attention(q, k, v, causal=True))
    causal = sale_ref.causal_block_mask(len(ids), cfg)  # host float64 density: exact fractions
    per_layer = []
    for i in tqdm(range(model.cfg.n_layers), desc=desc, leave=False, disable=desc is None):
        q, k, v = (a[i] for a in qkv)
        ref = dense_fn(q, k, v)
        out, mask = sale_fn(q, k, v, jnp.asarray(taus[i], jnp.float32))
        per_layer.append({"layer": i,
                          "rel_err": float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)),
                          "density": float(np.asarray(mask)[..., causal].mean())})
    sale_model = with_attention(model, register_sale_per_layer(taus, cfg, implementation="xla"))
    return per_layer, perplexity(sale_model, ids, window=len(ids), progress=False).nll


def calibrate_sale(model, tokens, cfg, err_budget: float, *, progress: bool = False):
    """Per-layer, per-head SALE thresholds ``[n_layers, heads]`` that keep each head's output
    error within ``err_budget`` on the dense model's attention inputs of ``tokens [1, n]``
    (:func:`pallas_kernels.sparse_attention.reference.calibrate_thresholds`, the halving search).
    """
    qkv = attention_inputs(model, tokens)
    return np.stack([sale_ref.calibrate_thresholds(
        [[jnp.transpose(a[i], (0, 2, 1, 3)) for a in qkv]], cfg, err=err_budget)[0]
        for i in tqdm(range(model.cfg.n_layers), desc="calibrate", leave=False,
                      disable=not progress)])


__all__ = ["calibrate_sale", "sale_vs_dense"]
