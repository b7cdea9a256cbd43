"""Device meshes and logical sharding rules for dense, factorized and LoRA weights.

Mesh axes are ``data``, ``fsdp`` and ``tensor`` (MaxText's names; EasyDeL's dp/fsdp/tp).
A parameter's ``PartitionSpec`` comes from, in order:

1. **its logical axes**: a variable created with ``nnx.with_partitioning`` (metadata
   ``out_sharding`` / ``sharding_names``) is sharded by :data:`LOGICAL_RULES`, MaxText's logical
   axis rules as data (``embed -> fsdp``, ``heads``/``mlp`` -> ``tensor``, rank never);
2. **its projection view**: the kernel of any projection the protocol reads
   (:mod:`lowrank_jax.nn.projection`: ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``,
   a user's einsum module), of any rank — contracted axes -> ``fsdp``, free axes -> ``tensor``
   (:func:`view_spec`), stacked leading axes unsharded;
3. **its name**, the fallback table below (2-D leaves, or the last two axes of a stack).

A large leaf none of them places stays replicated and is reported (:func:`sharding_report`;
:func:`shard_model` warns naming it). The name table:

=====================  ===========================  =====================================
parameter              column-parallel (q,k,v,       row-parallel (o_proj, down_proj)
                       gate, up)
=====================  ===========================  =====================================
dense ``kernel``       ``(fsdp, tensor)``           ``(tensor, fsdp)``
factor ``a`` [in, r]   ``(fsdp, None)``             ``((tensor, fsdp), None)``
factor ``b`` [r, out]  ``(None, (tensor, fsdp))``   ``(None, fsdp)``
``lora_a`` [in, r]     ``(fsdp, None)``             ``((tensor, fsdp), None)``
``lora_b`` [r, out]    ``(None, (tensor, fsdp))``   ``(None, fsdp)``
=====================  ===========================  =====================================

Each factor has one long axis, so it carries both the tensor-parallel axis and ``fsdp`` (a
pure-FSDP mesh then shards every factor ``fsdp`` ways). The rank axis (logical name
``lora_rank``) is never sharded: it is small, and Newton–Schulz /
balancing work on ``r × r`` Gram matrices that every device can hold. Embeddings are
``(tensor, fsdp)`` over ``[vocab, d]``; norms are replicated; a batch is split over
``(data, fsdp)``.

Quantized (QLoRA) bases store ``[out, ...]`` arrays — RTN / UniSVQ ``codes``, NF4 ``packed``
codes, per-group ``scale`` / ``zero`` / ``absmax`` — and are sharded on their output axis only
(``(tensor, fsdp)`` column-parallel, ``fsdp`` row-parallel): a group never straddles devices, and
the frozen base is spread like the LoRA factors that train on it. 1-D scales and the 4×4 lattice
are replicated.

**Decision on sharded Newton–Schulz / SVD.** The train step runs on a mesh with
``AxisType.Auto`` axes: XLA's propagation turns the contraction over a sharded long axis
(``Xᵀ X`` in NS, the Gram matrix in power iteration) into a local matmul plus an all-reduce and
keeps the optimizer state on the parameters' shardings. (With ``AxisType.Explicit`` the same code
raises an ambiguous-output-sharding error, which is why :func:`make_mesh` defaults to Auto.)
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
ROW_PARALLEL = ("o_proj", "down_proj")
QUANTIZED_LEAVES = ("codes", "packed", "scale", "zero", "absmax")  # [out, ...] of quantized bases


def maybe_initialize_distributed() -> bool:
    """Call ``jax.distributed.initialize()`` when a multi-host environment is configured.

    Recognised: ``JAX_COORDINATOR_ADDRESS`` (+ ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), or a
    cluster JAX auto-detects (SLURM, TPU pod: ``TPU_WORKER_HOSTNAMES`` / ``MEGASCALE_*``).
    """
    keys = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES",
            "MEGASCALE_COORDINATOR_ADDRESS")
    if not any(k in os.environ for k in keys):
        return False
    if jax.distributed.is_initialized():  # a second command in the same process
        return True
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # CPU devices of several processes need gloo to meet in a collective (no effect on
        # GPU / TPU devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ.get("JAX_NUM_PROCESSES", "1")),
            process_id=int(os.environ.get("JAX_PROCESS_ID", "0")),
        )
    else:
        jax.distributed.initialize()
    return True


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` → ``{"data": 2, "fsdp": 2, "tensor": 2}`` (missing axes = 1)."""
    sizes = {axis: 1 for axis in AXES}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"mesh={text!r}: expected axis=size pairs like data=2,fsdp=4.")
        axis, size = item.split("=", 1)
        if axis not in AXES:
            raise ValueError(f"`mesh`: unknown axis {axis!r}; use {', '.join(AXES)}.")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"`mesh`: size of {axis} must be a positive integer, got {size!r}.")
        sizes[axis] = int(size)
    return sizes


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices=None,
              explicit: bool = False) -> jax.sharding.Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all), checked against them."""
    devices = list(jax.devices() if devices is None else devices)
    want = data * fsdp * tensor
    if want != len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {want} devices, but "
            f"{len(devices)} are available; make the product equal {len(devices)}."
        )
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    grid = np.asarray(devices).reshape(data, fsdp, tensor)
    return jax.sharding.Mesh(grid, AXES, axis_types=(kind,) * 3)


def _path_names(path) -> list[str]:
    names = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))
        names.append(str(key))
    return names


#: Logical axis rules, MaxText style, as data: a logical axis name -> the mesh axes it shards
#: over (``None``: never sharded). Read from a variable's ``out_sharding`` / ``sharding_names``
#: metadata (``nnx.with_partitioning``), the adapter factors' metadata and the projection views.
LOGICAL_RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": ("data", "fsdp"), "embed": "fsdp", "embed_in": "fsdp", "in": "fsdp",
    "mlp": "tensor", "heads": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
    "kv": "tensor", "out": "tensor", "vocab": "tensor", "head_dim": None, "norm": None,
    "lora_rank": None, "rank": None, "layers": None, "stack": None, "experts": None,
}
METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")
#: a replicated leaf this large (elements) is reported by :func:`sharding_report`
REPORT_MIN_SIZE = 4096


def logical_spec(path, shape) -> P:
    """The name-based ``PartitionSpec`` of one parameter (the module table): the fallback when a
    leaf carries no logical axes and belongs to no projection the protocol reads.

    Leaves of more than two axes (scanned stacks ``[layers, ...]``, adapter factors that keep a
    kernel's axes) get the 2-D rule on their matrix axes and ``None`` on stacked ones.
    """
    names = _path_names(path)
    leaf = names[-1] if names else ""
    if leaf == "value" and len(names) > 1:
        names, leaf = names[:-1], names[-2]
    row = any(n in ROW_PARALLEL for n in names)
    first, second = ("tensor", "fsdp") if row else ("fsdp", "tensor")
    if len(shape) < 2:
        return P()
    lead = (None,) * (len(shape) - 2)
    if leaf in ("kernel",):
        return P(*lead, first, second)
    if leaf in ("a", "lora_a"):
        return P(*lead, ("tensor", "fsdp") if row else "fsdp", None)
    if leaf in ("b", "lora_b"):
        return P(*lead, None, "fsdp" if row else ("tensor", "fsdp"))
    if leaf == "embedding":
        return P(*lead, "tensor", "fsdp")
    if leaf in QUANTIZED_LEAVES:
        return P(*lead, "fsdp" if row else ("tensor", "fsdp"), None)
    return P()


def _axis_size(mesh, axes) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in names]))


def _fits(dim: int, axes, mesh) -> bool:
    return axes is not None and all(a in mesh.shape for a in (
        axes if isinstance(axes, tuple) else (axes,))) and dim % _axis_size(mesh, axes) == 0


def spec_from_logical(names, shape, mesh, rules=None) -> P:
    """``PartitionSpec`` of a leaf whose axes carry logical ``names`` (one per axis, ``None``
    allowed), by ``rules`` (default :data:`LOGICAL_RULES`). A mesh axis is used once; an axis
    whose size it does not divide stays unsharded (and shows in :func:`sharding_report`).

    Example::

        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
        >>> tuple(spec_from_logical(("embed", "heads", "head_dim"), (64, 8, 16), mesh))
        ('fsdp', 'tensor', None)
    """
    rules = LOGICAL_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name, dim in zip(tuple(names) + (None,) * (len(shape) - len(names)), shape):
        axes = rules.get(name) if name is not None else None
        flat = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        if flat and not used.intersection(flat) and _fits(dim, axes, mesh):
            used.update(flat)
            out.append(axes)
        else:
            out.append(None)
    return P(*out)


def view_spec(view, shape, mesh, *, row_parallel: bool = False) -> P:
    """``PartitionSpec`` of a projection kernel of any rank from its
    :class:`~lowrank_jax.nn.projection.ProjectionView`: contracted axes -> ``fsdp``, free axes ->
    ``tensor`` (swapped for a row-parallel projection, ``o_proj`` / ``down_proj``), each on the
    first axis of its group (in kernel order) that the mesh axis divides. Leading axes beyond
    the kernel's (a scanned stack ``[layers, ...]``) stay unsharded.

    Example (an einsum kernel ``[D, N, H]``, ``'BTD,DNH->BTNH'``)::

        >>> from lowrank_jax.nn.projection import ProjectionView
        >>> view = ProjectionView.from_equation("BTD,DNH->BTNH", (64, 8, 16))
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
        >>> tuple(view_spec(view, (64, 8, 16), mesh))
        ('fsdp', 'tensor', None)
    """
    lead = len(shape) - len(view.kernel_shape)
    spec: list = [None] * len(shape)
    groups = ((view.in_axes, "tensor" if row_parallel else "fsdp"),
              (view.out_axes, "fsdp" if row_parallel else "tensor"))
    for axes, mesh_axis in groups:
        if mesh_axis not in mesh.shape:
            continue
        fitting = [a for a in sorted(axes) if view.kernel_shape[a] % mesh.shape[mesh_axis] == 0]
        if fitting:  # the first in kernel order: heads before head_dim, as MaxText shards them
            spec[lead + fitting[0]] = mesh_axis
    return P(*spec)


def _metadata_names(variable):
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in METADATA_KEYS:
        names = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(names, (tuple, list)) and names and all(
                n is None or isinstance(n, str) for n in names):
            return tuple(names)
    return None


def projection_views(model) -> dict[tuple[str, ...], tuple[object, bool]]:
    """``{kernel path: (ProjectionView, row_parallel)}`` for every projection of an NNX model
    that holds a dense kernel (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, einsum-like
    user modules, registered types)."""
    from flax import nnx

    from lowrank_jax.nn.projection import projection_type, projection_view

    views = {}
    for path, module in nnx.iter_graph(model):
        kind = projection_type(module) if isinstance(module, nnx.Module) else None
        if kind is None or not kind.kernel:
            continue
        try:
            view = projection_view(module)
        except ValueError:
            continue  # not one projection (per-head weights...): the name rules decide
        names = tuple(str(p) for p in path)
        views[names + (kind.kernel,)] = (view, any(n in ROW_PARALLEL for n in names))
    return views


def logical_names(params) -> dict[tuple[str, ...], tuple]:
    """``{param path: logical axis names}`` of the NNX variables of ``params`` that carry them."""
    from flax import nnx

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(
            params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(leaf, nnx.Variable):
            names = _metadata_names(leaf)
            if names is not None:
                out[_param_key(path)] = names
    return out


def leaf_spec(path, shape, mesh, *, names=None, views=None, rules=None) -> P:
    """The ``PartitionSpec`` of one leaf: its logical axis ``names`` first, then its projection
    view from ``views`` (any rank), then the name rules (:func:`logical_spec`)."""
    shape = tuple(shape)
    if names is not None and len(names) == len(shape):
        return spec_from_logical(names, shape, mesh, rules)
    hit = (views or {}).get(_param_key(path))
    if hit is not None and len(shape) >= len(hit[0].kernel_shape):
        return view_spec(hit[0], shape, mesh, row_parallel=hit[1])
    return logical_spec(path, shape)


def check_divisible(path, shape, spec: P, mesh) -> None:
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axis is None:
            continue
        names = axis if isinstance(axis, tuple) else (axis,)
        size = int(np.prod([mesh.shape[a] for a in names]))
        axis = "*".join(names)
        if dim % size:
            raise ValueError(
                f"parameter {'/'.join(n for n in _path_names(path) if n != 'value')} dimension "
                f"{dim} is not divisible by "
                f"mesh axis {axis}={size}; change the model size or the mesh."
            )


def param_shardings(params, mesh, *, model=None, rules=None):
    """A pytree of ``NamedSharding`` matching ``params`` (arrays, ShapeDtypeStructs or an NNX
    state). Variables with logical-axis metadata are sharded by ``rules`` (default
    :data:`LOGICAL_RULES`); with ``model`` (the NNX module the state comes from) projection
    kernels of any rank from their :class:`~lowrank_jax.nn.projection.ProjectionView`; the rest
    by name (:func:`logical_spec`)."""
    views = projection_views(model) if model is not None else None
    names = logical_names(params)

    def one(path, leaf):
        spec = leaf_spec(path, leaf.shape, mesh, names=names.get(_param_key(path)), views=views,
                         rules=rules)
        check_divisible(path, leaf.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params)


def sharding_report(params, shardings, *, min_size: int = REPORT_MIN_SIZE) -> list[str]:
    """Paths of the leaves of ``params`` (at least ``min_size`` elements, two or more axes) that
    ``shardings`` (as :func:`param_shardings` returns) leaves fully replicated: what the rules
    could not place (a user's module the protocol does not read, a size no mesh axis divides)."""
    out = []
    flat_s = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(params), flat_s):
        shape = tuple(leaf.shape)
        if len(shape) >= 2 and int(np.prod(shape)) >= min_size and all(
                a is None for a in sharding.spec):
            out.append(f"{'/'.join(_param_key(path))} {shape}")
    return out


def _param_key(path) -> tuple[str, ...]:
    names = _path_names(path)
    while names and names[-1] in ("value", "raw_value"):  # NNX Variable accessors
        names = names[:-1]
    return tuple(names)


def state_shardings(state, params, mesh):
    """``NamedSharding`` for every leaf of an optimizer ``state`` (arrays or ShapeDtypeStructs)
    of ``params``, by the rules of this module.

    A state leaf that mirrors a parameter — its path ends with the parameter's path (optax and
    our transforms keep moments in trees shaped like the params) and it has the same shape —
    gets that parameter's sharding; every other leaf (step counts, projectors, bases, factored
    statistics) is replicated.
    """
    placed = jax.tree_util.tree_leaves(param_shardings(params, mesh),
                                       is_leaf=lambda x: isinstance(x, NamedSharding))
    rules = {}
    for (path, leaf), by_rule in zip(jax.tree_util.tree_leaves_with_path(params), placed):
        actual = getattr(leaf, "sharding", None)  # a parameter already placed keeps its place
        on_mesh = isinstance(actual, NamedSharding) and actual.mesh == mesh
        rules[_param_key(path)] = (tuple(leaf.shape), actual if on_mesh else by_rule)
    replicated_sharding = replicated(mesh)

    def one(path, leaf):
        names = _param_key(path)
        for start in range(len(names)):
            hit = rules.get(names[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return replicated_sharding

    return jax.tree_util.tree_map_with_path(one, state)


def init_optimizer_state(tx, params, mesh):
    """``tx.init(params)`` with its state created on ``mesh`` by :func:`state_shardings`.

    A plain ``jax.jit(tx.init)`` on an Auto mesh leaves the sharding of the zeros it creates to
    XLA, which replicates them (every device would hold the whole optimizer state).
    """
    abstract = jax.eval_shape(tx.init, params)
    return jax.jit(tx.init, out_shardings=state_shardings(abstract, params, mesh))(params)


def place_on_mesh(tree, mesh):
    """``tree`` with every array that is not already on ``mesh`` replicated over it.

    Optimizer states hold scalars (step counts) and small arrays (projectors, bases) that come
    out of an eager ``init`` on one local device; a step jitted on a mesh that spans several
    processes needs every input on that mesh.
    """
    replicated_sharding = replicated(mesh)

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return jax.device_put(x, replicated_sharding)

    return jax.tree.map(one, tree)


def shard_model(model, mesh, *, rules=None, warn: bool = True) -> list[str]:
    """Put every array of the NNX ``model`` (in place) on ``mesh`` by the rules of this module:
    logical-axis metadata, then projection views (kernels of any rank, the user's einsum
    modules), then names. Returns :func:`sharding_report`'s list of large leaves left
    replicated, and warns naming them (``warn=False``: only return it).

    Every process must call it with the same model values (a model loaded or built the same
    way on every process, e.g. from one checkpoint and one seed); each keeps only the shards of
    its own devices. Raises a ``ValueError`` naming the parameter when a dimension does not
    divide its mesh axes.
    """
    from flax import nnx

    state = nnx.state(model)
    shardings = param_shardings(state, mesh, model=model, rules=rules)
    nnx.update(model, jax.tree.map(lambda x, s: jax.device_put(x, s), state, shardings))
    replicated_leaves = sharding_report(state, shardings)
    if warn and replicated_leaves and mesh.size > 1:
        import warnings

        warnings.warn("shard_model: these parameters stay replicated on every device (no logical "
                      "axes, no projection view, no name rule, or no mesh axis divides them): "
                      + "; ".join(replicated_leaves[:8])
                      + (f" and {len(replicated_leaves) - 8} more" if len(replicated_leaves) > 8
                         else ""), stacklevel=2)
    return replicated_leaves


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
