"""Video-SVD bases and online attention: exact limits, bilinear optimality, orthogonality, mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.attention import subspace as S
from pallas_kernels.flash_attention.reference import flash_attention_reference


def _structured(n=96, heads=2, d=16, seed=0):
    """q, k with a decaying spectrum (low-rank part + noise) and random v: [1, n, heads, d]."""
    rng = np.random.default_rng(seed)
    scales = 3.0 * 0.6 ** np.arange(d)
    q = rng.standard_normal((1, n, heads, d)) * scales
    k = q @ rng.standard_normal((d, d)) * 0.3 + rng.standard_normal((1, n, heads, d)) * scales
    v = rng.standard_normal((1, n, heads, d))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v)]


def _fit(q, k, v, **kw):
    stats = S.accumulate_grams(S.init_grams(q.shape[2], q.shape[3]), q, k, v)
    return S.fit_bases(stats, **kw)


@pytest.mark.parametrize("method", S.SUBSPACE_METHODS)
def test_full_rank_bases_reproduce_dense_attention_for_any_window(method):
    q, k, v = _structured(n=70)
    bases = _fit(q, k, v, rank=16, method=method)
    np.testing.assert_allclose(np.asarray(bases.q_basis[0] @ bases.k_basis[0].T), np.eye(16),
                               atol=2e-4)
    np.testing.assert_allclose(np.asarray(bases.v_basis[1] @ bases.v_basis[1].T), np.eye(16),
                               atol=1e-5)
    dense = flash_attention_reference(q, k, v, causal=False)
    for window in (None, 0):
        mask = S.spatiotemporal_block_mask((5, 2, 7), 16, 16, window_t=window)
        for impl in ("xla", "pallas"):
            cfg = S.VideoSVDConfig(block_q=16, block_k=16, implementation=impl)
            out = S.video_svd_attention(q, k, v, bases, mask, cfg, interpret=True)
            np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-4, rtol=2e-4)


def test_single_sample_fit_is_the_truncated_svd_of_qk():
    q, k, v = _structured(n=80, heads=1)
    qk = np.asarray(q[0, :, 0], np.float64) @ np.asarray(k[0, :, 0], np.float64).T
    s = np.linalg.svd(qk, compute_uv=False)
    np.testing.assert_allclose(np.asarray(S.qk_singular_values(q[0, :, 0], k[0, :, 0])), s[:16],
                               rtol=2e-3, atol=1e-3 * s[0])
    errors = []
    for rank in (1, 2, 4, 8, 16):
        b = _fit(q, k, v, rank=rank)
        approx = (np.asarray(q[0, :, 0]) @ np.asarray(b.q_basis[0])) @ (
            np.asarray(k[0, :, 0]) @ np.asarray(b.k_basis[0])).T
        err = np.linalg.norm(qk - approx)
        np.testing.assert_allclose(err, np.sqrt(np.sum(s[rank:] ** 2)), rtol=2e-3,
                                   atol=1e-4 * s[0])
        errors.append(err)
    assert all(a >= b - 1e-6 * s[0] for a, b in zip(errors, errors[1:]))


def test_bases_are_orthonormal_and_energy_policy_picks_per_head_ranks():
    q, k, v = _structured()
    b = _fit(q, k, v, rank="energy:0.9", rank_v=4)
    for h in range(2):
        r = int(b.ranks[h])
        for mat in (b.orth_q[h, :, :r], b.orth_k[h, :, :r]):
            np.testing.assert_allclose(np.asarray(mat.T @ mat), np.eye(r), atol=1e-5)
        np.testing.assert_allclose(np.asarray(b.v_basis[h].T @ b.v_basis[h]), np.eye(4), atol=1e-5)
        energy = np.cumsum(np.asarray(b.spectrum[h]) ** 2) / np.sum(np.asarray(b.spectrum[h]) ** 2)
        assert energy[r - 1] >= 0.9 - 1e-6 and (r == 1 or energy[r - 2] < 0.9)
        assert not np.any(np.asarray(b.q_basis[h, :, r:]))  # padded heads get zero columns
    assert b.q_basis.shape[-1] == int(jnp.max(b.ranks)) < 16


def test_latent_value_accumulation_equals_explicit_reconstruction():
    q, k, v = _structured(n=48)
    b = _fit(q, k, v, rank=6, rank_v=5)
    mask = S.spatiotemporal_block_mask((3, 4, 4), 16, 16, window_t=0)
    out = S.video_svd_attention(q, k, v, b, mask, S.VideoSVDConfig(implementation="xla"))
    # explicit: far values are ṽ E_vᵀ; as "far_exact" with v replaced by its reconstruction
    q_lat, k_lat, v_lat = S.project_to_subspaces(q, k, v, b)
    v_rec = jnp.einsum("bnhr,hdr->bnhd", v_lat, b.v_basis)
    near = S.spatiotemporal_block_mask((3, 4, 4), 1, 1, window_t=0)
    logits = jnp.where(near, jnp.einsum("bqhd,bkhd->bhqk", q, k),
                       jnp.einsum("bqhr,bkhr->bhqk", q_lat, k_lat)) * 16 ** -0.5
    p = jax.nn.softmax(logits, axis=-1)
    expect = (jnp.einsum("bhqk,bkhd->bqhd", jnp.where(near, p, 0), v)
              + jnp.einsum("bhqk,bkhd->bqhd", jnp.where(near, 0, p), v_rec))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expect), atol=1e-5, rtol=1e-5)


def test_block_mask_equals_token_oracle_and_is_symmetric_in_time():
    grid, window = (4, 3, 5), 1
    n = 60
    t = np.arange(n) // 15
    token_near = np.abs(t[:, None] - t[None, :]) <= window
    for bq, bk in ((1, 1), (8, 16), (16, 8)):
        mask = S.spatiotemporal_block_mask(grid, bq, bk, window_t=window)
        oracle = np.zeros_like(mask)
        for i in range(mask.shape[0]):
            for j in range(mask.shape[1]):
                oracle[i, j] = token_near[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
        np.testing.assert_array_equal(mask, oracle)
    # frame-aligned blocks: exactly the ±window frames, symmetric
    frame_mask = S.spatiotemporal_block_mask((6, 4, 4), 16, 16, window_t=2)
    np.testing.assert_array_equal(frame_mask, frame_mask.T)
    np.testing.assert_array_equal(frame_mask.sum(1), [3, 4, 5, 5, 4, 3])
    # a spatial radius only removes pairs, and contains the token-level spatial oracle
    spatial = S.spatiotemporal_block_mask(grid, 1, 1, window_t=window, window_hw=1)
    y, x = (np.arange(n) // 5) % 3, np.arange(n) % 5
    oracle = token_near & (np.abs(y[:, None] - y) <= 1) & (np.abs(x[:, None] - x) <= 1)
    np.testing.assert_array_equal(spatial, oracle)
    assert not S.spatiotemporal_block_mask(grid, 8, 8, window_t=None).any()


def test_flop_accounting_matches_hand_count():
    mask = S.spatiotemporal_block_mask((4, 4, 4), 16, 16, window_t=0)  # 1/4 near
    f = S.attention_flops(64, 32, 8, 4, mask, 16, 16)
    assert f["near_fraction"] == 0.25
    assert f["dense"] == 4 * 32 * 64 * 64
    near, far = 64 * 64 // 4, 64 * 64 * 3 // 4
    attention = 4 * 32 * near + (2 * 8 + 2 * 4) * far + 2 * 64 * 4 * 32
    assert f["attention"] == attention
    assert f["projection"] == 2 * 64 * 32 * (16 + 4)
    assert f["ratio"] == pytest.approx(f["dense"] / (attention + f["projection"]))


def test_bad_arguments_raise():
    q, k, v = _structured(n=8)  # 8 tokens < d = 16: singular Grams
    stats = S.accumulate_grams(S.init_grams(2, 16), q, k, v)
    with pytest.raises(ValueError, match="eps"):
        S.fit_bases(stats, rank=4)
    assert np.all(np.isfinite(np.asarray(S.fit_bases(stats, rank=4, eps=1e-3).q_basis)))
    with pytest.raises(ValueError, match="method"):
        S.fit_bases(stats, rank=4, method="pca")
    with pytest.raises(ValueError, match="rank"):
        S.fit_bases(stats, rank=17, eps=1e-3)
    with pytest.raises(ValueError, match="init_grams"):
        S.accumulate_grams(S.init_grams(3, 16), q, k, v)
    with pytest.raises(ValueError, match="window_t"):
        S.spatiotemporal_block_mask((2, 2, 2), 8, 8, window_t=-1)
