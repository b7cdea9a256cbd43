"""federated.report on hand-made results: the row means, the tree before / after it is built,
the verdict and the note's table."""

import types

import numpy as np

from lowrank_jax.federated.report import client_row, fedtree_verdict, tree_of, write_domain_note

LABELS = ["a", "a", "b", "b"]


def _result(built):
    metrics = {"personal_loss": np.array([1.0, 2.0, 3.0, 5.0]),
               "personal_accuracy": np.array([0.1, 0.2, 0.3, 0.4]),
               "global_loss": np.array([2.0, 2.0, 4.0, 4.0]),
               "global_accuracy": np.array([0.5, 0.5, 0.5, 0.5])}
    history = [{"bytes_down": 1e6, "train_loss": 3.0}, {"bytes_down": 2e6, "train_loss": 2.0}]
    tree = np.array([[0, 1, 0.1, 2], [2, 3, 0.2, 2], [4, 5, 0.9, 4]])
    return types.SimpleNamespace(client_metrics=metrics, history=history,
                                 state={"tree": tree, "depths": [2], "built": built},
                                 context=types.SimpleNamespace(layers=["q"]))


def test_rows_tree_verdict_and_note(tmp_path):
    row = client_row(_result(1), LABELS, ["a", "b"])
    assert row["personal_nll"] == 2.75 and row["nll_a"] == 1.5 and row["nll_b"] == 4.0
    assert np.isclose(row["personal_acc"], 25.0) and row["mb_sent"] == 3.0
    assert (row["train_loss_first"], row["train_loss_last"]) == (3.0, 2.0)
    assert tree_of(_result(-1), LABELS) is None  # only warm-up rounds: no tree yet
    report = tree_of(_result(1), LABELS)
    assert report["cut_is_domains"] and report["built_round"] == 1
    rows = {"fedtreelora": row, "fedavg": dict(row, personal_nll=3.0)}
    verdict = fedtree_verdict(rows, report, is_real=True)
    assert verdict.startswith("Reproduced: the tree's 2-group cut is exactly the text domains")
    assert verdict.endswith("personalised held-out NLL 2.7500 vs 3.0000 for the best other arm "
                            "(fedavg).")
    assert fedtree_verdict(rows, None, True).startswith("Partly reproduced")
    settings = types.SimpleNamespace(rank=2, pattern="q", clients_per_domain=2, rounds=2,
                                     local_steps=1, lr=0.1, batch=1, length=4, train_windows=2,
                                     heldout_windows=1, seed=0, warmup_rounds=1, tau=0.5,
                                     rebuild_every=5)
    meta = {"command": "cmd", "date": "today", "machine": "here", "elapsed_s": 3.0}
    note = tmp_path / "note.md"
    write_domain_note(note, settings, "tiny", rows, ["a", "b"], report, "tree.png", meta, 1,
                      False, verdict)
    lines = note.read_text().splitlines()
    assert lines[2] == "`cmd` — today, here, 3 s."
    assert "| fedavg | 3.0000 | 25.00 | 3.0000 | 50.00 | 3.00 | 1.5000 | 4.0000 |" in lines
    assert "![FedTreeLoRA tree](tree.png)" in lines and lines[-1] == f"**Verdict.** {verdict}"
