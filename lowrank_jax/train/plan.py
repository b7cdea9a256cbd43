"""Per-device memory plan for a (factorized) Llama on a device mesh, without allocating anything."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lowrank_jax.models.llama import Llama
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.train.config import RunConfig


@dataclasses.dataclass
class MemoryPlan:
    devices: int
    mesh: dict
    params: int
    factor_params: int
    param_bytes_per_device: float
    optimizer_bytes_per_device: float
    activation_bytes_per_device: float

    @property
    def total_bytes_per_device(self) -> float:
        return (self.param_bytes_per_device + self.optimizer_bytes_per_device
                + self.activation_bytes_per_device)

    def table(self) -> str:
        gib = 1024 ** 3
        rows = [
            ("devices", f"{self.devices} (mesh {self.mesh})"),
            ("parameters", f"{self.params / 1e9:.3f} B ({self.factor_params / 1e9:.3f} B in "
                           "low-rank factors)"),
            ("params / device", f"{self.param_bytes_per_device / gib:.3f} GiB"),
            ("optimizer state / device", f"{self.optimizer_bytes_per_device / gib:.3f} GiB"),
            ("activations / device", f"{self.activation_bytes_per_device / gib:.3f} GiB"),
            ("total / device", f"{self.total_bytes_per_device / gib:.3f} GiB"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def auto_mesh(devices: int, mesh: dict) -> dict:
    """Fill an unset (``-1``) or default mesh: data=1, tensor as given, fsdp takes the rest."""
    mesh = dict(mesh)
    fixed = mesh.get("data", 1) * mesh.get("tensor", 1)
    if mesh.get("fsdp", 1) in (-1, 0) or mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get(
            "tensor", 1) != devices:
        if devices % fixed:
            raise ValueError(f"{devices} devices are not divisible by data x tensor = {fixed}.")
        mesh["fsdp"] = devices // fixed
    return mesh


def plan_memory(cfg: RunConfig, devices: int, *, remat: bool = True) -> MemoryPlan:
    """Estimate bytes per device for parameters, optimizer state and activations.

    Parameters and optimizer state follow the sharding rules of
    :mod:`lowrank_jax.train.sharding` (shapes from ``nnx.eval_shape``, nothing allocated).
    Optimizer state: Spectron keeps one fp32 momentum per factor (+ two rank-sized vectors);
    AdamW keeps two fp32 moments for every other leaf. Activations: with rematerialisation per
    layer, the residual stream ``[batch/dp, seq, d]`` per layer plus one layer's working set
    (≈ 16·d + 3·d_ff + 2·heads·seq values per token); without it, every layer's working set.
    """
    mesh = auto_mesh(devices, {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp,
                               "tensor": cfg.mesh.tensor})
    abstract = nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))
    _, state = nnx.split(abstract, nnx.Param)
    pbytes = jnp.dtype(cfg.model.param_dtype).itemsize
    total = factor = 0
    param_dev = opt_dev = 0.0

    def visit(path, leaf):
        nonlocal total, factor, param_dev, opt_dev
        spec = shard_lib.logical_spec(path, leaf.shape)
        shards = 1
        for axis in spec:
            for name in (axis if isinstance(axis, tuple) else (axis,)):
                if name is not None:
                    shards *= mesh[name]
        n = leaf.size
        total += n
        names = [str(getattr(p, "key", p)) for p in path]
        is_factor = any(x in ("a", "b") for x in names[-2:])
        factor += n if is_factor else 0
        param_dev += n * pbytes / shards
        if cfg.optimizer.name == "spectron" and is_factor:
            opt_dev += n * 4 / shards
        else:
            opt_dev += 2 * n * 4 / shards

    jax.tree_util.tree_map_with_path(visit, state)
    m = cfg.model
    batch = cfg.train.batch_size / (mesh["data"] * mesh["fsdp"])
    tokens = batch * cfg.train.seq_len
    abytes = jnp.dtype(m.dtype).itemsize
    per_layer_work = tokens * (16 * m.d_model + 3 * m.d_ff / mesh["tensor"]) * abytes
    attn = batch * m.n_heads / mesh["tensor"] * cfg.train.seq_len * min(cfg.train.seq_len, 1024)
    per_layer_work += attn * abytes
    if remat:
        act = m.n_layers * tokens * m.d_model * abytes + per_layer_work
    else:
        act = m.n_layers * per_layer_work
    act += tokens * m.vocab_size / mesh["tensor"] * 4  # fp32 logits
    return MemoryPlan(devices, mesh, total, factor, param_dev, opt_dev, act)
