"""Packed multi-job LoRA training (PLoRA): per-job losses and optimizers, and a packing planner.

K jobs share one frozen base; their adapters are stacked on a leading K axis (see
:class:`lowrank_jax.nn.multi_lora.MultiLoRALinear`). Training them in one step is exactly K
separate runs when

.. math:: L = \\sum_k L_k,\\qquad L_k = \\frac{1}{|T_k|}\\sum_{t \\in T_k} \\ell_t

(never one global token mean, which would scale job k's gradient by ``n_k / N``) and every
optimizer hyperparameter acts per ``[k]`` slice: learning rate, clipping (job k's global norm over
all its slices), weight decay, and Adam's bias-correction step counter.

References:
    Yan et al, `PLoRA: Efficient LoRA Hyperparameter Tuning for Large Models
    <https://arxiv.org/abs/2508.02932>`_, 2025.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


# ------------------------------------------------------------------------------ packed loss


def packed_loss(
    losses: Float[Array, "b ..."],
    adapter_ids: Int[Array, " b"],
    num_jobs: int,
    mask: Float[Array, "b ..."] | None = None,
) -> tuple[Float[Array, ""], Float[Array, " k"]]:
    """Sum over jobs of each job's own mean loss.

    .. math:: L = \\sum_k \\frac{\\sum_{b: id_b = k} \\sum_t w_{bt}\\ell_{bt}}
        {\\max(1, \\sum_{b: id_b = k}\\sum_t w_{bt})}

    Args:
        losses: per-example (or per-token ``[b, t]``) losses; adapter_ids: job of each example.
        num_jobs: K; mask: optional weights like ``losses`` (e.g. valid-token mask).

    Returns:
        ``(L, per_job [K])``; a job with no examples contributes 0.

    Example::

        >>> import jax.numpy as jnp
        >>> total, per = packed_loss(jnp.array([1.0, 3.0, 10.0]), jnp.array([0, 0, 1]), 2)
        >>> float(total), per.tolist()
        (12.0, [2.0, 10.0])
    """
    w = jnp.ones_like(losses) if mask is None else mask.astype(losses.dtype)
    axes = tuple(range(1, losses.ndim))
    num = jax.ops.segment_sum(jnp.sum(losses * w, axis=axes), adapter_ids, num_jobs)
    den = jax.ops.segment_sum(jnp.sum(w, axis=axes), adapter_ids, num_jobs)
    per_job = num / jnp.maximum(den, 1.0)
    return jnp.sum(per_job), per_job


# ------------------------------------------------------------------------ per-job optimizer


class PerJobAdamState(NamedTuple):
    """Adam moments over stacked params plus one step counter per job."""

    count: Int[Array, " k"]
    mu: optax.Params
    nu: optax.Params


def _per_job(vec: Array, leaf: Array) -> Array:
    return vec.reshape((-1,) + (1,) * (leaf.ndim - 1)).astype(leaf.dtype)


def per_job_global_norm(tree: optax.Params) -> Float[Array, " k"]:
    """Each job's global L2 norm over the ``[k]`` slices of every leaf (leaves are ``[K, ...]``)."""
    leaves = jax.tree.leaves(tree)
    sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
             for x in leaves)
    return jnp.sqrt(sq)


def per_job_adamw(
    learning_rates: Sequence[float] | Float[Array, " k"] | Callable[[Array], Array],
    *,
    clip_norms: Sequence[float] | Float[Array, " k"] | None = None,
    weight_decays: Sequence[float] | Float[Array, " k"] | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    active: Sequence[bool] | None = None,
) -> optax.GradientTransformation:
    """AdamW whose lr, clip and weight decay act per job on params stacked on a leading K axis.

    For job k with step counter ``c_k`` (incremented only while the job is active):

    .. math::
        g_k \\leftarrow g_k \\min(1, C_k/\\lVert g_k\\rVert),\\quad
        m_k = \\beta_1 m_k + (1-\\beta_1) g_k,\\; v_k = \\beta_2 v_k + (1-\\beta_2) g_k^2,

        u_k = -\\eta_k(c_k)\\Big(\\frac{m_k/(1-\\beta_1^{c_k})}{\\sqrt{v_k/(1-\\beta_2^{c_k})}
        + \\epsilon} + \\lambda_k \\theta_k\\Big)

    Equals ``optax.chain(optax.clip_by_global_norm(C_k), optax.adamw(η_k, weight_decay=λ_k))``
    run separately per job. Use :func:`reset_job` when a new job takes over slot k.

    Args:
        learning_rates: ``[K]`` constants, or a function ``counts [K] -> lrs [K]`` (schedules;
            ``counts`` are the 0-based step indices, as optax schedules see them).
        clip_norms: ``[K]`` max global norms (``None``/``inf`` = no clipping).
        weight_decays: ``[K]`` decoupled weight decays (default 0).
        b1, b2, eps: shared Adam constants.
        active: ``[K]`` bool; inactive (empty) slots get no update and keep their counter.

    Returns:
        An ``optax.GradientTransformation`` over pytrees of ``[K, ...]`` leaves.

    Example::

        >>> import jax.numpy as jnp
        >>> tx = per_job_adamw([1e-3, 1e-2], clip_norms=[1.0, 1.0])
        >>> params = {"a": jnp.ones((2, 3))}
        >>> state = tx.init(params)
        >>> upd, state = tx.update({"a": jnp.ones((2, 3))}, state, params)
        >>> [round(float(u), 4) for u in upd["a"][:, 0]], state.count.tolist()
        ([-0.001, -0.01], [1, 1])

    References:
        Loshchilov & Hutter, `AdamW <https://arxiv.org/abs/1711.05101>`_, 2017.
    """

    def lr_at(count):
        if callable(learning_rates):
            return jnp.asarray(learning_rates(count), jnp.float32)
        return jnp.asarray(learning_rates, jnp.float32)

    def init_fn(params):
        k = jax.tree.leaves(params)[0].shape[0]
        for leaf in jax.tree.leaves(params):
            if leaf.shape[0] != k:
                raise ValueError(
                    f"per_job_adamw: every leaf needs the same leading job axis; got {leaf.shape} "
                    f"vs K={k}. Stack adapters as [K, ...]."
                )
        zeros = jax.tree.map(jnp.zeros_like, params)
        return PerJobAdamState(jnp.zeros((k,), jnp.int32), zeros, jax.tree.map(jnp.zeros_like,
                                                                                params))

    def update_fn(updates, state, params=None):
        k = state.count.shape[0]
        on = jnp.ones((k,), bool) if active is None else jnp.asarray(active, bool)
        if clip_norms is not None:
            clip = jnp.asarray(clip_norms, jnp.float32)
            norm = per_job_global_norm(updates)
            factor = jnp.where(norm < clip, 1.0, clip / jnp.where(norm > 0, norm, 1.0))
            updates = jax.tree.map(lambda g: g * _per_job(factor, g), updates)
        lr = lr_at(state.count)
        count = state.count + on.astype(jnp.int32)
        mu = jax.tree.map(lambda m, g: jnp.where(_per_job(on, g) > 0, b1 * m + (1 - b1) * g, m),
                          state.mu, updates)
        nu = jax.tree.map(
            lambda v, g: jnp.where(_per_job(on, g) > 0, b2 * v + (1 - b2) * g * g, v),
            state.nu, updates)
        c = jnp.maximum(count, 1).astype(jnp.float32)
        bc1, bc2 = 1 - b1 ** c, 1 - b2 ** c

        def step(m, v, p):
            u = (m / _per_job(bc1, m)) / (jnp.sqrt(v / _per_job(bc2, v)) + eps)
            if weight_decays is not None and p is not None:
                u = u + _per_job(jnp.asarray(weight_decays, jnp.float32), p) * p
            return jnp.where(_per_job(on, u) > 0, -_per_job(lr, u) * u, jnp.zeros_like(u))

        if params is None:
            if weight_decays is not None:
                raise ValueError("per_job_adamw: weight_decays needs params in update().")
            new = jax.tree.map(lambda m, v: step(m, v, None), mu, nu)
        else:
            new = jax.tree.map(step, mu, nu, params)
        return new, PerJobAdamState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def reset_job(state: PerJobAdamState, k: int) -> PerJobAdamState:
    """Zero slot ``k``'s moments and step counter (a new job enters the slot)."""
    zero = lambda t: jax.tree.map(lambda x: x.at[k].set(0), t)  # noqa: E731
    return PerJobAdamState(state.count.at[k].set(0), zero(state.mu), zero(state.nu))


# ------------------------------------------------------------------------------------ planner


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Frozen base model: parameter count, bytes per weight, and the adapted linears."""

    name: str
    params: float
    layers: int
    lora_dims: float  # Σ over adapted modules of one layer of (d_in + d_out)
    bytes_per_param: float = 2.0  # bf16 base
    act_bytes_per_token: float = 0.0  # profiled activation memory per token (all layers)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One LoRA fine-tuning job of a sweep."""

    name: str
    model: str
    rank: int
    batch: int
    seq_len: int
    steps: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Roofline step time of a pack on one device (DERIVED, not from the paper).

    .. math:: t = t_0 + \\max\\Big(\\frac{B_w}{\\mathrm{BW}},\\;
        \\frac{\\sum_j n_j (4P + 6 a_j)}{F}\\Big) + c_K K

    ``B_w`` = base weight bytes read per step (3 passes: forward, recompute-free backward dX,
    plus adapters), ``a_j = r_j · layers · lora_dims`` adapter params. A small pack is
    bandwidth/launch bound, so adding jobs is nearly free until compute saturates — the premise
    of PLoRA.
    """

    memory_bytes: float = 80e9
    bandwidth: float = 3.0e12
    flops: float = 400e12
    overhead_s: float = 5e-3
    per_job_s: float = 2e-4
    headroom: float = 0.10
    workspace_bytes: float = 2e9

    def adapter_params(self, job: JobSpec, model: ModelSpec) -> float:
        return job.rank * model.layers * model.lora_dims

    def memory(self, jobs: Sequence[JobSpec], model: ModelSpec) -> float:
        """``P·bytes + Σ_j (16 a_j + act · n_j) + workspace`` bytes."""
        return (model.params * model.bytes_per_param + self.workspace_bytes
                + sum(16 * self.adapter_params(j, model) + model.act_bytes_per_token * j.tokens
                      for j in jobs))

    def fits(self, jobs: Sequence[JobSpec], model: ModelSpec) -> bool:
        return self.memory(jobs, model) <= (1 - self.headroom) * self.memory_bytes

    def step_time(self, jobs: Sequence[JobSpec], model: ModelSpec) -> float:
        if not jobs:
            return 0.0
        weight_bytes = 2 * model.params * model.bytes_per_param
        flops = sum(j.tokens * (4 * model.params + 6 * self.adapter_params(j, model))
                    for j in jobs)
        return (self.overhead_s + max(weight_bytes / self.bandwidth, flops / self.flops)
                + self.per_job_s * len(jobs))

    def pack_time(self, jobs: Sequence[JobSpec], model: ModelSpec) -> float:
        """Wall time of a pack: every member advances one step per pack step; finished members
        leave, and the step time is recomputed."""
        left = sorted(jobs, key=lambda j: j.steps)
        done, total = 0, 0.0
        while left:
            total += (left[0].steps - done) * self.step_time(left, model)
            done = left[0].steps
            left = [j for j in left if j.steps > done]
        return total


@dataclasses.dataclass
class Plan:
    """Packs (lists of job names), their device, their predicted time, and the makespan."""

    name: str
    packs: list[list[str]]
    device_of_pack: list[int]
    pack_seconds: list[float]
    makespan: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _schedule_lpt(times: Sequence[float], devices: int) -> tuple[list[int], float]:
    """Longest processing time first onto ``devices`` identical devices."""
    load = [0.0] * devices
    where = [0] * len(times)
    for i in sorted(range(len(times)), key=lambda i: (-times[i], i)):
        d = min(range(devices), key=lambda d: (load[d], d))
        where[i] = d
        load[d] += times[i]
    return where, max(load) if times else 0.0


def _check_jobs(jobs, models, cost):
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"plan: job names must be unique; got {names}.")
    for j in jobs:
        if j.model not in models:
            raise ValueError(f"plan: job {j.name!r} uses model {j.model!r}; known models: "
                             f"{sorted(models)}. Add a ModelSpec for it.")
        if not cost.fits([j], models[j.model]):
            raise ValueError(
                f"plan: job {j.name!r} alone needs {cost.memory([j], models[j.model]) / 1e9:.1f} "
                f"GB > budget {(1 - cost.headroom) * cost.memory_bytes / 1e9:.1f} GB; lower its "
                "batch or shard the base."
            )


def _finish(name, packs, models, cost, devices) -> Plan:
    times = [cost.pack_time(p, models[p[0].model]) for p in packs]
    where, makespan = _schedule_lpt(times, devices)
    return Plan(name, [[j.name for j in p] for p in packs], where, times, makespan)


def plan_one_per_device(jobs, models, cost: CostModel, devices: int) -> Plan:
    """Baseline "min-GPU": every job alone on one device, queued (LPT)."""
    _check_jobs(jobs, models, cost)
    return _finish("one_per_device", [[j] for j in jobs], models, cost, devices)


def plan_greedy(jobs, models, cost: CostModel, devices: int) -> Plan:
    """Baseline: fill packs in submission order up to the memory budget (no cost model)."""
    _check_jobs(jobs, models, cost)
    packs: list[list[JobSpec]] = []
    for j in jobs:
        if packs and packs[-1][0].model == j.model and cost.fits(packs[-1] + [j], models[j.model]):
            packs[-1].append(j)
        else:
            packs.append([j])
    return _finish("greedy_fill", packs, models, cost, devices)


def plan_plora(jobs, models, cost: CostModel, devices: int, *, saturation: float = 0.05,
               max_jobs: int = 16) -> Plan:
    """PLoRA-style packing: first-fit by descending work, only while packing still pays.

    Jobs are sorted by work ``steps·batch·seq_len``; job j joins the first pack of the same model
    that (1) stays within the memory budget, (2) has fewer than ``max_jobs`` members, and
    (3) gains: adding j raises the pack's step time by less than ``(1 - saturation)`` of j's solo
    step time. Packs are then scheduled by LPT; while the longest pack bounds the makespan it is
    split in two if that helps (so devices do not idle), and the plan falls back to one job per
    pack if that is better. DERIVED (§5 of the spec; single-device packs only, no base
    sharding, no repacking at completion events).

    Args:
        jobs: the sweep; models: ``{name: ModelSpec}``; cost: device + cost model.
        devices: number of identical devices; saturation: ε of the gain criterion.

    Returns:
        :class:`Plan`.

    Example::

        >>> m = {"tiny": ModelSpec("tiny", params=1e8, layers=4, lora_dims=4096)}
        >>> jobs = [JobSpec(f"j{i}", "tiny", 8, 2, 128, 100) for i in range(4)]
        >>> p = plan_plora(jobs, m, CostModel(), devices=2)
        >>> p.packs, p.makespan < plan_one_per_device(jobs, m, CostModel(), 2).makespan
        ([['j0', 'j2'], ['j1', 'j3']], True)
    """
    _check_jobs(jobs, models, cost)
    order = sorted(jobs, key=lambda j: (-j.steps * j.tokens, j.name))
    packs: list[list[JobSpec]] = []
    for j in order:
        model = models[j.model]
        solo = cost.step_time([j], model)
        for p in packs:
            if p[0].model != j.model or len(p) >= max_jobs or not cost.fits(p + [j], model):
                continue
            if cost.step_time(p + [j], model) - cost.step_time(p, model) < (1 - saturation) * solo:
                p.append(j)
                break
        else:
            packs.append([j])
    # Refine: while the longest pack is the bottleneck, split it in two if that lowers C_max.
    best = _finish("plora", packs, models, cost, devices)
    for _ in range(4 * len(jobs)):
        big = max(packs, key=lambda p: (cost.pack_time(p, models[p[0].model]), len(p)))
        if len(big) == 1:
            break
        trial = [q for q in packs if q is not big] + [big[::2], big[1::2]]
        plan = _finish("plora", trial, models, cost, devices)
        if plan.makespan >= best.makespan:
            break
        packs, best = trial, plan
    solo = _finish("plora", [[j] for j in order], models, cost, devices)
    return best if best.makespan <= solo.makespan else solo


def makespan_lower_bound(jobs, models, cost: CostModel, devices: int) -> float:
    """``Σ_j steps_j · flops_j / (G · F)`` — no plan can beat perfect compute utilisation."""
    work = sum(j.steps * j.tokens * (4 * models[j.model].params
                                     + 6 * cost.adapter_params(j, models[j.model])) for j in jobs)
    return work / (devices * cost.flops)


def compare_plans(jobs, models, cost: CostModel, devices: int) -> dict:
    """Makespans of PLoRA packing vs one-job-per-device and greedy fill, and the speedups."""
    plans = [plan_plora(jobs, models, cost, devices),
             plan_one_per_device(jobs, models, cost, devices),
             plan_greedy(jobs, models, cost, devices)]
    out = {p.name: p.as_dict() for p in plans}
    out["lower_bound"] = makespan_lower_bound(jobs, models, cost, devices)
    out["speedup_vs_one_per_device"] = plans[1].makespan / plans[0].makespan
    out["speedup_vs_greedy"] = plans[2].makespan / plans[0].makespan
    return out
