"""The coreset error table: its cells, oracle-call counts, and the method's claim at tiny size."""

import jax

from lowrank_jax.data import selection as sel
from lowrank_jax.data.coreset_errors import coreset_error_table


def test_cells_calls_and_the_low_rank_coreset_beats_uniform_on_low_rank_losses():
    A, losses, _ = sel.synthetic_lowrank_losses(jax.random.key(0), n=400, d=8, rank=2)
    table = coreset_error_table(A, losses, (40,), (2,), reps=2, seed=0, lipschitz_kmeans=0.5)
    assert {m: table[m]["m=40,k=2"][2] for m in table} == {
        "uniform": 40, "kmeans_sensitivity": 48, "lowrank_residual": 48}
    for median, p90, _ in (c["m=40,k=2"] for c in table.values()):
        assert 0.0 <= median <= p90
    assert table["lowrank_residual"]["m=40,k=2"][0] < table["uniform"]["m=40,k=2"][0]
