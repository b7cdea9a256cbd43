"""train.step.make_step: equals value_and_grad + tx.update written by hand; wrt; NaN guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.core.step import make_step, trainable


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.hidden = nnx.LoRALinear(8, 8, lora_rank=2, rngs=rngs)
        self.out = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(self.embed(x))))


def _setup():
    graph, params = nnx.split(Tiny(nnx.Rngs(0)))
    x = jax.random.randint(jax.random.key(1), (4, 6), 0, 11)
    y = jnp.roll(x, -1, axis=1)

    def loss_fn(p, x, y):
        return cross_entropy(nnx.merge(graph, p)(x), y)

    return params, loss_fn, x, y


def _assert_trees_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_step_equals_the_hand_written_update_exactly():
    params, loss_fn, x, y = _setup()
    tx = optax.adamw(1e-2, weight_decay=0.1)

    @jax.jit
    def by_hand(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    step = make_step(loss_fn, tx)
    p1 = p2 = params
    s1 = s2 = tx.init(params)
    losses = []
    for _ in range(3):
        p1, s1, l1 = step(p1, s1, x, y)
        p2, s2, l2 = by_hand(p2, s2, x, y)
        assert float(l1) == float(l2)
        losses.append(float(l1))
    _assert_trees_equal((p1, s1), (p2, s2))
    assert losses[-1] < losses[0]  # it trains


def test_wrt_trains_only_the_selected_leaves():
    params, loss_fn, x, y = _setup()
    tx = optax.sgd(0.5)
    step = make_step(loss_fn, tx, wrt=nnx.LoRAParam)
    sub = trainable(params, nnx.LoRAParam)
    assert set(dict(sub.flat_state())) == {("hidden", "lora", "lora_a"),
                                             ("hidden", "lora", "lora_b")}
    new, _, loss = step(params, tx.init(sub), x, y)
    before, after = dict(params.flat_state()), dict(new.flat_state())
    assert before.keys() == after.keys()
    changed = {k for k in before
               if not np.array_equal(np.asarray(before[k].value), np.asarray(after[k].value))}
    assert changed == {("hidden", "lora", "lora_b")}  # lora_b starts at 0: a's gradient is 0
    # the LoRA update is the one of the full gradient restricted to lora_b
    grads = jax.grad(loss_fn)(params, x, y)
    g_b = dict(grads.flat_state())[("hidden", "lora", "lora_b")].value
    np.testing.assert_allclose(np.asarray(after[("hidden", "lora", "lora_b")].value),
                               -0.5 * np.asarray(g_b), rtol=1e-6, atol=1e-7)
    assert float(loss) == pytest.approx(float(loss_fn(params, x, y)), rel=1e-6)


def test_has_aux_and_a_nonfinite_update_is_skipped():
    tx = optax.sgd(1.0)

    def loss_fn(w, scale):
        loss = jnp.sum(w ** 2) * scale
        return loss, 2 * loss

    step = make_step(loss_fn, tx, has_aux=True, skip_nonfinite=True)
    w, state = jnp.ones(3), tx.init(jnp.ones(3))
    w1, _, m = step(w, state, 0.25)
    np.testing.assert_allclose(np.asarray(w1), 0.5)  # w - 1.0 * 2 * 0.25 * w
    assert bool(m["finite"]) and float(m["loss"]) == 0.75 and float(m["aux"]) == 1.5
    assert float(m["grad_norm"]) == pytest.approx(np.sqrt(3) * 0.5)
    w2, _, m = step(w, state, jnp.inf)
    assert not bool(m["finite"])
    np.testing.assert_array_equal(np.asarray(w2), np.asarray(w))


def test_wrt_needs_an_nnx_state():
    with pytest.raises(TypeError, match="nnx.State"):
        make_step(lambda p: jnp.sum(p["a"]), optax.sgd(1.0), wrt=nnx.Param, jit=False)(
            {"a": jnp.ones(2)}, ())


def test_donate_consumes_the_state_and_gives_the_same_step():
    params, loss_fn, x, y = _setup()
    tx = optax.adam(1e-2)
    keep = make_step(loss_fn, tx, wrt=nnx.LoRAParam)
    donate = make_step(loss_fn, tx, wrt=nnx.LoRAParam, donate=True)
    state = tx.init(trainable(params, nnx.LoRAParam))
    expected = keep(params, state, x, y)
    copy = jax.tree.map(jnp.copy, (params, state))
    got = donate(*copy, x, y)
    _assert_trees_equal(got, expected)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(copy))  # buffers reused
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((params, state)))


def test_scan_steps_equals_a_python_loop_of_steps():
    from lowrank_jax.core.step import scan_steps

    tx = optax.adam(0.1)
    loss = lambda w, x, y, scale: jnp.sum((scale * w * x - y) ** 2)  # noqa: E731
    xs, ys = jnp.arange(6.0).reshape(3, 2), jnp.ones((3, 2))
    w0 = jnp.array([0.5, -0.5])
    step = make_step(loss, tx, jit=False)
    w, state, values = jax.jit(scan_steps, static_argnums=0)(step, w0, tx.init(w0), (xs, ys),
                                                            2.0)
    ref_w, ref_state, ref_values = w0, tx.init(w0), []
    for x, y in zip(xs, ys):
        ref_w, ref_state, v = step(ref_w, ref_state, x, y, 2.0)
        ref_values.append(v)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)
    np.testing.assert_allclose(values, ref_values, rtol=1e-6)
    assert int(state[0].count) == 3
