"""The FedTreeLoRA spec's synthetic study: a deep linear network whose true per-layer updates are
shared by all clients (shallow layers), by pairs of groups (middle) or by one group (deep).

Model: ``depth`` frozen ``d × d`` orthogonal layers (``y = x W_1 … W_L``), each with a LoRA.
Client ``i`` of group ``g`` has targets ``y = x Π_l (W_l + ΔW_l^{(i)})`` with

* ``ΔW_l`` common to everyone for the first 3/8 of the layers (the trunk),
* one per pair of groups (``g // 2``) for the next 3/8,
* one per group, plus small client-specific noise, for the rest (the branches).

Trained with ``simulate(..., loss="mse")``. The ideal per-layer group counts are then about
``(1, 1, 1, 2, 2, 2, G, G)`` for ``depth = 8`` and ``G`` groups.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from lowrank_jax.federated.simulator import Client, simulate
from lowrank_jax.nn import LoRARule, apply_lora


class DeepLinear(nnx.Module):
    """``depth`` bias-free ``d × d`` linear layers (``layers/0..``), no nonlinearity."""

    def __init__(self, d: int, depth: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(d, d, use_bias=False, rngs=rngs)
                                for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def deep_linear_model(*, d: int = 32, depth: int = 8, rank: int = 4, seed: int = 0) -> DeepLinear:
    """A :class:`DeepLinear` with random orthogonal frozen kernels and rank-``rank`` LoRA."""
    model = DeepLinear(d, depth, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng([seed, 7])
    for linear in model.layers:
        q, _ = np.linalg.qr(rng.normal(size=(d, d)))
        linear.kernel[...] = q.astype(np.float32)
    apply_lora(model, LoRARule(r"^layers/", rank=rank), rngs=nnx.Rngs(seed + 1))
    return model


def layer_roles(depth: int) -> list[str]:
    """``"shared"`` / ``"pairs"`` / ``"group"`` per layer: 3/8, 3/8 and 2/8 of the depth
    (rounded), i.e. layers 1–3, 4–6 and 7–8 of 8 as in the spec."""
    first, second = round(3 * depth / 8), round(6 * depth / 8)
    return ["shared" if i < first else "pairs" if i < second else "group" for i in range(depth)]


def make_deep_linear_clients(model: DeepLinear, *, groups: int = 4, per_group: int = 4,
                             update_rank: int = 2, scale: float = 0.5, client_noise: float = 0.1,
                             n_train: int = 128, n_test: int = 128, seed: int = 0):
    """Clients of the synthetic study, targets built on ``model``'s frozen kernels.

    Returns:
        ``(clients, group_of_client [N])``.
    """
    if groups < 1 or per_group < 1:
        raise ValueError(f"groups={groups} and per_group={per_group} must be >= 1.")
    kernels = [np.asarray(linear.kernel[...], np.float64) for linear in model.layers]
    d = kernels[0].shape[0]
    rng = np.random.default_rng(seed)
    roles = layer_roles(len(kernels))

    def low_rank():  # rank update_rank, every singular value equal to scale
        u, _ = np.linalg.qr(rng.normal(size=(d, update_rank)))
        v, _ = np.linalg.qr(rng.normal(size=(d, update_rank)))
        return scale * u @ v.T

    shared = [low_rank() for _ in kernels]
    pairs = [[low_rank() for _ in range((groups + 1) // 2)] for _ in kernels]
    own = [[low_rank() for _ in range(groups)] for _ in kernels]
    clients, group_of = [], []
    for g in range(groups):
        for _ in range(per_group):
            weights = []
            for layer, (w0, role) in enumerate(zip(kernels, roles)):
                if role == "shared":
                    delta = shared[layer]
                elif role == "pairs":
                    delta = pairs[layer][g // 2]
                else:
                    delta = own[layer][g] + client_noise * low_rank()
                weights.append(w0 + delta)
            x = rng.normal(size=(n_train + n_test, d))
            y = x
            for w in weights:
                y = y @ w
            x, y = x.astype(np.float32), y.astype(np.float32)
            clients.append(Client(x[:n_train], y[:n_train], x[n_train:], y[n_train:],
                                  train_rank=model.layers[0].rank,
                                  download_rank=model.layers[0].rank))
            group_of.append(g)
    return clients, np.array(group_of)


def deep_linear_study(strategies: dict, *, seeds=(0,), rounds: int = 30, local_steps: int = 5,
                      learning_rate: float = 1e-2, last: int = 5, progress: bool = False) -> dict:
    """Every strategy on the synthetic study, per seed: held-out MSE and the chosen depths.

    For each seed, one :func:`deep_linear_model` and its :func:`make_deep_linear_clients`;
    every strategy of ``strategies`` (``{name: strategy}``) trains on them with
    :func:`lowrank_jax.federated.simulate` (``loss="mse"``).

    Returns:
        ``{name: {"mse": [per seed], "depths": [per seed, when the strategy reports them]}}``;
        ``mse`` is the personalised held-out loss averaged over the ``last`` rounds.
    """
    results: dict = {name: {"mse": [], "depths": []} for name in strategies}
    for seed in seeds:
        model = deep_linear_model(seed=seed)
        clients, _ = make_deep_linear_clients(model, seed=seed)
        for name, strategy in strategies.items():
            run = simulate(model, clients, strategy, rounds=rounds, local_steps=local_steps,
                           learning_rate=learning_rate, loss="mse", seed=seed, progress=progress,
                           description=f"{name[:24]} seed {seed}")
            results[name]["mse"].append(float(np.mean([h["personal_loss"]
                                                       for h in run.history[-last:]])))
            if "depths" in run.state:
                results[name]["depths"].append([int(d) for d in run.state["depths"]])
    return results
