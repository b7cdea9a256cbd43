"""Next-token loss and held-out scores of a model, whole or split into parts.

The token loss itself is the package's one :func:`~lowrank_jax.core.losses.cross_entropy`
(re-exported here with :func:`~lowrank_jax.core.losses.token_nll`). :func:`lm_loss` is the one
merged-forward loss: ``params`` is one state or a tuple of the parts of an ``nnx.split``;
:func:`adapter_loss` (windows, a trained part and the rest, an optional penalty) and
:func:`scaled_adapter_loss` (every ``lora_a`` times a traced scale) are built on it, for a
:func:`lowrank_jax.core.step.make_step` step to differentiate. :func:`evaluate_windows` is the one
held-out loop (the mean over batches of a batch score); :func:`window_evaluator` scores token
windows with it (mean NLL and next-token accuracy), jitted once per graph.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.core.losses import cross_entropy, token_nll
from lowrank_jax.models.packed import PackedKV


def _logits(graphdef, params, inputs, segment_ids=None, positions=None):
    states = params if isinstance(params, tuple) else (params,)
    model = nnx.merge(graphdef, *states)
    if segment_ids is None and positions is None:
        logits, _ = model(inputs)
    elif segment_ids is None:
        logits, _ = model(inputs, positions)
    else:  # packed rows: attention stays inside each document
        logits, _ = model(inputs, positions, cache=PackedKV(segment_ids))
    return logits


def lm_loss(graphdef) -> Callable:
    """``loss(params, inputs, targets)``: next-token cross entropy of ``nnx.merge(graphdef,
    params)`` (the pretraining loss; pass it to :func:`lowrank_jax.core.step.make_step`).

    ``params`` is a state, or a tuple of states merged in order (``(trained, rest)`` of
    ``nnx.split(model, nnx.LoRAParam, ...)``). Packed rows (the fields of a
    :class:`lowrank_jax.data.PackedBatch`) add ``segment_ids`` (attention within each document,
    :class:`~lowrank_jax.models.PackedKV`), per-document ``positions`` and ``loss_mask`` (the mean
    is over the masked-in targets: none across a document boundary, none on padding).

    Example::

        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.presets import preset_model
        >>> graphdef, state = nnx.split(preset_model("tiny"))
        >>> x = jnp.zeros((1, 4), jnp.int32)
        >>> bool(lm_loss(graphdef)(state, x, x) == lm_loss(graphdef)((state,), x, x))
        True
    """

    def loss_fn(params, inputs, targets, segment_ids=None, positions=None, loss_mask=None):
        logits = _logits(graphdef, params, inputs, segment_ids, positions)
        return cross_entropy(logits, targets, loss_mask)

    return loss_fn


def adapter_loss(graphdef, extra_loss: Callable | None = None) -> Callable:
    """``loss(trained, rest, tokens, *extra)``: :func:`lm_loss` of the merged model on windows.

    ``tokens [b, t + 1]`` are windows: inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
    ``extra_loss(trained, *extra)`` (e.g. an orthogonality penalty between adapters) is added;
    the ``extra`` arguments pass through :func:`~lowrank_jax.core.step.make_step` unchanged.

    Args:
        graphdef: from ``graphdef, trained, rest = nnx.split(model, nnx.LoRAParam, ...)``.
        extra_loss: optional penalty of the trained state.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> from lowrank_jax.nn import LoRARule, apply_lora
        >>> model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
        ...                           n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> _ = apply_lora(model, LoRARule("q_proj", rank=2), rngs=nnx.Rngs(1))
        >>> graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        >>> loss = adapter_loss(graphdef)(lora, rest, jnp.zeros((2, 5), jnp.int32))
        >>> loss.shape, bool(loss > 0)
        ((), True)
    """
    merged = lm_loss(graphdef)

    def loss_fn(trained, rest, tokens, *extra):
        loss = merged((trained, rest), tokens[:, :-1], tokens[:, 1:])
        if extra_loss is not None:
            loss = loss + extra_loss(trained, *extra)
        return loss

    return loss_fn


def scale_lora_a(tree, scale):
    """``tree`` with every ``lora_a`` leaf multiplied by ``scale`` (the rest unchanged).

    Example::

        >>> scale_lora_a({"lora_a": 1.0, "lora_b": 1.0}, 3.0)
        {'lora_a': 3.0, 'lora_b': 1.0}
    """
    return jax.tree_util.tree_map_with_path(
        lambda p, v: v * scale if any(getattr(k, "key", None) == "lora_a" for k in p) else v,
        tree)


def scaled_adapter_loss(graphdef) -> Callable:
    """``loss(lora, inputs, targets, scale, rest)``: :func:`lm_loss` with ``ΔW = s · A B``.

    The adapters are applied at the module's own scaling with every ``lora_a`` multiplied by
    ``scale`` (:func:`scale_lora_a`), so ``s`` can be a traced argument: one compiled fine-tune
    serves a whole sweep over the scale (BaLoRA's ``s = A_scaling²``).
    """
    merged = lm_loss(graphdef)

    def loss_fn(lora, inputs, targets, scale, rest):
        return merged((scale_lora_a(lora, scale), rest), inputs, targets)

    return loss_fn


def evaluate_windows(score: Callable, states: tuple, windows, *, batch_size: int = 16):
    """The mean over batches of ``score(states, windows[i:i + batch_size])``.

    ``score`` returns a scalar or a tuple of scalars; each is averaged over the batches (the
    last, shorter batch counts as one batch), as floats.

    Example::

        >>> import numpy as np
        >>> evaluate_windows(lambda s, w: (w.mean(), w.max()), (), np.arange(4.0), batch_size=2)
        (1.5, 2.0)
    """
    values = [jax.tree.map(float, score(states, windows[i:i + batch_size]))
              for i in range(0, len(windows), batch_size)]
    return jax.tree.map(lambda *v: float(np.mean(v)), *values)


def window_evaluator(graphdef, *, batch_size: int = 16) -> Callable:
    """``evaluate(*states, windows) -> (mean NLL in nats, next-token accuracy)``.

    ``windows [n, t + 1]`` are scored ``batch_size`` at a time by one jitted forward of
    ``nnx.merge(graphdef, *states)`` (:func:`evaluate_windows`).

    Example::

        >>> from flax import nnx
        >>> import numpy as np
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
        ...                           n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> graphdef, state = nnx.split(model)
        >>> nll, acc = window_evaluator(graphdef)(state, np.zeros((3, 6), np.int32))
        >>> bool(0 < nll), 0 <= acc <= 1
        (True, True)
    """

    @jax.jit
    def scores(states, tokens):
        logits = _logits(graphdef, states, tokens[:, :-1])
        nll = cross_entropy(logits, tokens[:, 1:])
        return nll, jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:])

    def evaluate(*states_and_windows):
        *states, windows = states_and_windows
        return evaluate_windows(scores, tuple(states), windows, batch_size=batch_size)

    return evaluate


__all__ = ["adapter_loss", "cross_entropy", "evaluate_windows", "lm_loss", "scale_lora_a",
           "scaled_adapter_loss", "token_nll", "window_evaluator"]
