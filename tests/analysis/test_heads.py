"""Per-head split/merge, head scores, rewinding, interpolation and the analyze command."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.analysis import (
    head_scores,
    interpolate,
    loss_barrier,
    merge_heads,
    rewind_heads,
    save_params,
    select_heads,
    split_heads,
)
from lowrank_jax.analysis.report import analyze_params
from lowrank_jax.models.llama import Llama, LlamaConfig

CFG = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
           max_seq_len=32)


def _params(seed):
    model = Llama(LlamaConfig(**CFG), rngs=nnx.Rngs(seed))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize(
    "layout,shape",
    [("llama_qkv", (6, 12)), ("llama_out", (12, 6)), ("torch_qkv", (12, 6)),
     ("torch_out", (6, 12)), ("flax_qkv", (6, 3, 4)), ("flax_out", (3, 4, 6))],
)
def test_split_merge_round_trip(layout, shape):
    w = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    heads = split_heads(w, layout=layout, num_heads=3)
    assert heads.shape[0] == 3
    np.testing.assert_array_equal(np.asarray(merge_heads(heads, layout=layout)), np.asarray(w))


def test_split_matches_model_head_layout():
    model, params = _params(0)
    x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    q, _, _ = model.layers[0].self_attn.qkv(x)  # [b, t, h, d]
    heads = split_heads(jnp.asarray(params["layers"][0]["self_attn"]["q_proj"]["kernel"]),
                        layout="llama_qkv", num_heads=4)
    np.testing.assert_allclose(np.asarray(q[0, :, 2]), np.asarray(x[0] @ heads[2]), atol=1e-5)
    with pytest.raises(ValueError, match="num_heads"):
        split_heads(jnp.zeros((16, 10)), layout="llama_qkv", num_heads=4)


def test_rewind_all_heads_restores_base_and_none_keeps_tuned():
    _, base = _params(0)
    _, tuned = _params(1)
    all_heads = rewind_heads(base, tuned, np.ones((2, 4), bool), num_heads=4, num_kv_heads=2)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for layer in (0, 1):
            np.testing.assert_array_equal(
                np.asarray(all_heads["layers"][layer]["self_attn"][proj]["kernel"]),
                np.asarray(base["layers"][layer]["self_attn"][proj]["kernel"]))
    # non-attention parameters stay tuned
    np.testing.assert_array_equal(np.asarray(all_heads["layers"][0]["mlp"]["up_proj"]["kernel"]),
                                  np.asarray(tuned["layers"][0]["mlp"]["up_proj"]["kernel"]))
    none = rewind_heads(base, tuned, np.zeros((2, 4), bool), num_heads=4, num_kv_heads=2)
    for x, y in zip(jax.tree.leaves(none), jax.tree.leaves(tuned)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rewind_one_head_and_gqa_rule():
    _, base = _params(0)
    _, tuned = _params(1)
    mask = np.zeros((2, 4), bool)
    mask[1, 0] = True  # query head 0 of layer 1; its kv group {0, 1} is not fully masked
    out = rewind_heads(base, tuned, mask, num_heads=4, num_kv_heads=2)
    q = split_heads(jnp.asarray(out["layers"][1]["self_attn"]["q_proj"]["kernel"]),
                    layout="llama_qkv", num_heads=4)
    qb = split_heads(jnp.asarray(base["layers"][1]["self_attn"]["q_proj"]["kernel"]),
                     layout="llama_qkv", num_heads=4)
    qt = split_heads(jnp.asarray(tuned["layers"][1]["self_attn"]["q_proj"]["kernel"]),
                     layout="llama_qkv", num_heads=4)
    np.testing.assert_array_equal(np.asarray(q[0]), np.asarray(qb[0]))
    np.testing.assert_array_equal(np.asarray(q[1:]), np.asarray(qt[1:]))
    np.testing.assert_array_equal(np.asarray(out["layers"][1]["self_attn"]["k_proj"]["kernel"]),
                                  np.asarray(tuned["layers"][1]["self_attn"]["k_proj"]["kernel"]))
    mask[1, 1] = True  # now the whole group → kv head 0 rewound
    out = rewind_heads(base, tuned, mask, num_heads=4, num_kv_heads=2)
    k = split_heads(jnp.asarray(out["layers"][1]["self_attn"]["k_proj"]["kernel"]),
                    layout="llama_qkv", num_heads=2)
    kb = split_heads(jnp.asarray(base["layers"][1]["self_attn"]["k_proj"]["kernel"]),
                     layout="llama_qkv", num_heads=2)
    np.testing.assert_array_equal(np.asarray(k[0]), np.asarray(kb[0]))


def test_head_scores_find_the_changed_head():
    _, base = _params(0)
    tuned = jax.tree.map(lambda x: x, base)
    kernel = jnp.asarray(base["layers"][1]["self_attn"]["o_proj"]["kernel"])
    heads = split_heads(kernel, layout="llama_out", num_heads=4)
    heads = heads.at[3].add(0.5)
    tuned["layers"][1]["self_attn"]["o_proj"]["kernel"] = merge_heads(heads, layout="llama_out")
    for criterion in ("rel_update", "rotation"):
        scores = head_scores(base, tuned, num_heads=4, num_kv_heads=2, criterion=criterion, k=2)
        assert scores.shape == (2, 4)
        assert np.unravel_index(np.argmax(scores), scores.shape) == (1, 3)
        assert np.allclose(scores[0], 0.0, atol=1e-5)
    mask = select_heads(head_scores(base, tuned, num_heads=4, num_kv_heads=2), 0.125,
                        lowest=False)
    assert mask.sum() == 1 and mask[1, 3]
    with pytest.raises(ValueError, match="criterion"):
        head_scores(base, tuned, num_heads=4, num_kv_heads=2, criterion="nope")


def test_interpolation_endpoints_and_barrier():
    _, a = _params(0)
    _, b = _params(1)
    for alpha, ref in ((0.0, a), (1.0, b)):
        out = interpolate(a, b, alpha)
        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-7)
    assert loss_barrier([0.0, 0.5, 1.0], [2.0, 1.0, 2.0]) == pytest.approx(0.0)  # no barrier
    assert loss_barrier([0.0, 0.5, 1.0], [1.0, 3.0, 2.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="tree structures"):
        interpolate(a, {"w": jnp.zeros(2)}, 0.5)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_analyze_params_bad_filter_and_architecture():
    _, a = _params(0)
    with pytest.raises(ValueError, match="matches no matrix"):
        analyze_params(a, layer_filter="no_such_layer")
    other = Llama(LlamaConfig(**{**CFG, "d_ff": 48}), rngs=nnx.Rngs(0))
    b = nnx.to_pure_dict(nnx.state(other, nnx.Param))
    with pytest.raises(ValueError, match="different architectures"):
        analyze_params(a, layer_filter="mlp", base=b)


def test_analyze_command_end_to_end(tmp_path, saved_figures):
    from lowrank_jax.commands import analyze

    model, _ = analyze._load("tiny")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    perturbed = jax.tree.map(lambda x: x * 1.01, params)
    ck = save_params(tmp_path / "base", perturbed)
    out = tmp_path / "report"
    args = argparse.Namespace(model="tiny", compare=str(ck), layers="layers/0/self_attn",
                              out=str(out), top_k=4, max_tokens=12, overwrite=False)
    assert analyze.run(args) == 0
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["matrices"]) == 4
    rec = rep["matrices"]["layers/0/self_attn/q_proj/kernel"]
    assert rec["vs_base/spectral_share"] == pytest.approx(1.0, abs=1e-3)  # pure rescale
    assert len(rep["key_cka"]["matrix"]) == model.cfg.n_layers
    # the plots show the report's numbers
    figures = {name: saved_figures[str(out / name)] for name in (
        "spectra.png", "effective_rank_by_layer.png", "head_importance.png", "key_cka.png")}
    assert len(saved_figures) == 4 and all(f.ink() > 0.02 for f in figures.values())
    for name, key in (("head_importance.png", rep["head_scores"]["rel_update"]),
                      ("key_cka.png", rep["key_cka"]["matrix"])):
        (image,) = figures[name].figure.axes[0].get_images()
        np.testing.assert_allclose(np.asarray(image.get_array()), key, rtol=1e-6, err_msg=name)
    spectra = figures["spectra.png"].lines()
    assert len(spectra) == len(rep["matrices"])  # one curve per matrix, normalised by sigma_1
    assert all(y[0] == pytest.approx(1.0) and x[0] == 1.0 for _, x, y in spectra)
    by_layer = {label: y for label, _, y in figures["effective_rank_by_layer.png"].lines()}
    assert by_layer == {proj.split("/")[-1]: pytest.approx(values)
                        for proj, values in rep["effective_rank_by_layer"].items()}
    bad = argparse.Namespace(**{**vars(args), "layers": "zzz", "overwrite": True})
    with pytest.raises(ValueError, match="matches no matrix"):
        analyze.run(bad)


def test_rewind_curve_counts_the_rewound_heads_and_random_update_baseline():
    from lowrank_jax.analysis import rewind_curve
    from lowrank_jax.analysis.report import compare_to_random_update

    _, base = _params(0)
    _, tuned = _params(1)
    scores = np.arange(8.0).reshape(2, 4)

    def rewound(params):  # query heads equal to the base's, counted from q_proj
        q = [np.asarray(params["layers"][i]["self_attn"]["q_proj"]["kernel"]).reshape(16, 4, 4)
             for i in (0, 1)]
        b = [np.asarray(base["layers"][i]["self_attn"]["q_proj"]["kernel"]).reshape(16, 4, 4)
             for i in (0, 1)]
        return [[bool(np.array_equal(q[i][:, h], b[i][:, h])) for h in range(4)] for i in (0, 1)]

    low = rewind_curve(base, tuned, scores, [0.0, 0.25, 1.0], rewound, num_heads=4,
                       num_kv_heads=2)
    assert low[0] == [[False] * 4] * 2 and low[2] == [[True] * 4] * 2
    assert low[1] == [[True, True, False, False], [False] * 4]  # the 2 lowest scores
    high = rewind_curve(base, tuned, scores, [0.25], rewound, lowest=False, num_heads=4,
                        num_kv_heads=2)
    assert high[0] == [[False] * 4, [False, False, True, True]]

    per_matrix = compare_to_random_update(base, tuned, k=4, seed=0)
    name = "layers/0/mlp/up_proj/kernel"
    assert per_matrix[name]["relative_update"] > 0
    assert 0 <= per_matrix[name]["random_update_spectral_share"] <= 1
