"""Video DiT, procedural videos and video metrics; QKᵀ spectrum of a briefly trained DiT."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.analysis.rank import energy_rank
from lowrank_jax.attention import subspace as vsvd
from lowrank_jax.data.video import frame_psnr, frame_ssim, procedural_videos
from lowrank_jax.models import video_dit as vd

TINY = vd.VideoDiTConfig(frames=4, height=8, width=8, patch=(1, 2, 2), dim=32, heads=2, layers=2)


def _data(key, batch):
    return procedural_videos(key, batch, frames=TINY.frames, size=TINY.height)


def test_patchify_is_frame_major_and_inverts():
    video = jax.random.normal(jax.random.key(0), (2, 4, 8, 8, 3))
    tokens = vd.patchify(video, TINY.patch)
    assert tokens.shape == (2, 64, 12)
    np.testing.assert_array_equal(np.asarray(vd.unpatchify(tokens, TINY)), np.asarray(video))
    # token (t=2, y=1, x=3) is the 2×2 patch at rows 2:4, cols 6:8 of frame 2
    np.testing.assert_array_equal(np.asarray(tokens[0, 2 * 16 + 1 * 4 + 3]).reshape(2, 2, 3),
                                  np.asarray(video[0, 2, 2:4, 6:8]))


def test_rope_3d_rotates_only_the_moving_axes():
    x = jax.random.normal(jax.random.key(1), (1, TINY.tokens, 2, TINY.head_dim))
    out = np.asarray(vd.rope_3d(x, TINY))
    dt, dy, _ = TINY.head_split()
    x = np.asarray(x)
    np.testing.assert_allclose(out[0, 0], x[0, 0], atol=1e-6)  # position (0, 0, 0)
    np.testing.assert_allclose(out[0, 1, :, :dt + dy], x[0, 1, :, :dt + dy], atol=1e-6)  # x=1
    assert not np.allclose(out[0, 1, :, dt + dy:], x[0, 1, :, dt + dy:])
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)


def test_procedural_videos_are_deterministic_moving_and_bounded():
    a = np.asarray(procedural_videos(jax.random.key(3), 4, frames=6, size=16))
    b = np.asarray(procedural_videos(jax.random.key(3), 4, frames=6, size=16))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 6, 16, 16, 3) and np.abs(a).max() <= 1.0
    motion = np.abs(np.diff(a, axis=1)).mean(axis=(2, 3, 4))  # per clip, per frame pair
    assert np.all(motion > 1e-3)  # every clip moves
    with pytest.raises(ValueError, match="size"):
        procedural_videos(jax.random.key(0), 1, size=2)


def test_psnr_and_ssim_known_answers():
    a = procedural_videos(jax.random.key(4), 1, frames=2, size=16)
    assert np.all(np.isinf(np.asarray(frame_psnr(a, a))))
    np.testing.assert_allclose(np.asarray(frame_ssim(a, a)), 1.0, atol=1e-5)
    shifted = a + 0.1  # MSE 0.01 with range 2 → PSNR = 10 log10(4 / 0.01)
    np.testing.assert_allclose(np.asarray(frame_psnr(shifted, a)), 10 * np.log10(400), rtol=1e-4)
    noisy = a + 0.3 * jax.random.normal(jax.random.key(5), a.shape)
    assert float(frame_ssim(noisy, a).max()) < 0.9
    assert float(frame_ssim(shifted, a).min()) > float(frame_ssim(noisy, a).max())


def test_forward_shapes_capture_and_full_rank_video_svd_matches_dense():
    model = vd.VideoDiT(TINY, rngs=nnx.Rngs(0))
    # perturb the zero-initialised output layers so the check sees the attention
    for block in model.blocks:
        block.modulation.kernel[...] = 0.05 * jax.random.normal(jax.random.key(6),
                                                                block.modulation.kernel.shape)
    model.patch_out.kernel[...] = 0.05 * jax.random.normal(jax.random.key(7),
                                                           model.patch_out.kernel.shape)
    x = _data(jax.random.key(8), 2)
    s = jnp.asarray([0.3, 0.8])
    dense, qkv = model(x, s, return_qkv=True)
    assert dense.shape == x.shape and len(qkv) == TINY.layers
    assert qkv[0][0].shape == (2, TINY.tokens, TINY.heads, TINY.head_dim)
    stats = [vsvd.accumulate_grams(vsvd.init_grams(TINY.heads, TINY.head_dim), *layer)
             for layer in qkv]
    bases = [vsvd.fit_bases(st, rank=TINY.head_dim) for st in stats]
    block = 16  # one latent frame
    mask = vsvd.spatiotemporal_block_mask(TINY.grid, block, block, window_t=0)
    cfg = vsvd.VideoSVDConfig(block_q=block, block_k=block, implementation="xla")
    out = model(x, s, attention=lambda l, q, k, v: vsvd.video_svd_attention(q, k, v, bases[l],
                                                                            mask, cfg))
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-4)
    assert float(jnp.abs(dense).max()) > 1e-2


@pytest.mark.slow
def test_training_lowers_loss_saves_and_qk_spectrum_decays(tmp_path):
    model, losses = vd.train_video_dit(TINY, _data, steps=60, batch=8, learning_rate=3e-3)
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:5])
    vd.save_video_dit(str(tmp_path / "dit"), model)
    loaded = vd.load_video_dit(str(tmp_path / "dit"))
    x = _data(jax.random.key(9), 1)
    np.testing.assert_allclose(np.asarray(loaded(x, jnp.ones((1,)) * 0.5)),
                               np.asarray(model(x, jnp.ones((1,)) * 0.5)), atol=1e-6)
    again, source = vd.load_or_train_video_dit(str(tmp_path / "dit"), log=None)  # no training
    assert source == str(tmp_path / "dit")
    np.testing.assert_array_equal(again.blocks[0].qkv.kernel[...], loaded.blocks[0].qkv.kernel[...])
    # observation 1 on the trained model: QKᵀ concentrates its energy in few directions,
    # far fewer than random Q, K of the same shape
    noisy = 0.5 * x + 0.5 * jax.random.normal(jax.random.key(10), x.shape)
    _, qkv = model(noisy, jnp.ones((1,)) * 0.5, return_qkv=True)
    rng = np.random.default_rng(0)
    rand = vsvd.qk_singular_values(
        jnp.asarray(rng.standard_normal((TINY.tokens, TINY.head_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((TINY.tokens, TINY.head_dim)), jnp.float32))
    random_rank = int(energy_rank(rand, 0.9))
    for q, k, _ in qkv:
        for h in range(TINY.heads):
            s = vsvd.qk_singular_values(q[0, :, h], k[0, :, h])
            assert int(energy_rank(s, 0.9)) < random_rank


def test_config_and_resume_errors():
    with pytest.raises(ValueError, match="patch"):
        vd.VideoDiTConfig(frames=4, height=10, width=8, patch=(1, 4, 4))
    with pytest.raises(ValueError, match="heads"):
        vd.VideoDiTConfig(dim=30, heads=4)
    model = vd.VideoDiT(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="config"):
        vd.train_video_dit(vd.VideoDiTConfig(), _data, steps=1, model=model)
    with pytest.raises(ValueError, match="video"):
        model(jnp.zeros((1, 2, 8, 8, 3)), jnp.ones((1,)))
