"""The package's one token loss and one sliding-window perplexity recipe.

Every trainer and evaluator scores next tokens with :func:`token_nll` (per token) or
:func:`cross_entropy` (its mean, optionally masked), always in fp32:

.. math:: \\ell_t = -\\log \\operatorname{softmax}(z_t)_{y_t}, \\qquad
          \\mathrm{CE} = \\frac{\\sum_t m_t \\ell_t}{\\max(\\sum_t m_t, 1)}

:func:`sliding_windows` and :func:`windowed_perplexity` hold the model-free half of a
sliding-window perplexity (which windows, which tokens each one scores, the running sum);
:func:`lowrank_jax.models.generate.perplexity` plugs a decoder into it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def token_logprob(logits, targets):
    """``log p(targets)`` per position (fp32): ``logits [..., V]``, integer ``targets [...]``.

    Example::

        >>> import jax.numpy as jnp
        >>> round(float(token_logprob(jnp.zeros((3, 4)), jnp.array([0, 1, 2]))[0]), 4)
        -1.3863
    """
    return ids_logprob(logits, targets[..., None])[..., 0]


def ids_logprob(logits, ids):
    """``log p(ids)`` (fp32) of several token ids per position: ``logits [..., V]``, integer
    ``ids [..., k]`` → ``[..., k]`` (e.g. a teacher's top-k tokens for distillation).

    Example::

        >>> import jax.numpy as jnp
        >>> lp = ids_logprob(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), jnp.array([[0, 2]]))
        >>> [round(float(v), 4) for v in jnp.exp(lp[0])]
        [0.5, 0.25]
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, ids, axis=-1)


def top_logprobs(logits, k: int):
    """The ``k`` most likely tokens per position: ``(log p [..., k], ids [..., k])`` (fp32),
    most likely first (a teacher's top-k for distillation).

    Example::

        >>> import jax.numpy as jnp
        >>> lp, ids = top_logprobs(jnp.log(jnp.array([[0.2, 0.5, 0.3]])), 2)
        >>> ids.tolist(), [round(float(v), 4) for v in jnp.exp(lp[0])]
        ([[1, 2]], [0.5, 0.3])
    """
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)


def token_nll(logits, targets):
    """Negative log-likelihood in nats of each target token (fp32), shape ``targets.shape``.

    Args:
        logits: ``[..., V]`` scores (any float dtype; computed in fp32).
        targets: integer ids ``[...]`` in ``[0, V)``.

    Example::

        >>> import jax.numpy as jnp
        >>> token_nll(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32)).shape
        (1, 2)
    """
    return -token_logprob(logits, targets)


def cross_entropy(logits, targets, mask=None):
    """Mean next-token cross entropy in nats (fp32); with ``mask``, the mean over ``mask``.

    ``mask`` (same shape as ``targets``, bool or float weights) gives
    ``sum(nll * mask) / max(sum(mask), 1)``: masked positions do not count, and an all-zero
    mask gives 0 rather than NaN.

    Example::

        >>> import jax.numpy as jnp
        >>> round(float(cross_entropy(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32))), 4)
        1.3863
    """
    nll = token_nll(logits, targets)
    if mask is None:
        return jnp.mean(nll)
    mask = jnp.asarray(mask).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class PerplexityResult(NamedTuple):
    """Output of a perplexity evaluation."""

    perplexity: float  # exp(mean negative log-likelihood)
    nll: float  # mean negative log-likelihood per scored token (nats)
    n_tokens: int  # scored tokens
    n_windows: int


def sliding_windows(n: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """``[(begin, end, lo)]``: the windows ``ids[begin:end]`` of a sliding-window perplexity.

    Windows of ``min(window, n)`` tokens start every ``stride`` tokens (default ``window``), the
    last one moved back to end at ``n``. Each token is scored at most once, in the first window
    that covers it with context (HF's recipe): window positions ``lo <= r < end - begin`` score
    their token from the ones before it. The very first token is never scored, nor (with
    disjoint windows) the first token of each window.

    Example::

        >>> sliding_windows(20, 8)
        [(0, 8, 1), (8, 16, 1), (12, 20, 4)]
    """
    if n < 2:
        raise ValueError(f"token_ids has {n} tokens; perplexity needs at least 2.")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride={stride} must lie in [1, window={window}].")
    width = min(window, n)
    starts = list(range(0, max(n - width, 0) + 1, stride))
    if starts[-1] + width < n:
        starts.append(n - width)
    plan, prev_end = [], 0
    for begin in starts:
        end = min(begin + width, n)
        plan.append((begin, end, max(prev_end, begin + 1) - begin))
        prev_end = end
        if end >= n:
            break
    return plan


def window_nll_sum(logits, tokens, lo, hi):
    """Summed NLL and count of targets ``tokens[:, r]`` for ``lo <= r < hi`` of one window.

    ``logits [1, t, V]`` are the model's outputs on ``tokens [1, t]`` (position ``r - 1``
    predicts token ``r``). Traceable: ``lo``/``hi`` may be traced scalars.
    """
    nll = token_nll(logits[0, :-1], tokens[0, 1:])
    r = jnp.arange(1, tokens.shape[1])
    mask = (r >= lo) & (r < hi)
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def windowed_perplexity(
    score: Callable,
    token_ids: Sequence[int],
    *,
    window: int,
    stride: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Sliding-window perplexity with any scorer of one window.

    Args:
        score: ``score(chunk [1, t] int32, lo, hi) -> (nll_sum, count)`` for one window, e.g.
            a jitted model forward followed by :func:`window_nll_sum`.
        token_ids: the sequence (at least 2 tokens).
        window: tokens per window; stride: step between window starts (default ``window``).
        progress: show a tqdm bar over windows.

    Returns:
        A :class:`PerplexityResult`.

    Example::

        >>> import jax.numpy as jnp
        >>> uniform = lambda chunk, lo, hi: window_nll_sum(
        ...     jnp.zeros(chunk.shape + (4,)), chunk, lo, hi)
        >>> res = windowed_perplexity(uniform, [0, 1, 2, 3] * 5, window=8, progress=False)
        >>> round(res.perplexity, 4), res.n_tokens, res.n_windows
        (4.0, 18, 3)
    """
    from tqdm.auto import tqdm

    ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
    plan = sliding_windows(ids.shape[0], window, stride)
    total, count = 0.0, 0
    bar = tqdm(plan, desc="perplexity", unit="window", disable=not progress, leave=False)
    for begin, end, lo in bar:
        s, c = score(jnp.asarray(ids[begin:end][None, :]), lo, end - begin)
        total += float(s)
        count += int(c)
        if progress:
            bar.set_postfix(ppl=f"{math.exp(total / max(count, 1)):.2f}")
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, len(plan))


__all__ = [
    "PerplexityResult",
    "cross_entropy",
    "ids_logprob",
    "sliding_windows",
    "token_logprob",
    "token_nll",
    "top_logprobs",
    "window_nll_sum",
    "windowed_perplexity",
]
