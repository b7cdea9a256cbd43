"""``pretrain --set structure=salaad`` (SALAAD state checkpointed with the run) and
``lowrank-jax export --budget`` (a loadable model at a parameter budget)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from lowrank_jax.cli import main as cli_main
from lowrank_jax.data import batch_at, corpus_bytes
from lowrank_jax.hub import load_model
from lowrank_jax.optim import apply_surrogate, find_salaad_state, hpa_allocate
from lowrank_jax.train import load_config, train
from lowrank_jax.train.losses import cross_entropy
from lowrank_jax.train.structure import (
    FACTORS_FILE,
    export_salaad,
    load_run,
    structured_param_count,
)

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("train.test_structure")

TINY = [
    "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
    "model.d_ff=32", "model.max_seq_len=16", "model.projection=dense", "train.seq_len=16",
    "train.batch_size=8", "train.eval_batches=1", "train.eval_every=100", "train.log_every=1",
    "train.checkpoint_every=4", "train.steps=8", "optimizer.name=adamw",
    "optimizer.learning_rate=0.01", "structure=salaad", "salaad.rho=0.005",
    "salaad.kI_alpha=0.02", "salaad.every=2",
]
QUIET = {"progress": False, "log": lambda *_: None}


@pytest.fixture(scope="module")
def salaad_run(tmp_path_factory):
    cfg = load_config("tiny", TINY + [f"run_dir={tmp_path_factory.mktemp('run')}"])
    return cfg, train(cfg, **QUIET)


def test_config_checks_structure():
    with pytest.raises(ValueError, match="model.projection=dense"):
        load_config("tiny", ["structure=salaad"])  # the tiny preset is factorized
    with pytest.raises(ValueError, match="structure='sparse' is unknown"):
        load_config("tiny", ["structure=sparse"])
    with pytest.raises(ValueError, match=r"^salaad.rho=0 must be > 0"):
        load_config("tiny", ["salaad.rho=0"])


def test_salaad_state_trains_and_resumes_bit_identically(salaad_run, tmp_path):
    cfg, full = salaad_run
    sstate = find_salaad_state(full.state.opt_state)
    # ADMM blocks run at optimizer counts 2, 4, 6 (count > 0 and count % every == 0)
    assert int(sstate.updates) == 3
    rates = [float(r) for r in jax.tree.leaves(sstate.rank_rate)]
    assert min(rates) < 1.0  # thresholds rose: L is no longer full rank everywhere
    split = load_config("tiny", TINY + [f"run_dir={tmp_path}"])
    first = train(split, stop_after=4, **QUIET)
    assert first.state.step == 4
    resumed = train(split, resume=True, **QUIET)
    a = jax.tree.leaves({"p": full.state.params, "o": full.state.opt_state})
    b = jax.tree.leaves({"p": resumed.state.params, "o": resumed.state.opt_state})
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_without_the_structure_is_refused(salaad_run):
    cfg, _ = salaad_run
    plain = load_config("tiny", [o for o in TINY if o != "structure=salaad"]
                        + [f"run_dir={cfg.run_dir}"])
    with pytest.raises(ValueError, match="structure salaad -> None"):
        train(plain, resume=True, **QUIET)


def _loss(model, x, y) -> float:
    logits, _ = model(x)
    return float(cross_entropy(logits, y))


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_export_respects_budget_and_matches_in_memory_allocator(salaad_run, tmp_path, budget):
    cfg, _ = salaad_run
    out = tmp_path / "model"
    report = export_salaad(cfg.run_dir, budget, out, log=lambda *_: None)
    _, state = load_run(cfg.run_dir, log=lambda *_: None)
    sstate = find_salaad_state(state.opt_state)
    n_total = sum(x.size for x in jax.tree.leaves(state.params))
    target = int(budget * n_total)
    allocation = hpa_allocate(sstate, n_total, target)
    assert report["dense_params"] == n_total
    assert report["params"] == allocation.n_params <= target
    assert structured_param_count(out) == allocation.n_params  # the stored factors + values
    assert allocation.n_params >= target - len(allocation.nnz)  # post-fix: < 1 per leaf short
    x, y = batch_at(corpus_bytes(), 3, 4, 16, seed=1)
    in_memory = _loss(nnx.merge(state.graphdef, apply_surrogate(state.params, sstate,
                                                                allocation)), x, y)
    loaded, tokenizer = load_model(str(out))
    assert type(tokenizer).__name__ == "ByteTokenizer"  # from the byte_tokenizer.json marker
    np.testing.assert_allclose(_loss(loaded, x, y), in_memory, rtol=1e-5)
    dense_loss = _loss(nnx.merge(state.graphdef, state.params), x, y)
    assert abs(in_memory - dense_loss) > 1e-4  # the weights really were cut
    # the dense weights on disk are exactly the stored structure U√σ · √σVᵀ + S̃
    with np.load(out / FACTORS_FILE) as f:
        left, right = f["embed_tokens/embedding.left"], f["embed_tokens/embedding.right"]
        rows, cols = f["embed_tokens/embedding.rows"], f["embed_tokens/embedding.cols"]
        values = f["embed_tokens/embedding.values"]
    rebuilt = left @ right
    rebuilt[rows, cols] += values
    stored = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_allclose(stored, rebuilt, atol=1e-6)


def test_export_cli_and_eval_on_the_byte_model(salaad_run, tmp_path, capsys):
    cfg, _ = salaad_run
    out = tmp_path / "m50"
    assert cli_main(["export", "--run", cfg.run_dir, "--budget", "0.5", "--out", str(out)]) == 0
    report = json.loads((out / "salaad.json").read_text())
    assert report["params"] <= report["dense_params"] // 2
    assert (f"{report['params']:,} of {report['dense_params']:,} parameters"
            in capsys.readouterr().out)
    assert cli_main(["eval", "--model", str(out), "--window", "16", "--max-tokens", "200",
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    # the number eval prints is the library's perplexity of the exported model on that text
    from lowrank_jax.hub import load_model
    from lowrank_jax.models.generate import english_eval_text, perplexity
    from lowrank_jax.models.tokenizer import ByteTokenizer

    model, tokenizer = load_model(str(out))
    assert isinstance(tokenizer, ByteTokenizer)
    ids = tokenizer.encode(english_eval_text())[:200]
    want = perplexity(model, ids, window=16, progress=False)
    assert printed.startswith(f"perplexity {want.perplexity:.3f} (nll {want.nll:.4f}")
    assert 1.0 < want.perplexity < 256.0  # a byte model: better than nothing, worse than exact


@pytest.mark.parametrize("argv, message", [
    (["--budget", "1.5"], "--budget 1.5: must be a fraction of the parameters in (0, 1]"),
    (["--budget", "0"], "argument --budget: 0.0 must be > 0"),
    (["--budget", "0.5", "--gamma", "2"], "--gamma 2.0: must lie in [0, 1]"),
])
def test_export_rejects_bad_arguments(salaad_run, tmp_path, capsys, argv, message):
    cfg, _ = salaad_run
    code = None
    try:
        code = cli_main(["export", "--run", cfg.run_dir, "--out", str(tmp_path / "o"), *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_refuses_run_without_salaad_state(tmp_path, capsys):
    plain = [o for o in TINY if o != "structure=salaad"]
    cfg = load_config("tiny", plain + ["train.steps=2", f"run_dir={tmp_path / 'run'}"])
    train(cfg, **QUIET)
    assert cli_main(["export", "--run", cfg.run_dir, "--budget", "0.5",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no SALAAD state; pretrain with the overrides structure=salaad" in err
    (tmp_path / "not_a_run").mkdir()  # a folder that holds no run (and is not --out's parent)
    assert cli_main(["export", "--run", str(tmp_path / "not_a_run"), "--budget", "0.5",
                     "--out", str(tmp_path / "o")]) == 2
    assert "no config.yaml" in capsys.readouterr().err


@pytest.mark.slow
def test_salaad_on_a_mesh_matches_one_device(tmp_path):
    steps = ["train.steps=3", "train.checkpoint_every=100"]  # ADMM block at count 2
    one = train(load_config("tiny", TINY + steps + [f"run_dir={tmp_path / 'one'}"]), **QUIET)
    cfg = load_config("tiny", TINY + steps + [f"run_dir={tmp_path / 'mesh'}", "mesh.data=2",
                                              "mesh.fsdp=4"])
    sharded = train(cfg, **QUIET)
    a = find_salaad_state(one.state.opt_state)
    b = find_salaad_state(sharded.state.opt_state)
    assert int(a.updates) == int(b.updates) == 1
    for x, y in zip(jax.tree.leaves((one.state.params, a.low_rank, a.sparse)),
                    jax.tree.leaves((sharded.state.params, b.low_rank, b.sparse))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
