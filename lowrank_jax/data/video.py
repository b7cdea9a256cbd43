"""Procedural videos: a moving, rotating sprite on a drifting textured background.

Each clip is deterministic in its key: a background of two coloured sinusoidal gratings that
drift a little per frame, and one sprite (a soft-edged rectangle or a cross, random colour and
size) that moves at a constant velocity (bouncing off the borders) and rotates at a constant
angular speed. Real motion, so a video model trained on it has real spatio-temporal attention.
Values lie in ``[-1, 1]``; layout ``[batch, frames, height, width, 3]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def _bounce(x, low, high):
    """Reflect ``x`` into ``[low, high]`` (a triangle wave)."""
    span = high - low
    y = jnp.mod(x - low, 2 * span)
    return low + jnp.where(y > span, 2 * span - y, y)


def _clip(key, frames: int, size: int):
    keys = jax.random.split(key, 8)
    grid = (jnp.arange(size, dtype=jnp.float32) + 0.5) / size  # [size] in (0, 1)
    yy, xx = jnp.meshgrid(grid, grid, indexing="ij")
    t = jnp.arange(frames, dtype=jnp.float32)[:, None, None]

    # background: two gratings, each with its own colour, drifting slowly
    angle = jax.random.uniform(keys[0], (2,), maxval=jnp.pi)
    freq = jax.random.uniform(keys[1], (2,), minval=1.5, maxval=4.0) * 2 * jnp.pi
    drift = jax.random.uniform(keys[2], (2,), minval=-0.3, maxval=0.3)
    colours = jax.random.uniform(keys[3], (3, 3), minval=-0.8, maxval=0.8)  # base, grating 1, 2
    background = colours[0] * 0.5
    for i in range(2):
        phase = (jnp.cos(angle[i]) * xx + jnp.sin(angle[i]) * yy)[None] * freq[i] + drift[i] * t
        background = background + 0.25 * jnp.sin(phase)[..., None] * colours[i + 1]

    # sprite: centre, velocity, angle, angular speed, half sizes, colour, shape
    centre = jax.random.uniform(keys[4], (2,), minval=0.3, maxval=0.7)
    velocity = jax.random.uniform(keys[5], (2,), minval=-0.08, maxval=0.08)
    params = jax.random.uniform(keys[6], (5,))
    theta0, omega = params[0] * jnp.pi, (params[1] - 0.5) * 0.8
    half_long, half_short = 0.12 + 0.1 * params[2], 0.05 + 0.05 * params[3]
    is_cross = params[4] > 0.5
    colour = jnp.sign(jax.random.normal(keys[7], (3,))) * 0.9
    cy = _bounce(centre[0] + velocity[0] * t, 0.2, 0.8)
    cx = _bounce(centre[1] + velocity[1] * t, 0.2, 0.8)
    theta = theta0 + omega * t
    dy, dx = yy[None] - cy, xx[None] - cx
    u = jnp.cos(theta) * dx + jnp.sin(theta) * dy
    w = -jnp.sin(theta) * dx + jnp.cos(theta) * dy
    sharp = 4.0 * size

    def rect(a, b):
        return jax.nn.sigmoid(sharp * (half_long - jnp.abs(a))) * jax.nn.sigmoid(
            sharp * (half_short - jnp.abs(b)))

    bar = rect(u, w)
    alpha = jnp.where(is_cross, jnp.maximum(bar, rect(w, u)), bar)[..., None]
    video = (1 - alpha) * background + alpha * colour
    return jnp.clip(video, -1.0, 1.0)


@functools.partial(jax.jit, static_argnames=("batch", "frames", "size"))
def procedural_videos(key: Array, batch: int, *, frames: int = 8,
                      size: int = 16) -> Float[Array, "batch frames size size 3"]:
    """``batch`` clips of ``frames`` RGB frames of ``size × size`` pixels in ``[-1, 1]``.

    Example::

        >>> import jax
        >>> v = procedural_videos(jax.random.key(0), 2, frames=4, size=8)
        >>> v.shape, bool(abs(v).max() <= 1)
        ((2, 4, 8, 8, 3), True)
    """
    if batch < 1 or frames < 1 or size < 4:
        raise ValueError(f"procedural_videos: need batch >= 1, frames >= 1, size >= 4; got "
                         f"batch={batch}, frames={frames}, size={size}.")
    return jax.vmap(lambda k: _clip(k, frames, size))(jax.random.split(key, batch))


def frame_psnr(video: Float[Array, "... f h w c"], target: Float[Array, "... f h w c"], *,
               data_range: float = 2.0) -> Float[Array, "... f"]:
    """Peak signal-to-noise ratio (dB) of every frame; ``data_range`` 2 for ``[-1, 1]`` values.

    Example::

        >>> import jax.numpy as jnp
        >>> a = jnp.zeros((1, 2, 4, 4, 3)); b = a.at[:, 1].add(0.2)
        >>> [round(float(x), 1) for x in frame_psnr(b, a)[0]]
        [inf, 20.0]
    """
    if video.shape != target.shape:
        raise ValueError(f"frame_psnr: video{video.shape} and target{target.shape} differ.")
    mse = jnp.mean(jnp.square(video.astype(jnp.float32) - target), axis=(-3, -2, -1))
    return 10.0 * jnp.log10(data_range ** 2 / mse)


def frame_ssim(video: Float[Array, "... f h w c"], target: Float[Array, "... f h w c"], *,
               data_range: float = 2.0, window: int = 7,
               sigma: float = 1.5) -> Float[Array, "... f"]:
    """Structural similarity of every frame (Gaussian window, valid region, channel mean).

    Wang et al. (2004) with ``K1 = 0.01``, ``K2 = 0.03``; 1 for identical frames.

    Example::

        >>> import jax
        >>> a = jax.random.uniform(jax.random.key(0), (1, 2, 16, 16, 3), minval=-1)
        >>> float(frame_ssim(a, a).min())
        1.0
    """
    if video.shape != target.shape:
        raise ValueError(f"frame_ssim: video{video.shape} and target{target.shape} differ.")
    if window > min(video.shape[-3:-1]):
        raise ValueError(f"frame_ssim: window={window} is larger than the frame "
                         f"{video.shape[-3:-1]}; pass a smaller window.")
    ax = jnp.arange(window, dtype=jnp.float32) - (window - 1) / 2
    g = jnp.exp(-0.5 * (ax / sigma) ** 2)
    g = g / jnp.sum(g)

    def blur(x):  # separable Gaussian filter over (h, w), valid region
        x = jnp.moveaxis(x, -1, 0)  # channels first
        h, w = x.shape[-2:]
        rows = sum(g[i] * x[..., i:h - window + 1 + i, :] for i in range(window))
        return jnp.moveaxis(sum(g[i] * rows[..., i:w - window + 1 + i] for i in range(window)),
                            0, -1)

    x, y = video.astype(jnp.float32), target.astype(jnp.float32)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    ssim = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return jnp.mean(ssim, axis=(-3, -2, -1))


__all__ = ["frame_psnr", "frame_ssim", "procedural_videos"]
