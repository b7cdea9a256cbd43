"""A small video diffusion transformer (DiT) with full 3-D attention, trained by flow matching.

Videos ``[batch, frames, height, width, channels]`` are cut into spatio-temporal patches
``(pt, ph, pw)`` and flattened frame-major ``(t, y, x)``, so a latent frame is a contiguous token
range (what the Video-SVD window needs). Each block is adaLN-Zero (shift, scale and gate from the
timestep embedding) around full bidirectional attention with 3-D RoPE (head dim split between
t, y and x) and an MLP. The attention is pluggable: ``model(x, s, attention=fn)`` calls
``fn(layer, q, k, v)`` with post-RoPE ``[batch, n, heads, head_dim]`` tensors, and
``return_qkv=True`` also returns every layer's ``(q, k, v)`` for calibration.

Training is rectified flow: ``x_s = (1 − s) x_0 + s ε``, the network predicts the velocity
``ε − x_0``, sampling integrates ``dx/ds`` with Euler steps from ``s = 1`` (noise) to ``0``.

References:
  Peebles & Xie, Scalable Diffusion Models with Transformers, https://arxiv.org/abs/2212.09748;
  Liu et al., Flow Straight and Fast (rectified flow), https://arxiv.org/abs/2209.03003
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float

from lowrank_jax.core.loop import run_steps
from lowrank_jax.core.step import make_step
from lowrank_jax.models.llama import apply_rope


@dataclasses.dataclass(frozen=True)
class VideoDiTConfig:
    """Sizes of the video DiT (defaults: 8 frames of 16×16 RGB → 8×4×4 = 128 tokens)."""

    frames: int = 8
    height: int = 16
    width: int = 16
    channels: int = 3
    patch: tuple[int, int, int] = (1, 4, 4)
    dim: int = 64
    heads: int = 2
    layers: int = 3
    mlp_ratio: int = 4
    rope_theta: float = 100.0
    rope_split: tuple[int, int, int] | None = None  # head dims for (t, y, x); default ≈ 1:1.5:1.5

    def __post_init__(self):
        for axis, size, p in zip(("frames", "height", "width"),
                                 (self.frames, self.height, self.width), self.patch):
            if size % p:
                raise ValueError(f"VideoDiTConfig: {axis}={size} is not a multiple of the patch "
                                 f"size {p} (patch={self.patch}).")
        if self.dim % self.heads:
            raise ValueError(f"VideoDiTConfig: dim={self.dim} must be divisible by heads="
                             f"{self.heads}.")
        split = self.head_split()
        if sum(split) != self.head_dim or any(s % 2 for s in split):
            raise ValueError(f"VideoDiTConfig: rope_split={split} must be even sizes summing to "
                             f"head_dim={self.head_dim}.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid(self) -> tuple[int, int, int]:
        """Latent token grid ``(t, y, x)``."""
        return (self.frames // self.patch[0], self.height // self.patch[1],
                self.width // self.patch[2])

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def patch_dim(self) -> int:
        return math.prod(self.patch) * self.channels

    def head_split(self) -> tuple[int, int, int]:
        if self.rope_split is not None:
            return tuple(self.rope_split)
        t = 2 * max(1, round(self.head_dim / 8))
        y = 2 * ((self.head_dim - t) // 4)
        return (t, y, self.head_dim - t - y)


def patchify(video: Float[Array, "b f h w c"], patch) -> Float[Array, "b n p"]:
    """``[b, F, H, W, C]`` → frame-major tokens ``[b, (F/pt)(H/ph)(W/pw), pt·ph·pw·C]``."""
    b, f, h, w, c = video.shape
    pt, ph, pw = patch
    x = video.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c)
    x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)


def unpatchify(tokens: Float[Array, "b n p"], config: VideoDiTConfig) -> Float[Array, "b f h w c"]:
    """Inverse of :func:`patchify`."""
    gt, gy, gx = config.grid
    pt, ph, pw = config.patch
    x = tokens.reshape(tokens.shape[0], gt, gy, gx, pt, ph, pw, config.channels)
    x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(tokens.shape[0], config.frames, config.height, config.width, config.channels)


def rope_3d(x: Float[Array, "b n h d"], config: VideoDiTConfig) -> Float[Array, "b n h d"]:
    """3-D rotary embedding: head-dim chunks rotated by the token's t, y and x position."""
    gt, gy, gx = config.grid
    pos = jnp.arange(config.tokens)
    coords = (pos // (gy * gx), (pos // gx) % gy, pos % gx)
    dt, dy, _ = config.head_split()
    chunks = jnp.split(x, [dt, dt + dy], axis=-1)
    out = [apply_rope(c, jnp.broadcast_to(p, x.shape[:2]), config.rope_theta)
           for c, p in zip(chunks, coords)]
    return jnp.concatenate(out, axis=-1)


def dense_attention(layer: int, q, k, v):
    """Default attention: plain bidirectional softmax attention in fp32."""
    del layer
    return jax.nn.dot_product_attention(q, k, v).astype(q.dtype)


def timestep_embedding(s: Float[Array, " b"], dim: int) -> Float[Array, "b dim"]:
    """Sinusoidal embedding of the flow time ``s ∈ [0, 1]`` (scaled by 1000 as in DDPM)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = 1000.0 * s[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def _layer_norm(x, eps=1e-6):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


class DiTBlock(nnx.Module):
    """adaLN-Zero transformer block: attention and MLP, each modulated and gated by ``c``."""

    def __init__(self, config: VideoDiTConfig, *, rngs: nnx.Rngs):
        dim = config.dim
        self.config = config
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)
        self.mlp_in = nnx.Linear(dim, config.mlp_ratio * dim, rngs=rngs)
        self.mlp_out = nnx.Linear(config.mlp_ratio * dim, dim, rngs=rngs)
        self.modulation = nnx.Linear(dim, 6 * dim, kernel_init=nnx.initializers.zeros,
                                     rngs=rngs)

    def __call__(self, x, c, layer: int, attention: Callable):
        cfg = self.config
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(jax.nn.silu(c))[:, None, :], 6, axis=-1)
        h = _layer_norm(x) * (1 + scale1) + shift1
        b, n, _ = h.shape
        q, k, v = jnp.split(self.qkv(h).reshape(b, n, 3 * cfg.heads, cfg.head_dim), 3, axis=2)
        q, k = rope_3d(q, cfg), rope_3d(k, cfg)
        att = attention(layer, q, k, v).reshape(b, n, cfg.dim)
        x = x + gate1 * self.out(att)
        h = _layer_norm(x) * (1 + scale2) + shift2
        x = x + gate2 * self.mlp_out(jax.nn.gelu(self.mlp_in(h)))
        return x, (q, k, v)


class VideoDiT(nnx.Module):
    """Video DiT predicting the flow velocity of noisy clips.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> cfg = VideoDiTConfig(frames=2, height=8, width=8, dim=32, heads=2, layers=1)
        >>> model = VideoDiT(cfg, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 2, 8, 8, 3)), jnp.ones((1,))).shape
        (1, 2, 8, 8, 3)
    """

    def __init__(self, config: VideoDiTConfig, *, rngs: nnx.Rngs):
        self.config = config
        dim = config.dim
        self.patch_in = nnx.Linear(config.patch_dim, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.tokens, dim)))
        self.time_in = nnx.Linear(dim, dim, rngs=rngs)
        self.time_out = nnx.Linear(dim, dim, rngs=rngs)
        self.blocks = nnx.List([DiTBlock(config, rngs=rngs) for _ in range(config.layers)])
        self.final_modulation = nnx.Linear(dim, 2 * dim, kernel_init=nnx.initializers.zeros,
                                           rngs=rngs)
        self.patch_out = nnx.Linear(dim, config.patch_dim, kernel_init=nnx.initializers.zeros,
                                    rngs=rngs)

    def __call__(self, video: Float[Array, "b f h w c"], s: Float[Array, " b"], *,
                 attention: Callable | None = None, return_qkv: bool = False):
        """Velocity ``[b, F, H, W, C]`` (and the per-layer ``(q, k, v)`` if ``return_qkv``)."""
        cfg = self.config
        if video.shape[1:] != (cfg.frames, cfg.height, cfg.width, cfg.channels):
            raise ValueError(f"VideoDiT: video{video.shape} must be [batch, {cfg.frames}, "
                             f"{cfg.height}, {cfg.width}, {cfg.channels}] (the config's sizes).")
        attention = dense_attention if attention is None else attention
        x = self.patch_in(patchify(video, cfg.patch)) + self.pos[...][None]
        c = self.time_out(jax.nn.silu(self.time_in(timestep_embedding(s, cfg.dim))))
        captured = []
        for layer, block in enumerate(self.blocks):
            x, qkv = block(x, c, layer, attention)
            captured.append(qkv)
        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c))[:, None, :], 2, axis=-1)
        out = unpatchify(self.patch_out(_layer_norm(x) * (1 + scale) + shift), cfg)
        return (out, captured) if return_qkv else out


def flow_matching_loss(model: VideoDiT, clean, key):
    """Rectified-flow loss ``‖f(x_s, s) − (ε − x_0)‖²`` with ``s ~ U(0, 1)``."""
    k_noise, k_time = jax.random.split(key)
    noise = jax.random.normal(k_noise, clean.shape)
    s = jax.random.uniform(k_time, (clean.shape[0],))
    x_s = (1 - s)[:, None, None, None, None] * clean + s[:, None, None, None, None] * noise
    return jnp.mean(jnp.square(model(x_s, s) - (noise - clean)))


def sample(model: VideoDiT, noise: Float[Array, "b f h w c"], *, steps: int = 16,
           attention: Callable | None = None, dense_steps: int = 0):
    """Euler sampling from ``noise`` (``s = 1``) to a clip (``s = 0``).

    ``attention`` replaces dense attention from step ``dense_steps`` on (earlier steps stay dense:
    the warm-up knob). Returns the clip, clipped to ``[-1, 1]``.
    """
    dense = nnx.jit(lambda m, x, s: m(x, s))
    fast = dense if attention is None else nnx.jit(lambda m, x, s: m(x, s, attention=attention))
    x = noise
    grid = jnp.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        velocity = dense if i < dense_steps else fast
        x = x + (grid[i + 1] - grid[i]) * velocity(model, x, jnp.full((x.shape[0],), grid[i]))
    return jnp.clip(x, -1.0, 1.0)


def sampling_qkv(model: VideoDiT, noise: Float[Array, "b f h w c"], *, steps: int = 16):
    """Dense Euler sampling as :func:`sample`; yields every step's per-layer ``(q, k, v)``
    (post-RoPE, ``[b, N, heads, head_dim]``): the attention inputs along a trajectory."""
    forward = nnx.jit(lambda m, x, s: m(x, s, return_qkv=True))
    grid = jnp.linspace(1.0, 0.0, steps + 1)
    x = noise
    for i in range(steps):
        velocity, qkv = forward(model, x, jnp.full((x.shape[0],), grid[i]))
        yield qkv
        x = x + (grid[i + 1] - grid[i]) * velocity


def calibrate_grams(model: VideoDiT, noise: Float[Array, "b f h w c"], *, steps: int = 16):
    """Per-layer Gram statistics of Q/K/V over a dense sampling trajectory from ``noise``
    (:func:`sampling_qkv` into :func:`lowrank_jax.attention.subspace.accumulate_grams`): what
    :func:`~lowrank_jax.attention.subspace.fit_bases` fits the Video-SVD bases on.

    Example::

        >>> cfg = VideoDiTConfig(frames=2, height=4, width=4, dim=16, heads=2, layers=1)
        >>> model = VideoDiT(cfg, rngs=nnx.Rngs(0))
        >>> stats = calibrate_grams(model, jnp.zeros((1, 2, 4, 4, 3)), steps=2)
        >>> len(stats), stats[0].gram_q.shape
        (1, (2, 8, 8))
    """
    from lowrank_jax.attention import subspace

    cfg = model.config
    stats = [subspace.init_grams(cfg.heads, cfg.head_dim) for _ in range(cfg.layers)]
    for qkv in sampling_qkv(model, noise, steps=steps):
        stats = [subspace.accumulate_grams(s, *layer) for s, layer in zip(stats, qkv)]
    return stats


def train_video_dit(config: VideoDiTConfig, data_fn: Callable, *, steps: int = 2000,
                    batch: int = 32, learning_rate: float = 2e-3, seed: int = 0,
                    log_every: int = 0, model: VideoDiT | None = None):
    """Train a :class:`VideoDiT` on clips from ``data_fn(key, batch)``; returns ``(model, losses)``.

    AdamW with warm-up and cosine decay, gradient clipping at 1. ``log_every > 0`` prints the mean
    loss of the last ``log_every`` steps. Pass ``model`` to continue training it (fresh optimizer).
    """
    if steps < 1 or batch < 1:
        raise ValueError(f"train_video_dit: steps={steps} and batch={batch} must be >= 1.")
    if model is None:
        model = VideoDiT(config, rngs=nnx.Rngs(seed))
    elif model.config != config:
        raise ValueError(f"train_video_dit: model.config {model.config} differs from config "
                         f"{config}; pass the model's own config to continue training.")
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(100, steps // 10 + 1),
                                                  steps, learning_rate * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, key):
        k_data, k_loss = jax.random.split(key)
        clean = data_fn(k_data, batch)  # drawn inside the step: no host round trip
        return flow_matching_loss(nnx.merge(graph, params, rest), clean, k_loss)

    step = make_step(loss_fn, tx)
    keys = [jax.random.key(seed + 1)]

    def batches(t):
        keys[0], sub = jax.random.split(keys[0])
        return rest, sub

    def report(run):
        if log_every and run.step % log_every == 0:
            print(f"step {run.step:5d}  loss {sum(run.losses[-log_every:]) / log_every:.4f}",
                  flush=True)

    run = run_steps(step, params, tx.init(params), batches, steps=steps, what="train_video_dit",
                    on_step=report)
    nnx.update(model, run.params)
    return model, run.losses


def load_or_train_video_dit(path, *, steps: int = 300, log=print) -> tuple[VideoDiT, str]:
    """``(model, source)``: the DiT saved at ``path`` (:func:`save_video_dit`), or, when there is
    none, a small one (8 frames of 16×16, dim 64, 2 heads, 2 layers) trained ``steps`` steps on
    :func:`~lowrank_jax.data.video.procedural_videos` (batch 16; ``source`` then says so)."""
    import os

    from lowrank_jax.data.video import procedural_videos

    if os.path.exists(os.path.join(path, "params.npz")):
        return load_video_dit(path), str(path)
    log(f"no checkpoint at {path}: training a quick model "
        "(run train_video_dit.py for the real one)")
    config = VideoDiTConfig(frames=8, height=16, width=16, dim=64, heads=2, layers=2)
    data = lambda key, batch: procedural_videos(key, batch, frames=8, size=16)  # noqa: E731
    model, _ = train_video_dit(config, data, steps=steps, batch=16)
    return model, "trained in-script"


def save_video_dit(path, model: VideoDiT) -> None:
    """Write the config (JSON) and parameters (``.npz``) of ``model`` to ``path`` (a folder)."""
    import json
    import os

    import numpy as np

    os.makedirs(path, exist_ok=True)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    np.savez(os.path.join(path, "params.npz"), **arrays)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(model.config), f)


def load_video_dit(path) -> VideoDiT:
    """Rebuild a :class:`VideoDiT` saved by :func:`save_video_dit`."""
    import json
    import os

    import numpy as np

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    model = VideoDiT(VideoDiTConfig(**raw), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    with np.load(os.path.join(path, "params.npz")) as data:
        missing = [jax.tree_util.keystr(k) for k, _ in leaves
                   if jax.tree_util.keystr(k) not in data]
        if missing:
            raise ValueError(f"load_video_dit: {path} lacks parameters {missing[:3]}...; it was "
                             "saved from a different model version.")
        values = [jnp.asarray(data[jax.tree_util.keystr(k)]) for k, _ in leaves]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, values))
    return model


__all__ = ["DiTBlock", "VideoDiT", "VideoDiTConfig", "calibrate_grams", "dense_attention",
           "flow_matching_loss", "load_or_train_video_dit", "load_video_dit", "patchify",
           "rope_3d", "sample", "sampling_qkv", "save_video_dit", "timestep_embedding",
           "train_video_dit", "unpatchify"]
