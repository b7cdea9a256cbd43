"""Packed multi-job training == K separate runs; per-job isolation; the packing planner."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.nn.multi_lora import MultiLoRALinear
from lowrank_jax.train.multi_job import (
    CostModel,
    JobSpec,
    ModelSpec,
    compare_plans,
    packed_loss,
    per_job_adamw,
    plan_greedy,
    plan_one_per_device,
    plan_plora,
)

RANKS, ALPHAS = (1, 3, 4), (2.0, 6.0, 4.0)
LRS, CLIPS, WDS = (3e-2, 1e-2, 5e-2), (0.05, 10.0, 0.2), (0.0, 0.1, 0.01)
BATCHES = (2, 3, 1)
STEPS = 5


def _data(step):
    keys = jax.random.split(jax.random.key(100 + step), 2 * len(RANKS))
    xs = [jax.random.normal(keys[2 * k], (b, 8)) for k, b in enumerate(BATCHES)]
    ys = [jnp.tanh(x[:, :6] * (k + 1)) for k, x in enumerate(xs)]
    return xs, ys


def _mse_per_example(layer, x, ids):
    return lambda y: jnp.mean((layer(x, ids) - y) ** 2, axis=-1)


def _packed_run(scale_job0=1.0):
    layer = MultiLoRALinear(8, 6, ranks=RANKS, alphas=ALPHAS, rngs=nnx.Rngs(0))
    graph, lora, rest = nnx.split(layer, nnx.LoRAParam, ...)
    tx = per_job_adamw(LRS, clip_norms=CLIPS, weight_decays=WDS)
    opt = tx.init(lora)
    init = jax.tree.map(lambda v: v, lora)
    ids = jnp.concatenate([jnp.full((b,), k) for k, b in enumerate(BATCHES)])

    @jax.jit
    def step(lora, opt, x, y):
        def loss(lora):
            per_ex = jnp.mean((nnx.merge(graph, lora, rest)(x, ids) - y) ** 2, axis=-1)
            per_ex = per_ex * jnp.where(ids == 0, scale_job0, 1.0)
            return packed_loss(per_ex, ids, len(RANKS))[0]
        grads = jax.grad(loss)(lora)
        upd, opt = tx.update(grads, opt, lora)
        return optax.apply_updates(lora, upd), opt

    for t in range(STEPS):
        xs, ys = _data(t)
        lora, opt = step(lora, opt, jnp.concatenate(xs), jnp.concatenate(ys))
    nnx.update(layer, lora)
    return layer, init


def _solo_run(k, packed_init, base):
    layer = MultiLoRALinear(8, 6, ranks=(RANKS[k],), alphas=(ALPHAS[k],), rank_pad=1,
                            rngs=nnx.Rngs(1))
    layer.kernel[...], layer.bias[...] = base.kernel[...], base.bias[...]
    r = RANKS[k]
    layer.lora_a[...] = packed_init["lora_a"].get_value()[k:k + 1, :, :r]
    layer.lora_b[...] = packed_init["lora_b"].get_value()[k:k + 1, :r]
    graph, lora, rest = nnx.split(layer, nnx.LoRAParam, ...)
    tx = optax.chain(optax.clip_by_global_norm(CLIPS[k]),
                     optax.adamw(LRS[k], weight_decay=WDS[k]))
    opt = tx.init(lora)
    ids = jnp.zeros((BATCHES[k],), jnp.int32)

    @jax.jit
    def step(lora, opt, x, y):
        grads = jax.grad(lambda l: jnp.mean((nnx.merge(graph, l, rest)(x, ids) - y) ** 2))(lora)
        upd, opt = tx.update(grads, opt, lora)
        return optax.apply_updates(lora, upd), opt

    for t in range(STEPS):
        xs, ys = _data(t)
        lora, opt = step(lora, opt, xs[k], ys[k])
    nnx.update(layer, lora)
    return layer


def test_packed_training_equals_separate_runs():
    packed, init = _packed_run()
    for k in range(len(RANKS)):
        solo = _solo_run(k, init, packed)
        a, b = packed.adapter(k)
        np.testing.assert_allclose(a, solo.lora_a[...][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, solo.lora_b[...][0], rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(b).max()) > 1e-3  # the adapters did train
    # padded slots stay exactly zero after AdamW with weight decay
    pad = np.asarray(packed.rank_mask()) == 0
    assert np.all(np.asarray(packed.lora_a[...]).transpose(0, 2, 1)[pad] == 0.0)
    assert np.all(np.asarray(packed.lora_b[...])[pad] == 0.0)


def test_scaling_one_jobs_loss_leaves_the_others_unchanged():
    base, _ = _packed_run()
    scaled, _ = _packed_run(scale_job0=1e6)
    for k in (1, 2):
        np.testing.assert_array_equal(scaled.lora_b[...][k], base.lora_b[...][k])
    # job 0 itself: per-job clipping + Adam are invariant to its loss scale (up to fp32 rounding)
    np.testing.assert_allclose(scaled.lora_b[...][0], base.lora_b[...][0], rtol=1e-4, atol=1e-6)


def test_per_job_step_counters_and_inactive_slots():
    tx = per_job_adamw(lambda count: 1e-2 * (count + 1.0), active=[True, False])
    params = {"a": jnp.ones((2, 3))}
    state = tx.init(params)
    for _ in range(3):
        upd, state = tx.update({"a": jnp.ones((2, 3))}, state, params)
    assert state.count.tolist() == [3, 0]
    np.testing.assert_allclose(upd["a"][0], -3e-2, rtol=1e-5)  # lr schedule at count 2
    assert np.all(np.asarray(upd["a"][1]) == 0.0)


def _sweep():
    models = {"small": ModelSpec("small", params=1.35e8, layers=30, lora_dims=7 * 1152,
                                 act_bytes_per_token=2e5),
              "big": ModelSpec("big", params=8e9, layers=32, lora_dims=7 * 8192,
                               act_bytes_per_token=4e6)}
    jobs = [JobSpec(f"s{i}", "small", rank=(4, 8, 16, 32)[i % 4], batch=(1, 2, 4)[i % 3],
                    seq_len=512, steps=100 + 37 * i) for i in range(24)]
    jobs += [JobSpec(f"b{i}", "big", rank=16, batch=(1, 2)[i % 2], seq_len=1024,
                     steps=10 + 3 * i) for i in range(3)]
    return jobs, models


def test_planner_respects_budget_and_beats_baselines():
    jobs, models = _sweep()
    cost = CostModel(memory_bytes=80e9)
    result = compare_plans(jobs, models, cost, devices=4)
    plora = plan_plora(jobs, models, cost, devices=4)
    assert plora.as_dict() == result["plora"]  # deterministic
    by_name = {j.name: j for j in jobs}
    for plan in (plora, plan_one_per_device(jobs, models, cost, 4),
                 plan_greedy(jobs, models, cost, 4)):
        placed = sorted(name for pack in plan.packs for name in pack)
        assert placed == sorted(by_name)  # every job exactly once
        for pack in plan.packs:
            members = [by_name[n] for n in pack]
            assert len({m.model for m in members}) == 1
            assert cost.memory(members, models[members[0].model]) <= 0.9 * 80e9
        assert plan.makespan >= result["lower_bound"]
        assert all(0 <= d < 4 for d in plan.device_of_pack)
    assert plora.makespan <= result["one_per_device"]["makespan"]
    assert plora.makespan <= result["greedy_fill"]["makespan"]
    assert result["speedup_vs_one_per_device"] > 1.5
    # a tighter budget forces smaller packs but is still respected
    tight = plan_plora(jobs, models, CostModel(memory_bytes=30e9), devices=4)
    assert max(len(p) for p in tight.packs if p[0].startswith("b")) == 1


def test_planner_rejects_a_job_that_cannot_fit():
    jobs, models = _sweep()
    with pytest.raises(ValueError, match="budget"):
        plan_plora(jobs, models, CostModel(memory_bytes=10e9), devices=2)
