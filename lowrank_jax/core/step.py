"""The package's one training step: loss, gradient, optimizer update, in one jitted function.

Every trainer builds its step here and passes what is special about it as the loss function;
nothing else writes ``value_and_grad`` + ``tx.update`` + ``apply_updates`` again.

.. math:: g_t = \\nabla_{\\theta_S} L(\\theta_t, \\text{batch}_t), \\qquad
          (u_t, s_{t+1}) = \\text{tx.update}(g_t, s_t, \\theta_{S,t}), \\qquad
          \\theta_{S,t+1} = \\theta_{S,t} + u_t

where :math:`S` is the set of leaves selected by ``wrt`` (all of them by default); the other
leaves are passed to the loss unchanged and come back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _split(params, wrt):
    if wrt is None:
        return params, None
    if not isinstance(params, nnx.State):
        raise TypeError(
            f"wrt={wrt!r} selects leaves of an nnx.State; got params of type "
            f"{type(params).__name__}. Pass nnx.split(model)[1] (or nnx.state(model))."
        )
    return nnx.split_state(params, wrt, ...)


def _join(trainable, frozen, wrt):
    return trainable if wrt is None else nnx.merge_state(trainable, frozen)


def trainable(params, wrt=None):
    """The leaves of ``params`` a step built with ``wrt`` trains (all of them when ``None``).

    Initialize the optimizer on them: ``opt_state = tx.init(trainable(params, wrt))``.

    Example::

        >>> from flax import nnx
        >>> params = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> sorted(trainable(params, nnx.PathContains("bias")).keys())
        ['bias']
    """
    return _split(params, wrt)[0]


def make_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    wrt=None,
    has_aux: bool = False,
    skip_nonfinite: bool = False,
    shardings: tuple | None = None,
    donate: bool = False,
    jit: bool = True,
) -> Callable:
    """``step(params, opt_state, *args) -> (params, opt_state, value)``: one optimizer update.

    Args:
        loss_fn: ``loss_fn(params, *args) -> loss`` (a scalar), or ``(loss, aux)`` with
            ``has_aux``. Only ``params`` is differentiated; ``args`` (batches, frozen weights,
            keys) pass through.
        tx: the optimizer; its state must be ``tx.init(trainable(params, wrt))``.
        wrt: an ``nnx`` filter (``nnx.LoRAParam``, ``nnx.PathContains("lora")``, ...) that
            selects the leaves of ``params`` (an ``nnx.State``) to train; the rest stay fixed.
            ``None`` trains every leaf of any pytree.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        skip_nonfinite: never apply a non-finite update (a NaN/inf loss or update norm keeps
            the old ``params`` and ``opt_state``); ``value`` is then the metrics dict
            ``{"loss", "grad_norm", "finite"}`` (plus ``"aux"`` with ``has_aux``).
        shardings: ``(params, opt_state, args)`` shardings (``args`` a tuple, one per extra
            argument): the step is compiled with these explicit in/out shardings so the
            state's placement never drifts between steps.
        donate: the step consumes ``params`` and ``opt_state`` (their buffers are reused for
            the new ones, so the state is in memory once, not twice): pass the returned ones
            on and never read the old ones again.
        jit: compile the step (``False`` returns the traceable function, e.g. to ``vmap`` or
            ``scan`` it).

    Returns:
        The step. ``value`` is what ``loss_fn`` returned (``loss`` or ``(loss, aux)``) unless
        ``skip_nonfinite``.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> loss = lambda w, x: jnp.sum((w * x - 1.0) ** 2)
        >>> tx = optax.sgd(0.1)
        >>> step = make_step(loss, tx)
        >>> w, state, value = step(jnp.zeros(2), tx.init(jnp.zeros(2)), jnp.ones(2))
        >>> [round(v, 6) for v in w.tolist()], float(value)
        ([0.2, 0.2], 2.0)
    """

    def step(params, opt_state, *args):
        train, frozen = _split(params, wrt)
        inner = lambda t: loss_fn(_join(t, frozen, wrt), *args)  # noqa: E731
        value, grads = jax.value_and_grad(inner, has_aux=has_aux)(train)
        updates, new_opt_state = tx.update(grads, opt_state, train)
        new_train = optax.apply_updates(train, updates)
        if skip_nonfinite:
            loss = value[0] if has_aux else value
            finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(updates))
            new_train = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_train, train)
            new_opt_state = jax.tree.map(
                lambda n, o: jnp.where(finite, n, o), new_opt_state, opt_state
            )
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite}
            if has_aux:
                metrics["aux"] = value[1]
            value = metrics
        return _join(new_train, frozen, wrt), new_opt_state, value

    if not jit:
        return step
    donated = (0, 1) if donate else ()
    if shardings is None:
        return jax.jit(step, donate_argnums=donated)
    param_sh, opt_sh, args_sh = shardings
    return jax.jit(step, in_shardings=(param_sh, opt_sh, *args_sh),
                   out_shardings=(param_sh, opt_sh, None), donate_argnums=donated)


def scan_steps(step: Callable, params, opt_state, batches: tuple, *args):
    """Run ``step`` once per batch inside one ``lax.scan``: ``(params, opt_state, values)``.

    ``step`` is a traceable step (``make_step(..., jit=False)``); ``batches`` a tuple of arrays
    whose leading axis is the step; step ``t`` is ``step(params, opt_state, *batch_t, *args)``,
    so ``args`` (a traced learning-rate scale, frozen weights) are the same at every step.
    ``values`` stacks what each step returned. Jit the caller to compile the whole run once.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> tx = optax.sgd(0.5)
        >>> step = make_step(lambda w, x: jnp.sum((w - x) ** 2), tx, jit=False)
        >>> w, _, losses = scan_steps(step, jnp.zeros(1), tx.init(jnp.zeros(1)),
        ...                           (jnp.ones((3, 1)),))
        >>> float(w[0]), losses.tolist()
        (1.0, [1.0, 0.0, 0.0])
    """

    def body(carry, batch):
        new_params, new_state, value = step(*carry, *batch, *args)
        return (new_params, new_state), value

    (params, opt_state), values = jax.lax.scan(body, (params, opt_state), tuple(batches))
    return params, opt_state, values


def scan_train(loss_fn: Callable, tx: optax.GradientTransformation, params, batches: tuple,
               *args):
    """``(params, losses)`` of a whole run in one ``lax.scan``: :func:`make_step` steps of
    ``loss_fn`` from ``tx.init(params)``, one per batch (:func:`scan_steps`; ``args`` reach every
    step unchanged). Jit the caller (learning rates built from traced arguments compile once).

    Example::

        >>> import jax.numpy as jnp, optax
        >>> w, losses = scan_train(lambda w, x: jnp.sum((w - x) ** 2), optax.sgd(0.5),
        ...                        jnp.zeros(1), (jnp.ones((3, 1)),))
        >>> float(w[0]), losses.tolist()
        (1.0, [1.0, 0.0, 0.0])
    """
    params, _, losses = scan_steps(make_step(loss_fn, tx, jit=False), params, tx.init(params),
                                   batches, *args)
    return params, losses


__all__ = ["make_step", "scan_steps", "scan_train", "trainable"]
