"""Issue 40, build 4: the library API, not only the CLI. Public constructors and transforms given
a wrong shape, dtype or rank, a NaN hyperparameter or a tree without factor pairs raise one
``ValueError`` / ``TypeError`` whose message names the argument (and says how to fix it) —
before any work, not as a NaN or an ``IndexError`` deep inside ``jit``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

NAN = float("nan")
PAIRS = {"p": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))}}
LORA = {"l": {"lora_a": jnp.eye(4, 2), "lora_b": jnp.ones((2, 3))}}
NO_PAIRS = {"w": jnp.ones((4, 4)), "norm": jnp.ones(4)}


def _step(tx, params, **extra):
    state = tx.init(params)
    return tx.update(jax.tree.map(jnp.ones_like, params), state, params, **extra)


class _Model(nnx.Module):
    def __init__(self):
        self.q_proj = nnx.Linear(8, 4, rngs=nnx.Rngs(0))


def _optim():
    from lowrank_jax import optim

    return optim


def _nn():
    from lowrank_jax import nn

    return nn


def _kv():
    from lowrank_jax import kv

    return kv


def _quant():
    from lowrank_jax import quant

    return quant


# name: (call, exception type, what the message must contain: the argument, then the fix)
CASES = {
    "spectron learning_rate NaN": (
        lambda: _step(_optim().spectron(NAN), PAIRS), ValueError,
        ("spectron: learning_rate=nan", "finite number > 0")),
    "spectron learning_rate < 0": (
        lambda: _optim().spectron(-1.0), ValueError, ("learning_rate=-1.0", "e.g. 0.02")),
    "spectron learning_rate a string": (
        lambda: _optim().spectron("fast"), TypeError, ("learning_rate='fast'", "schedule")),
    "spectron momentum 1.5": (
        lambda: _optim().spectron(0.1, momentum=1.5), ValueError, ("momentum=1.5", "[0, 1)")),
    "spectron power_iters 0": (
        lambda: _optim().spectron(0.1, power_iters=0), ValueError, ("power_iters=0", ">= 1")),
    "spectron weight_decay < 0": (
        lambda: _optim().spectron(0.1, weight_decay=-0.1), ValueError,
        ("weight_decay=-0.1", ">= 0")),
    "spectron a tree without factor pairs": (
        lambda: _step(_optim().spectron(0.1), NO_PAIRS), ValueError,
        ("leaf 'norm' is not part of an (a, b) factor pair", "spectron_with_adamw")),
    "spectron factors of different ranks": (
        lambda: _step(_optim().spectron(0.1),
                      {"p": {"a": jnp.ones((8, 2)), "b": jnp.ones((3, 4))}}), ValueError,
        ("disagree on the rank", "a must be [in, r]")),
    "spectron integer factors": (
        lambda: _step(_optim().spectron(0.1), {"p": {"a": jnp.ones((8, 2), jnp.int32),
                                                     "b": jnp.ones((2, 4), jnp.int32)}}),
        TypeError, ("factor 'p/a' has dtype int32", "astype(jnp.float32)")),
    "spectron_with_adamw adamw_lr NaN": (
        lambda: _optim().spectron_with_adamw(0.02, NAN), ValueError,
        ("adamw_lr=nan", "finite number > 0")),
    "spectron_with_adamw eta 0": (
        lambda: _optim().spectron_with_adamw(0.0, 3e-3), ValueError, ("eta=0.0", "> 0")),
    "balora every 0": (
        lambda: _optim().balora(optax.sgd(0.1), every=0), ValueError,
        ("every=0", "positive int")),
    "balora unknown mode": (
        lambda: _optim().balora(optax.sgd(0.1), mode="qr"), ValueError,
        ("mode='qr'", "'svd' or 'procrustes'")),
    "balora a tree without LoRA pairs": (
        lambda: _step(_optim().balora(optax.sgd(0.1)), NO_PAIRS), ValueError,
        ("no LoRA factor pairs", "apply_lora first")),
    "janus learning_rate NaN": (
        lambda: _optim().janus(NAN), ValueError, ("janus: learning_rate=nan", "> 0")),
    "janus a tree without LoRA pairs": (
        lambda: _step(_optim().janus(0.1), NO_PAIRS, subspaces={}), ValueError,
        ("no LoRA factor pairs", "apply_lora first")),
    "janus basis of the wrong width": (
        lambda: _step(_optim().janus(0.1), LORA, subspaces={"l": jnp.eye(5, 1)}), ValueError,
        ("protected basis for 'l' has shape (5, 1)", "pass V of shape [4, k]")),
    "janus basis for no pair": (
        lambda: _step(_optim().janus(0.1), LORA, subspaces={"m": jnp.eye(4, 1)}), ValueError,
        ("subspaces given for ['m']", "")),
    "apply_lora rank 0": (
        lambda: _nn().apply_lora(_Model(), {"q_proj": 0}, rngs=nnx.Rngs(1)), ValueError,
        ("rank=0", "must be a positive int")),
    "apply_lora rank above min(in, out)": (
        lambda: _nn().apply_lora(_Model(), {"q_proj": 9}, rngs=nnx.Rngs(1)), ValueError,
        ("rank=9", "[1, 4]")),
    "apply_lora rank 2.5": (
        lambda: _nn().apply_lora(_Model(), {"q_proj": 2.5}, rngs=nnx.Rngs(1)), ValueError,
        ("rank=2.5", "must be a positive int")),
    "LoRARule alpha NaN": (
        lambda: _nn().LoRARule("q_proj", rank=2, alpha=NAN), ValueError,
        ("alpha=nan", "finite number > 0")),
    "apply_lora a rule matching nothing": (
        lambda: _nn().apply_lora(_Model(), {"zzz": 2}, rngs=nnx.Rngs(1)), ValueError,
        ("rule pattern 'zzz' matches no projection", "Available layer paths: q_proj")),
    "quantize_projections a rule matching nothing": (
        lambda: _quant().quantize_projections(_Model(), "int3"), ValueError,
        ("rule 'int3' matches no projection", "projections: ['q_proj']")),
    "kv_cache_factory unknown method": (
        lambda: _kv().kv_cache_factory("nope", 8.0, 4, 1), ValueError,
        ("KV method 'nope' is unknown", "choose from")),
    "kv_cache_factory ratio NaN": (
        lambda: _kv().kv_cache_factory("xkv", NAN, 4, 1), ValueError, ("ratio=nan", "> 0")),
    "rtn_quantize bits 5": (
        lambda: _quant().rtn_quantize(jnp.ones((4, 64)), bits=5), ValueError,
        ("bits=5", "use one of (2, 3, 4, 8)")),
    "rtn_quantize group_size not dividing": (
        lambda: _quant().rtn_quantize(jnp.ones((4, 64)), group_size=7), ValueError,
        ("group_size=7", "pick e.g. 64")),
    "rtn_quantize a vector": (
        lambda: _quant().rtn_quantize(jnp.ones(64)), ValueError,
        ("weight must be 2-D [out, in]", "(64,)")),
    "rtn_quantize unknown zero_point": (
        lambda: _quant().rtn_quantize(jnp.ones((4, 64)), zero_point="x"), ValueError,
        ("zero_point='x'", "use one of")),
    "kv_cache_factory group 0": (
        lambda: _kv().kv_cache_factory("xkv", 8.0, 0, 1), ValueError,
        ("group_size=0", "positive int")),
}


@pytest.mark.no_typecheck  # the library's own message, not the test-time type checker's
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_library_input_is_one_clear_exception(faults, case):
    call, kind, (argument, fix) = CASES[case]
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert type(info.value) is kind or isinstance(info.value, kind), repr(info.value)
    message = str(info.value)
    assert len(message.strip().splitlines()) == 1, message
    assert argument in message, message
    assert fix in message, message
    faults.clear_error()
