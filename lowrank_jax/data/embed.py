"""Text → embeddings for data selection: mean-pooled final hidden states of a Llama model.

The one place the package turns text chunks into selection embeddings (re-route it here when the
model core gains a capture extension point).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.core.losses import token_nll


def text_embeddings(
    model, token_chunks, *, batch_size: int = 8, with_loss: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Mean-pooled final hidden states ``[n, d]`` of token chunks (and, with ``with_loss``, each
    chunk's mean next-token NLL from the same forward pass).

    The one place this package turns text into embeddings for selection. Chunks are
    right-padded to a common length; padding is masked out of the pool and the loss (causal
    attention keeps real positions unaffected by it).

    Args:
        model: a :class:`lowrank_jax.models.Llama` (e.g. from ``load_model("smollm2")``).
        token_chunks: sequence of token-id lists, each of length ≥ 2 when ``with_loss``.
        batch_size: chunks per forward pass.
    """
    from flax import nnx

    if len(token_chunks) == 0:
        raise ValueError("token_chunks is empty; give at least one chunk of token ids.")
    length = max(len(c) for c in token_chunks)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, mask):
        m = nnx.merge(graphdef, state)
        hidden, _ = m.hidden_states(tokens)
        hidden = hidden.astype(jnp.float32)
        pooled = jnp.sum(hidden * mask[..., None], 1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
        nll = token_nll(m.logits_from_hidden(hidden[:, :-1]), tokens[:, 1:])
        valid = mask[:, 1:]
        return pooled, jnp.sum(nll * valid, 1) / jnp.maximum(valid.sum(1), 1)

    embeds, losses = [], []
    for lo in range(0, len(token_chunks), batch_size):
        batch = list(token_chunks[lo:lo + batch_size])
        real = len(batch)
        batch += [batch[0]] * (batch_size - real)  # fixed batch shape: one compile
        tokens = np.zeros((batch_size, length), np.int32)
        mask = np.zeros((batch_size, length), np.float32)
        for i, chunk in enumerate(batch):
            tokens[i, :len(chunk)] = chunk
            mask[i, :len(chunk)] = 1.0
        pooled, nll = forward(state, jnp.asarray(tokens), jnp.asarray(mask))
        embeds.append(np.asarray(pooled)[:real])
        losses.append(np.asarray(nll)[:real])
    embeds = np.concatenate(embeds)
    return (embeds, np.concatenate(losses)) if with_loss else embeds


def chunk_tokens(ids, max_tokens: int, *, min_tokens: int = 8) -> list[list[int]]:
    """Split one token sequence into consecutive chunks of ``max_tokens`` (a last chunk shorter
    than ``min_tokens`` is dropped)."""
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 2.")
    ids = list(ids)
    chunks = [ids[i:i + max_tokens] for i in range(0, len(ids), max_tokens)]
    return [c for c in chunks if len(c) >= min(min_tokens, max_tokens)]


__all__ = ["chunk_tokens", "text_embeddings"]
