"""MFU and tokens/s/device on every logged step of ``pretrain`` (metrics.jsonl and the bar)."""

import json
import time

import pytest

from lowrank_jax.models.flops import training_flops_per_token
from lowrank_jax.train import load_config, train
from lowrank_jax.train.loop import Throughput

SMALL = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4",
    "train.eval_batches=1", "train.eval_every=100", "train.checkpoint_every=100",
    "train.log_every=2", "train.steps=4", "optimizer.name=adamw",
]


def test_every_logged_step_carries_tokens_per_device_and_mfu(tmp_path):
    cfg = load_config("tiny", SMALL + [f"run_dir={tmp_path}", "train.peak_tflops=0.5"])
    start = time.perf_counter()
    train(cfg, progress=False, log=lambda *_: None)
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [2, 4]
    flops = training_flops_per_token(cfg.model, cfg.train.seq_len)
    for row in logged:
        # a logged rate counts at least one step's 4 x 32 tokens, timed within the whole run
        assert 4 * 32 / elapsed <= row["tokens_per_s"] < float("inf")
        assert row["tokens_per_s_per_device"] == row["tokens_per_s"]  # one CPU device
        assert row["mfu"] == pytest.approx(flops * row["tokens_per_s_per_device"] / 0.5e12)


def test_mfu_is_null_on_a_cpu_without_a_peak_and_the_bar_shows_it_when_known():
    cpu = Throughput(load_config("tiny", SMALL), devices=4)
    assert cpu.peak is None
    speed = cpu.step(1024, logged=True)
    assert speed["mfu"] is None and speed["tokens_per_s_per_device"] == pytest.approx(
        speed["tokens_per_s"] / 4)
    assert set(Throughput.postfix(speed)) == {"tok_s", "tok_s_dev"}
    given = Throughput(load_config("tiny", SMALL + ["train.peak_tflops=197"]), devices=1)
    assert given.peak == 197e12
    assert set(Throughput.postfix(given.step(1024, logged=True))) == {"tok_s", "tok_s_dev", "mfu"}
    # the first step (the compile) stays out of the rates when it is not logged
    meter = Throughput(load_config("tiny", SMALL), devices=1)
    assert meter.step(1024, logged=False) is None and meter.tokens == 0
    meter.step(1024, logged=False)
    assert meter.tokens == 1024
    with pytest.raises(ValueError, match="train.peak_tflops=-1 must be > 0"):
        load_config("tiny", ["train.peak_tflops=-1"])
