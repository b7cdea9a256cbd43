"""Next-token loss and held-out scores of a model split into a trained part and the rest.

The token loss itself is the package's one :func:`~lowrank_jax.core.losses.cross_entropy`
(re-exported here with :func:`~lowrank_jax.core.losses.token_nll`). :func:`adapter_loss` builds
the loss a :func:`lowrank_jax.core.step.make_step` step differentiates for an adapter split
``nnx.split(model, nnx.LoRAParam, ...)``, and :func:`window_evaluator` scores token windows
(mean NLL and next-token accuracy) the same way, jitted once per graph.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.core.losses import cross_entropy, token_nll


def _next_token_logits(graphdef, states, tokens):
    model = nnx.merge(graphdef, *states)
    logits, _ = model(tokens[:, :-1])
    return logits


def adapter_loss(graphdef, extra_loss: Callable | None = None) -> Callable:
    """``loss(trained, rest, tokens, *extra)``: next-token cross entropy of the merged model.

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

    def loss_fn(trained, rest, tokens, *extra):
        logits = _next_token_logits(graphdef, (trained, rest), tokens)
        loss = cross_entropy(logits, tokens[:, 1:])
        if extra_loss is not None:
            loss = loss + extra_loss(trained, *extra)
        return loss

    return loss_fn


def window_evaluator(graphdef, *, batch_size: int = 16) -> Callable:
    """``evaluate(*states, windows) -> (mean NLL in nats, next-token accuracy)``.

    ``windows [n, t + 1]`` are scored ``batch_size`` at a time by one jitted forward of
    ``nnx.merge(graphdef, *states)``; the result is the mean over batches of each batch's mean
    (the last, shorter batch counts as one batch).

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
        logits = _next_token_logits(graphdef, states, tokens)
        nll = cross_entropy(logits, tokens[:, 1:])
        return nll, jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:])

    def evaluate(*states_and_windows):
        *states, windows = states_and_windows
        nll, acc = [], []
        for i in range(0, len(windows), batch_size):
            n, a = scores(tuple(states), jnp.asarray(windows[i:i + batch_size]))
            nll.append(float(n))
            acc.append(float(a))
        return float(np.mean(nll)), float(np.mean(acc))

    return evaluate


__all__ = ["adapter_loss", "cross_entropy", "token_nll", "window_evaluator"]
