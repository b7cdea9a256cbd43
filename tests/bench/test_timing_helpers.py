"""The timer's helpers: rotated interleaving, speed-up ratios, AOT-compiled timing."""

import time

import jax.numpy as jnp
import pytest

from lowrank_jax.bench import (
    interleaved_samples,
    reference_matmul_seconds,
    speedup,
    time_compiled,
)


def test_rotated_rounds_start_at_each_candidate_in_turn():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    samples = interleaved_samples(fns, reps=3, warmup=0, rotate=True)
    assert order == list("abc" "bca" "cab")
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}


def test_speedup_of_a_faster_method_is_above_one():
    slow, fast = (lambda: time.sleep(0.05)), (lambda: time.sleep(0.001))
    assert speedup(slow, fast, reps=3, warmup=0) > 1.0


def test_time_compiled_and_the_reference_matmul():
    start = time.perf_counter()
    out, seconds = time_compiled(lambda a, b: a @ b, jnp.eye(3), jnp.full((3, 2), 2.0))
    assert out.tolist() == [[2.0, 2.0]] * 3 and 0 < seconds < time.perf_counter() - start
    # the median of 3 timed runs: at most half the whole call (compile, warm-up and the 3 runs)
    start = time.perf_counter()
    seconds, n = reference_matmul_seconds(2 * 20**3, reps=3)
    assert n == 20 and 0 < 2 * seconds < time.perf_counter() - start
    with pytest.raises(ValueError):
        interleaved_samples({"a": lambda: None}, reps=0)


def test_decode_rates_time_each_decoder_from_its_state_after_the_warm_up_step():
    from lowrank_jax.bench import decode_rates

    seen = {"fast": [], "slow": []}

    def decoder(name, pause):
        def step(state, token):
            seen[name].append(state)
            time.sleep(pause)
            return state + token, state + 1
        return step

    rates = decode_rates({"fast": (decoder("fast", 0.0), 0), "slow": (decoder("slow", 0.01), 10)},
                         1, steps=3, warmup=2, rounds=2)
    # warm-up: 2 steps (the second from the state after the first); each round: 3 steps from it
    assert seen["slow"] == [10, 11] + [11, 12, 13] * 2
    assert [len(v) for v in rates.values()] == [2, 2]
    assert min(rates["fast"]) > max(rates["slow"])
    assert max(rates["slow"]) < 3 / 0.03 * 1.01


def test_cpu_usage_counts_busy_time_not_sleep():
    from lowrank_jax.bench import cpu_usage

    with cpu_usage() as idle:
        time.sleep(0.05)
    start = time.process_time()
    with cpu_usage() as busy:
        while time.process_time() - start < 0.05:
            pass
    assert idle["cpu_seconds"] < 0.03
    assert busy["cpu_seconds"] == pytest.approx(time.process_time() - start, abs=0.03)
    assert len(busy["load_average"]) == 2 and min(busy["load_average"]) >= 0
