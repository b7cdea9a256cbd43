"""Per-device memory plan for a (factorized) Llama on a device mesh, without allocating anything.

Parameters and optimizer state are counted leaf by leaf on the shards the rules of
:mod:`lowrank_jax.train.sharding` give them on the mesh (the very shardings ``pretrain`` creates:
parameter shapes from ``nnx.eval_shape``, the optimizer's state from ``jax.eval_shape(tx.init)``
of the config's own optimizer). With ``layout="tpu"`` each shard is rounded up the way XLA's TPU
layouts pad it (see :func:`tpu_padded_bytes`), which is what ``lowrank-jax compile`` measures;
``lowrank-jax compile`` prints both, and ``tests/train/test_aot_step.py`` holds them together.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from lowrank_jax.models.llama import Llama
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.train.config import RunConfig

_LAYOUTS = (None, "tpu")


@dataclasses.dataclass
class MemoryPlan:
    devices: int
    mesh: dict
    params: int
    factor_params: int
    param_bytes_per_device: float
    optimizer_bytes_per_device: float
    activation_bytes_per_device: float
    remat: bool = True

    @property
    def state_bytes_per_device(self) -> float:
        """Parameters + optimizer state: what the step takes as arguments (without the batch)."""
        return self.param_bytes_per_device + self.optimizer_bytes_per_device

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
            ("activations / device", f"{self.activation_bytes_per_device / gib:.3f} GiB"
                                     + ("" if self.remat else " (no rematerialisation)")),
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


def tpu_padded_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one array of ``shape`` in XLA's TPU layout (an approximation, measured on v5e).

    The minor dimension is padded to 128 lanes; XLA puts the longer of the two minor dimensions
    minor when that pads less; every buffer takes at least 512 bytes.

    Example::

        >>> tpu_padded_bytes((64, 32), 4), tpu_padded_bytes((640, 640), 2), tpu_padded_bytes((), 4)
        (16384, 819200, 512)
    """
    if len(shape) < 2:
        elements = shape[0] if shape else 1
        return max(512, -(-elements * itemsize // 512) * 512)
    *lead, rows, cols = shape
    lanes = lambda n: -(-n // 128) * 128  # noqa: E731
    elements = math.prod(lead) * min(rows * lanes(cols), cols * lanes(rows))
    return max(512, elements * itemsize)


def device_bytes(shape: tuple[int, ...], dtype, layout: str | None = None) -> int:
    """Bytes of a shard of ``shape``: packed, or padded as ``layout`` (``"tpu"``) lays it out."""
    itemsize = jnp.dtype(dtype).itemsize
    if layout == "tpu":
        return tpu_padded_bytes(tuple(shape), itemsize)
    return math.prod(shape) * itemsize


def plan_memory(cfg: RunConfig, devices: int, *, remat: bool | None = None,
                layout: str | None = None) -> MemoryPlan:
    """Estimate bytes per device for parameters, optimizer state and activations.

    Parameters and optimizer state are exact for the rules (see the module docstring); a
    dimension a mesh axis does not divide raises the ``ValueError`` ``pretrain`` would.
    Activations: with rematerialisation per layer, the residual stream ``[batch/dp, seq, d]``
    per layer plus one layer's working set (≈ 16·d + 3·d_ff + 2·heads·seq values per token);
    without it, every layer's working set; plus the fp32 logits.

    Args:
        cfg: the run configuration (model, optimizer, batch; ``cfg.mesh`` is laid over
            ``devices``, fsdp taking what data x tensor leave).
        devices: the number of devices.
        remat: assume per-layer rematerialisation of the activations (default: what
            ``cfg.model.remat`` asks the model to do).
        layout: ``None`` (packed bytes) or ``"tpu"`` (shards padded as XLA's TPU layout does).
    """
    from lowrank_jax.train.optimizers import build_optimizer, with_structure

    remat = cfg.model.remat if remat is None else remat
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use None or 'tpu'.")
    mesh = auto_mesh(devices, {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp,
                               "tensor": cfg.mesh.tensor})
    abstract_mesh = jax.sharding.AbstractMesh(tuple(mesh[a] for a in shard_lib.AXES),
                                              shard_lib.AXES)
    abstract = nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))
    _, params = nnx.split(abstract, nnx.Param)
    param_sh = shard_lib.param_shardings(params, abstract_mesh)
    tx = with_structure(build_optimizer(cfg.optimizer, cfg.train.steps), cfg)
    opt_state = jax.eval_shape(tx.init, params)
    opt_sh = shard_lib.state_shardings(opt_state, params, abstract_mesh)

    def per_device(tree, shardings) -> int:
        return sum(device_bytes(s.shard_shape(x.shape), x.dtype, layout)
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))

    total = factor = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(p, "key", p)) for p in path]
        total += leaf.size
        factor += leaf.size if any(x in ("a", "b") for x in names[-2:]) else 0
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
    return MemoryPlan(devices, mesh, total, factor, float(per_device(params, param_sh)),
                      float(per_device(opt_state, opt_sh)), act, remat)
