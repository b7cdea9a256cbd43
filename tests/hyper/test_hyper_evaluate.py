"""Answer scoring, the distillation floor, and the needle documents (known answers)."""

import jax.numpy as jnp
import numpy as np

from lowrank_jax.hyper import DistillData, answer_scores, pad_tokens, teacher_floor
from lowrank_jax.hyper.needles import TEST_NAMES, TRAIN_NAMES, make_documents, tokenize


def test_answer_scores_known_answer():
    # two rows; row 0 right on both answer tokens, row 1 wrong on its second (digit) token
    p = np.full((2, 3, 4), 0.1, np.float32)
    p[0, 1, 2], p[0, 2, 3] = 0.7, 0.7
    p[1, 0, 1], p[1, 1, 0] = 0.7, 0.7
    hits, lps, digits = answer_scores(jnp.log(jnp.asarray(p)), jnp.zeros((2, 3), int),
                                      [1, 0], [[2, 3], [1, 2]])
    assert hits == [True, False]
    np.testing.assert_allclose(lps, [2 * np.log(0.7), np.log(0.7) + np.log(0.1)], rtol=1e-5)
    assert digits == [1.0, 0.0]


def test_teacher_floor_is_the_weighted_entropy():
    logp = np.log(np.array([[[0.5, 0.5], [1.0, 1e-30]]]))
    data = DistillData(*([None] * (len(DistillData._fields) - 3)), np.array([[1.0, 3.0]]),
                       logp, np.zeros((1, 2, 2), int))
    np.testing.assert_allclose(teacher_floor(data), np.log(2) / 4, rtol=1e-6)


def test_needle_documents_are_seeded_and_answerable():
    docs = make_documents(np.random.default_rng(0), 3, TRAIN_NAMES, list(range(10, 100)), 2, 7)
    again = make_documents(np.random.default_rng(0), 3, TRAIN_NAMES, list(range(10, 100)), 2, 7)
    assert docs == again and not {d["name"] for d in docs} & set(TEST_NAMES)
    for d in docs:
        assert f"The secret code of {d['name']} is {d['code']}." in d["doc"]

    class Chars:
        def encode(self, text, add_bos=False):
            return [ord(c) for c in text]

    documents, questions, answers = tokenize(Chars(), docs)
    assert "".join(map(chr, answers[0])) == f" {docs[0]['code']}"
    assert pad_tokens(questions).shape == (3, max(map(len, questions)))


def test_evaluator_at_init_scores_the_base_model_and_memory_is_planned():
    """A fresh hypernetwork's adapter is a no-op: its scores are the base model's."""
    from flax import nnx

    from lowrank_jax.hyper import DocToLoRA, build_distill_data, hypernetwork_evaluator
    from lowrank_jax.hyper import working_memory
    from lowrank_jax.models.presets import preset_model

    base = preset_model("tiny")
    hyper = DocToLoRA.for_model(base, layers=(0, 1), rank=2, d_latent=16, n_latents=4,
                                num_blocks=1, n_heads=2, rngs=nnx.Rngs(0))
    docs, questions = [[5, 6, 7, 8, 9], [10, 11, 12]], [[1, 2, 3], [4, 5]]
    answers = [[6, 7], [8, 9]]
    data = build_distill_data(base, docs, questions, answers, layers=(0, 1), chunk_len=8,
                              max_chunks=1, top_k=4)
    evaluate, scores = hypernetwork_evaluator(base, hyper, {"s": (data, questions, answers)})
    tokens = jnp.asarray(pad_tokens([q + a for q, a in zip(questions, answers)]))
    want = answer_scores(base(tokens)[0], tokens, [len(q) - 1 for q in questions], answers)
    got = scores(hyper, "s")
    assert got[0] == want[0] and got[2] == want[2]
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    row = evaluate(hyper)
    np.testing.assert_allclose(row["s_logp"], np.mean(want[1]), rtol=1e-5)
    memory = working_memory(base, hyper, data, layers=(0, 1), chunk_len=8, max_chunks=1,
                            total_rank=4)
    grads_bytes = 4 * 2 * 4 * (hyper.config.d_in + hyper.config.d_out)  # the CD step's output
    assert memory["context_distillation_step"] is None or (
        memory["context_distillation_step"] >= grads_bytes)
    assert memory["doc_to_lora"] is None or memory["doc_to_lora"] > 0


def test_context_distillation_without_steps_scores_the_base_model(tmp_path, saved_figures):
    """B = 0 before any step: each document's fresh adapter is a no-op (first ``n_docs``)."""
    from lowrank_jax.hyper import DocToLoRAConfig
    from lowrank_jax.hyper.doc_to_lora import projection_shape
    from lowrank_jax.hyper.evaluate import context_distillation_scores, plot_learning_curve
    from lowrank_jax.models.presets import preset_model

    base = preset_model("tiny")
    config = DocToLoRAConfig((0, 1), base.cfg.d_model, *projection_shape(base.cfg, "down_proj"),
                             rank=2)
    questions, answers = [[1, 2, 3], [4, 5], [6]], [[6, 7], [8, 9], [1, 2]]
    data = DistillData(*[np.zeros((3, 1))] * len(DistillData._fields))  # no step reads it
    hits, lps, digits, seconds = context_distillation_scores(
        base, config, data, questions, answers, total_rank=4, steps=0, learning_rate=1e-3,
        n_docs=2)
    tokens = jnp.asarray(pad_tokens([q + a for q, a in zip(questions, answers)]))
    want = answer_scores(base(tokens)[0], tokens, [len(q) - 1 for q in questions], answers)
    assert hits == want[0][:2] and digits == want[2][:2] and len(seconds) == 2
    np.testing.assert_allclose(lps, want[1][:2], rtol=1e-5)
    curve = [{"step": s, "heldout_acc": 0.1, "heldout_digits": 0.2, "seen_acc": 0.3,
              "seen_digits": 0.4, "kl_mean": 1.0 / s} for s in (1, 2)]
    plot_learning_curve(curve, 0.5, tmp_path / "curve.png", "title")
    plot = saved_figures[str(tmp_path / "curve.png")]
    assert plot.ink() > 0.02 and plot.figure.get_suptitle() == "title"
    # accuracy panel: four curves and the digit-chance line; KL panel: the KL and the floor
    assert [(label, y) for label, _, y in plot.lines()] == [
        ("held-out exact", [0.1, 0.1]), ("held-out digit acc.", [0.2, 0.2]),
        ("seen exact", [0.3, 0.3]), ("seen digit acc.", [0.4, 0.4]),
        ("digit chance (0.1)", [0.1, 0.1]),
        ("train top-16 KL (mean since previous eval)", [1.0, 0.5]),
        ("teacher floor (0.50)", [0.5, 0.5])]
    assert plot.lines()[0][1] == [1.0, 2.0]  # against the steps
