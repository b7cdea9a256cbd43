"""Doc-to-LoRA: no-op at init, chunk additivity / order invariance / zero padding, fixed output
shapes, per-row adapters, the top-k distillation loss, training (gradients reach only the
hypernetwork, resumable), PEFT export read back by our loader and by PEFT's LoRA formula."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from lowrank_jax.hyper import (
    DistillData,
    DocToLoRA,
    DocToLoRAConfig,
    LoRABank,
    adapted,
    bank_delta,
    build_distill_data,
    chunk_encoder,
    chunk_document,
    context_distiller,
    default_alpha,
    distill_loss,
    export_generated_adapter,
    internalize,
    load_hypernetwork,
    restore_hypernetwork,
    save_hypernetwork,
    topk_distill,
    train_doc_to_lora,
)
from lowrank_jax.hub import load_model
from lowrank_jax.models.presets import preset_model
from lowrank_jax.train.losses import cross_entropy

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("hyper.test_doc_to_lora")

CHUNK = 8
QUERY = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79]], jnp.int32)


def _hyper(base, seed=0, **kw):
    options = dict(layers=(0, 1), rank=2, d_latent=16, n_latents=4, num_blocks=1, n_heads=2)
    options.update(kw)
    return DocToLoRA.for_model(base, rngs=nnx.Rngs(seed), **options)


def _trained_like(hyper, seed=1):
    """Non-zero B scalers and bias B (what training would give), so the adapter acts."""
    keys = jax.random.split(jax.random.key(seed), 2)
    hyper.scale_b[...] = jax.random.normal(keys[0], hyper.scale_b.shape)
    hyper.bias_b[...] = 0.3 * jax.random.normal(keys[1], hyper.bias_b.shape)
    hyper.head[...] = hyper.head[...] * 50.0
    return hyper


DOC = [int(x) for x in np.random.default_rng(0).integers(1, 255, 3 * CHUNK)]
_JIT = {}


def _generate(hyper, feats, mask):
    """``hyper(feats, mask)`` compiled once per hypernetwork object (eager ops are slow)."""
    if id(hyper) not in _JIT:
        graph, state = nnx.split(hyper)
        fn = jax.jit(lambda st, f, m: tuple(nnx.merge(graph, st)(f, m)))
        _JIT[id(hyper)] = (hyper, lambda f, m: LoRABank(*fn(state, f, m)))
    return _JIT[id(hyper)][1](feats, mask)


def _logits(model, tokens=QUERY, bank=None, config=None):
    """Logits of ``model`` (with ``bank`` applied when given), jitted."""
    graph, state = nnx.split(model)

    @jax.jit
    def run(state, bank, tokens):
        m = nnx.merge(graph, state)
        if bank is None:
            return m(tokens)[0]
        with adapted(m, bank, config):
            return m(tokens)[0]

    return run(state, bank, tokens)


def _features(base, hyper, tokens, max_chunks=None):
    ids, mask = chunk_document(tokens, CHUNK, max_chunks)
    feats = chunk_encoder(base, hyper.config.layers)(ids)
    return feats[None], jnp.asarray(mask)[None]


@pytest.fixture(scope="module")
def base():
    return preset_model("tiny")


@pytest.fixture(scope="module")
def fresh(base):
    return _hyper(base)


@pytest.fixture(scope="module")
def trained(base):
    return _trained_like(_hyper(base))


def _internalize(base, hyper, doc):
    feats, mask = _features(base, hyper, doc)
    return _generate(hyper, feats, mask)


def test_adapter_at_init_is_a_noop_and_acts_once_trained(base, fresh, trained):
    bank = internalize(base, fresh, DOC, chunk_len=CHUNK)  # the public one-document path
    assert bank.a.shape == (1, 2, 4 * 2, 128) and bank.b.shape == (1, 2, 8, 64)
    assert float(jnp.abs(bank.a).max()) > 0  # A is not zeroed (its gradient path stays open)
    want = _logits(base)
    np.testing.assert_array_equal(np.asarray(_logits(base, QUERY, bank, fresh.config)),
                                  np.asarray(want))
    moved = _logits(base, QUERY, _internalize(base, trained, DOC), trained.config)
    assert float(jnp.abs(moved - want).max()) > 1e-3


def test_chunk_concatenation_is_the_rank_sum_of_per_chunk_adapters(base, trained):
    hyper, cfg = trained, trained.config
    feats, mask = _features(base, hyper, DOC)
    merged = _generate(hyper, feats, mask)
    # each chunk on its own: its single-chunk adapter minus the (shared) bias part
    bias = LoRABank(hyper.bias_a[...][None] * cfg.bias_scaler, hyper.bias_b[...][None])
    singles = [_generate(hyper, feats[:, c:c + 1], mask[:, c:c + 1]) for c in range(3)]
    want = bank_delta(bias, cfg) + sum(bank_delta(s, cfg) - bank_delta(bias, cfg)
                                       for s in singles)
    np.testing.assert_allclose(np.asarray(bank_delta(merged, cfg)), np.asarray(want),
                               rtol=1e-4, atol=1e-4)
    # the model with the concatenated adapter == the base with ΔW = Σ_c ΔW_c + ΔW_bias merged
    got = _logits(base, QUERY, merged, cfg)
    dense = nnx.clone(base)
    for i, layer in enumerate(cfg.layers):
        proj = dense.layers[layer].mlp.down_proj
        proj.kernel[...] = proj.kernel[...] + want[i]
    np.testing.assert_allclose(np.asarray(got), np.asarray(_logits(dense)), rtol=1e-4,
                               atol=1e-4)
    # chunk order does not change the merged update
    reverse = _generate(hyper, feats[:, ::-1], mask[:, ::-1])
    np.testing.assert_allclose(np.asarray(bank_delta(reverse, cfg)),
                               np.asarray(bank_delta(merged, cfg)), rtol=1e-4, atol=1e-4)


def test_padded_chunks_are_zero_ranks_and_change_nothing(base, trained):
    hyper = trained
    short = DOC[:2 * CHUNK - 3]  # 2 chunks
    exact = _internalize(base, hyper, short)
    padded = _generate(hyper, *_features(base, hyper, short, max_chunks=4))
    r = hyper.config.rank
    assert padded.a.shape[2] == (4 + 1) * r
    np.testing.assert_array_equal(np.asarray(padded.a[:, :, 2 * r:4 * r]), 0.0)
    np.testing.assert_array_equal(np.asarray(padded.b[:, :, 2 * r:4 * r]), 0.0)
    np.testing.assert_allclose(np.asarray(_logits(base, QUERY, padded, hyper.config)),
                               np.asarray(_logits(base, QUERY, exact, hyper.config)),
                               rtol=1e-5, atol=1e-5)


def test_adapter_shape_is_fixed_by_the_latents_not_the_length(fresh):
    for length in (5, 17):
        bank = _generate(fresh, jnp.ones((1, 1, 2, length, 64)), jnp.ones((1, 1, length), bool))
        assert bank.a.shape == (1, 2, 4, 128) and bank.b.shape == (1, 2, 4, 64)


def test_each_batch_row_uses_its_own_document(base, trained):
    banks = [_internalize(base, trained, d) for d in (DOC[:CHUNK], DOC[CHUNK:2 * CHUNK])]
    both = LoRABank(jnp.concatenate([b.a for b in banks]), jnp.concatenate([b.b for b in banks]))
    queries = jnp.concatenate([QUERY, QUERY[:, ::-1]])
    together = _logits(base, queries, both, trained.config)
    for i, bank in enumerate(banks):
        alone = _logits(base, queries[i:i + 1], bank, trained.config)
        np.testing.assert_allclose(np.asarray(together[i]), np.asarray(alone[0]), rtol=1e-5,
                                   atol=1e-5)


def test_topk_distill_is_cross_entropy_for_a_one_hot_teacher_and_shift_invariant():
    logits = jax.random.normal(jax.random.key(0), (6, 11))
    targets = jnp.arange(6) % 11
    got = topk_distill(logits, jnp.zeros((6, 1)), targets[:, None])
    np.testing.assert_allclose(float(got), float(cross_entropy(logits, targets)), rtol=1e-6)
    logp, idx = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (6, 11))),
                              4)
    np.testing.assert_allclose(float(topk_distill(logits + 7.5, logp, idx)),
                               float(topk_distill(logits, logp, idx)), rtol=1e-5)
    weights = jnp.asarray([1.0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(float(topk_distill(logits, logp, idx, weights)),
                               float(topk_distill(logits[:1], logp[:1], idx[:1])), rtol=1e-6)


def _docs(n=4):
    rng = np.random.default_rng(1)
    return [[int(x) for x in rng.integers(1, 255, int(rng.integers(6, 15)))] for _ in range(n)]


@pytest.fixture(scope="module")
def data(base):
    docs = _docs()
    return build_distill_data(base, docs, [[7, 8, 9]] * len(docs), [[d[0], d[1]] for d in docs],
                              layers=(0, 1), chunk_len=CHUNK, max_chunks=2, top_k=4,
                              batch_size=2)


def test_distill_data_aligns_teacher_to_student_positions(base, data):
    doc = _docs()[0]
    teacher = jnp.asarray([doc + [7, 8, 9, doc[0], doc[1]]])
    logp = jax.nn.log_softmax(_logits(base, teacher)[0], axis=-1)
    start = len(doc) + 2  # logits at the last question token predict answer token 0
    top, idx = jax.lax.top_k(logp[start:start + 2], 4)
    np.testing.assert_array_equal(data.teacher_idx[0, 2:4], np.asarray(idx))
    np.testing.assert_allclose(data.teacher_logp[0, 2:4], np.asarray(top), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(data.weights[0], [0, 0, 1, 1, 0])
    assert data.features.shape == (4, 2, 2, CHUNK, 64)


def _reference_distill_data(base, docs, questions, answers, layers, max_chunks, top_k):
    """The build by its definition, one document at a time: each chunk encoded on its own,
    the teacher's full logits on ``document + question + answer``, top-k at the answer."""
    feats, masks, logps, idxs = [], [], [], []
    width = max(len(q) + len(a) for q, a in zip(questions, answers))
    encode = chunk_encoder(base, layers)
    graph, state = nnx.split(base)
    teacher = jax.jit(lambda st, t: jax.nn.log_softmax(nnx.merge(graph, st)(t)[0], axis=-1))
    for d, q, a in zip(docs, questions, answers):
        ids, mask = chunk_document(d, CHUNK, max_chunks)
        feats.append(np.asarray(encode(ids)) * mask[:, None, :, None])
        masks.append(mask)
        row = np.zeros((1, 32), np.int32)  # right padding: causal, so one shape for all
        row[0, :len(d + q + a)] = d + q + a
        logp = teacher(state, row)[0]
        top, idx = jax.lax.top_k(logp[len(d) + len(q) - 1:len(d) + len(q) - 1 + len(a)], top_k)
        lp, ix = np.zeros((width, top_k), np.float32), np.zeros((width, top_k), np.int32)
        lp[len(q) - 1:len(q) - 1 + len(a)], ix[len(q) - 1:len(q) - 1 + len(a)] = top, idx
        logps.append(lp)
        idxs.append(ix)
    return np.stack(feats), np.stack(masks), np.stack(logps), np.stack(idxs)


def test_batched_distill_data_equals_the_per_document_build(base):
    """Length buckets, padded batches, top-k on the answer rows only and first-chunk features
    taken from the teacher pass give what encoding / scoring each document alone gives."""
    rng = np.random.default_rng(3)
    docs = [[int(x) for x in rng.integers(1, 255, n)] for n in (3, 16, 9, 5, 13, 8, 11, 2)]
    questions = [[7, 8, 9][:1 + i % 3] for i in range(len(docs))]
    answers = [[d[0], d[-1]][:1 + i % 2] for i, d in enumerate(docs)]
    fast = build_distill_data(base, docs, questions, answers, layers=(1, 0), chunk_len=CHUNK,
                              max_chunks=2, top_k=4, batch_size=3, bucket=8)
    feats, mask, logp, idx = _reference_distill_data(base, docs, questions, answers, (1, 0), 2, 4)
    np.testing.assert_array_equal(fast.mask, mask)
    np.testing.assert_allclose(fast.features, feats, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fast.teacher_idx, idx)
    np.testing.assert_allclose(fast.teacher_logp, logp, rtol=1e-5, atol=1e-5)
    for i, (q, a) in enumerate(zip(questions, answers)):
        np.testing.assert_array_equal(fast.queries[i, :len(q) + len(a)], q + a)
        np.testing.assert_array_equal(np.flatnonzero(fast.weights[i]),
                                      np.arange(len(q) - 1, len(q) - 1 + len(a)))
    half = build_distill_data(base, docs[:3], questions[:3], answers[:3], layers=(1, 0),
                              chunk_len=CHUNK, max_chunks=2, top_k=4, batch_size=3, bucket=8,
                              feature_dtype=np.float16)
    assert half.features.dtype == np.float16
    np.testing.assert_allclose(half.features, feats[:3], rtol=2e-3, atol=2e-3)


def _kl_gap(hyper, base, data, bank=None):
    """Distillation KL on ``data`` minus its floor (the teacher's own top-k cross-entropy)."""
    batch = DistillData(*(jnp.asarray(x) for x in data))
    bank = _generate(hyper, batch.features, batch.mask) if bank is None else bank
    kl = float(distill_loss(bank, base, hyper.config, batch)[1][0])
    w = np.asarray(data.weights)
    own = -(np.exp(data.teacher_logp) * data.teacher_logp).sum(-1)
    return kl - float(np.mean((own * w).sum(1) / w.sum(1)))


def test_training_lowers_the_loss_and_never_touches_the_base(base, fresh, data):
    before = jax.tree.map(np.asarray, nnx.state(base))
    hyper = nnx.clone(fresh)
    gap = _kl_gap(hyper, base, data)
    history = train_doc_to_lora(hyper, base, data, steps=30, batch_size=2,
                                learning_rate=1e-2, warmup=2, l1_weight=0.01)
    assert len(history) == 30 and all(np.isfinite(r["loss"]) for r in history)
    assert _kl_gap(hyper, base, data) < 0.7 * gap, (gap, _kl_gap(hyper, base, data))
    assert float(jnp.abs(hyper.scale_b[...]).max()) > 0  # the B path learned
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(base)))


def test_trained_adapter_carries_each_documents_fact(base, data):
    """The answer of document i is its own first token (one-hot teacher) and every question
    is the same, so only the document's features can tell the answers apart. After training,
    each document's own adapter must beat another document's adapter: were the features cut
    off from the heads (or the B scalers stuck at 0), both losses would be equal."""
    idx = np.zeros_like(data.teacher_idx)
    idx[:, 2, 0] = np.asarray(data.queries)[:, 3]  # position 2 predicts d[0]
    logp = np.full(data.teacher_logp.shape, -1e9, np.float32)
    logp[..., 0] = 0.0  # p = 1 on the document's own token
    weights = np.zeros_like(data.weights)
    weights[:, 2] = 1.0
    onehot = data._replace(teacher_logp=logp, teacher_idx=idx, weights=weights)
    hyper = _hyper(base, rank=4, d_latent=32)
    batch = DistillData(*(jnp.asarray(x) for x in onehot))
    init = float(distill_loss(_generate(hyper, batch.features, batch.mask), base, hyper.config,
                              batch)[1][0])
    train_doc_to_lora(hyper, base, onehot, steps=20, batch_size=4, learning_rate=3e-2, warmup=2,
                      l1_weight=0.0)
    own = _generate(hyper, batch.features, batch.mask)
    swapped = _generate(hyper, batch.features[::-1], batch.mask[::-1])  # doc i gets doc 3-i's
    own_kl = float(distill_loss(own, base, hyper.config, batch)[1][0])
    swapped_kl = float(distill_loss(swapped, base, hyper.config, batch)[1][0])
    assert own_kl < init - 0.5, (init, own_kl)
    assert own_kl < swapped_kl - 0.25, (own_kl, swapped_kl)


@pytest.mark.slow
def test_resumed_training_equals_an_uninterrupted_run(tmp_path, base, fresh, data):
    options = dict(batch_size=2, learning_rate=1e-2, warmup=1)
    full = nnx.clone(fresh)
    train_doc_to_lora(full, base, data, steps=4, **options)
    train_doc_to_lora(nnx.clone(fresh), base, data, steps=2, run_dir=tmp_path, save_every=1,
                      **options)
    resumed = _trained_like(nnx.clone(fresh))  # other weights: all must come from the checkpoint
    rows = train_doc_to_lora(resumed, base, data, steps=4, run_dir=tmp_path, save_every=1,
                             resume=True, **options)
    assert [r["step"] for r in rows] == [3, 4]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 nnx.state(full, nnx.Param), nnx.state(resumed, nnx.Param))
    with pytest.raises(ValueError, match="resume=True"):  # never silently mix two runs
        train_doc_to_lora(nnx.clone(fresh), base, data, steps=4, run_dir=tmp_path, **options)
    loaded = load_hypernetwork(tmp_path)  # the run folder's final hypernetwork/
    assert loaded.config == fresh.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded, nnx.Param),
                 nnx.state(resumed, nnx.Param))


def test_answer_cross_entropy_term_is_the_nll_of_the_answer_tokens(base, trained, data):
    batch = DistillData(*(jnp.asarray(x) for x in data))
    bank = _generate(trained, batch.features, batch.mask)
    kl_only, (kl, l1) = distill_loss(bank, base, trained.config, batch, l1_weight=0.1)
    with_ce, (kl2, _) = distill_loss(bank, base, trained.config, batch, l1_weight=0.1,
                                     ce_weight=0.5)
    logp = np.asarray(jax.nn.log_softmax(_logits(base, batch.queries, bank, trained.config)))
    w, q = np.asarray(data.weights), np.asarray(data.queries)
    nll = [-sum(logp[i, t, q[i, t + 1]] for t in np.flatnonzero(w[i])) / w[i].sum()
           for i in range(len(q))]  # answer token t + 1 at each weighted position t
    np.testing.assert_allclose(float(with_ce - kl_only), 0.5 * np.mean(nll), rtol=1e-4)
    np.testing.assert_allclose(float(kl2), float(kl), rtol=1e-6)  # the KL is reported alone


@pytest.mark.slow
def test_evaluations_are_logged_and_an_interrupted_run_restores(tmp_path, base, fresh, data):
    calls = []

    def evaluate(hyper):  # a value of the current weights: proves hyper holds them
        calls.append(float(jnp.sum(hyper.scale_b[...])))
        return {"probe": calls[-1]}

    options = dict(batch_size=2, learning_rate=1e-2, warmup=1, save_every=2, evaluate=evaluate,
                   eval_every=2)
    partial = nnx.clone(fresh)
    rows = train_doc_to_lora(partial, base, data, steps=4, run_dir=tmp_path, **options)
    logged = [r for r in rows if "probe" in r]
    assert [r["step"] for r in logged] == [2, 4] and calls[0] != calls[1]
    np.testing.assert_allclose(logged[1]["kl_mean"], np.mean([r["kl"] for r in rows[2:]]),
                               rtol=1e-6)
    restored = _trained_like(nnx.clone(fresh))
    step, curve = restore_hypernetwork(restored, tmp_path)
    assert step == 4 and curve == [json.loads(json.dumps(r)) for r in logged]
    jax.tree.map(np.testing.assert_array_equal, nnx.state(partial, nnx.Param),
                 nnx.state(restored, nnx.Param))
    # resuming past a lost evaluation row: rows after the restored step are dropped first
    with open(tmp_path / "curve.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "probe": -1.0}) + "\n")
    more = train_doc_to_lora(nnx.clone(fresh), base, data, steps=6, run_dir=tmp_path,
                             resume=True, **options)
    assert [r["step"] for r in more] == [5, 6]
    assert [r["step"] for r in restore_hypernetwork(nnx.clone(fresh), tmp_path)[1]] == [2, 4, 6]
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        restore_hypernetwork(nnx.clone(fresh), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="needs evaluate"):
        train_doc_to_lora(nnx.clone(fresh), base, data, steps=2, eval_every=1)


def test_context_distillation_fits_one_document(base, fresh, data):
    one = DistillData(*(np.asarray(x)[:1] for x in data))
    distill = context_distiller(base, fresh.config, total_rank=4, steps=20, learning_rate=3e-2)
    start = context_distiller(base, fresh.config, total_rank=4, steps=0)(one)  # B = 0: no-op
    gap_start = _kl_gap(fresh, base, one, start)
    gap_end = _kl_gap(fresh, base, one, distill(one))
    assert gap_end < 0.5 * gap_start, (gap_start, gap_end)


def test_exported_adapter_is_peft_and_loads_back(tmp_path, base, trained):
    hyper = trained
    bank = _internalize(base, hyper, DOC)
    config = export_generated_adapter(base, bank, hyper.config, tmp_path / "ad",
                            base_model_name_or_path="tiny")
    rank = 4 * hyper.config.rank
    assert config["r"] == rank and config["peft_type"] == "LORA"
    assert config["use_rslora"] is False
    assert config["lora_alpha"] / config["r"] == pytest.approx(default_alpha(2))
    on_disk = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert on_disk == json.loads(json.dumps(config))
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers"
    assert {k: v.shape for k, v in tensors.items()} == {
        f"{prefix}.{i}.mlp.down_proj.lora_{m}.weight": s
        for i in (0, 1) for m, s in (("A", (rank, 128)), ("B", (64, rank)))}
    # PEFT's LoRA forward (W_torch [out, in] += lora_alpha / r · B @ A) gives our update
    scale = config["lora_alpha"] / config["r"]
    delta = np.asarray(bank_delta(bank, hyper.config))
    for i in (0, 1):
        a = tensors[f"{prefix}.{i}.mlp.down_proj.lora_A.weight"]
        b = tensors[f"{prefix}.{i}.mlp.down_proj.lora_B.weight"]
        np.testing.assert_allclose(scale * (b @ a).T, delta[i], rtol=1e-4, atol=1e-4)
    assert not any(type(m).__name__ == "LoRALinear" for _, m in nnx.iter_modules(base))
    # our loader (hub.load_model on the adapter folder, as `generate --model DIR` does); the
    # "tiny" base is the seed-0 preset, the same weights as `base`
    loaded, _ = load_model(str(tmp_path / "ad"))
    np.testing.assert_allclose(np.asarray(_logits(loaded)),
                               np.asarray(_logits(base, QUERY, bank, hyper.config)),
                               rtol=1e-4, atol=1e-4)


def test_internalize_command_writes_an_adapter_generate_reads(tmp_path, capsys):
    from lowrank_jax.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The secret code of Wendy is 45. The grass is green.")
    out = tmp_path / "adapter"
    assert main(["internalize", "--model", "tiny", "--doc", str(doc), "--out", str(out),
                 "--chunk-len", "32", "--layers", "0,1", "--rank", "2"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == (2 + 1) * 2 and config["base_model_name_or_path"] == "tiny"
    text = doc.read_text()
    assert f"internalized {len(text.encode())} tokens (2 chunks)" in capsys.readouterr().out
    # no --hyper: a fresh hypernetwork, whose adapter is a no-op (B = 0 at init) ...
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    b_keys = [k for k in tensors if "lora_B" in k]
    assert len(b_keys) == 2 and all(not tensors[k].any() for k in b_keys)  # 2 x down_proj
    # ... so generating through it continues the prompt exactly as the base model does
    argv = ["--prompt", "Wendy", "--raw", "--max-new-tokens", "2"]
    assert main(["generate", "--model", str(out)] + argv) == 0
    with_adapter = capsys.readouterr().out
    assert main(["generate", "--model", "tiny"] + argv) == 0
    assert with_adapter == capsys.readouterr().out


def test_hypernetwork_round_trip(tmp_path, trained):
    save_hypernetwork(trained, tmp_path / "h")
    loaded = load_hypernetwork(tmp_path / "h")
    assert loaded.config == trained.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded, nnx.Param),
                 nnx.state(trained, nnx.Param))


@pytest.mark.no_typecheck
def test_clear_errors(tmp_path, base, fresh):
    with pytest.raises(ValueError, match="outside the model"):
        _hyper(base, layers=(0, 5))
    with pytest.raises(ValueError, match="n_heads"):
        DocToLoRAConfig(layers=(0,), d_model=8, d_in=8, d_out=8, d_latent=15, n_heads=2)
    with pytest.raises(ValueError, match="max_chunks"):
        chunk_document(DOC, CHUNK, max_chunks=2)
    with pytest.raises(ValueError, match="empty"):
        chunk_document([], CHUNK)
    with pytest.raises(ValueError, match="doc_to_lora.json"):
        load_hypernetwork(tmp_path)
    bank = LoRABank(jnp.zeros((2, 2, 4, 128)), jnp.zeros((2, 2, 4, 64)))
    with pytest.raises(ValueError, match="batch of 3"):
        _logits(base, jnp.zeros((3, 4), jnp.int32), bank, fresh.config)


@pytest.mark.hf
def test_exported_adapter_matches_hf_peft(tmp_path, base, trained):
    try:
        import torch
        import transformers
        from peft import PeftModel
    except ImportError as err:
        raise AssertionError("this test needs torch, transformers and peft: "
                             "pip install torch transformers peft") from err
    from lowrank_jax.hub import save_model

    bank = _internalize(base, trained, DOC)
    save_model(base, tmp_path / "base")
    export_generated_adapter(base, bank, trained.config, tmp_path / "ad",
                   base_model_name_or_path=str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                            torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(QUERY), dtype=torch.long)).logits.numpy()
    ours = np.asarray(_logits(base, QUERY, bank, trained.config))
    assert np.abs(ours - np.asarray(_logits(base))).max() > 1e-3  # the adapter acts
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
