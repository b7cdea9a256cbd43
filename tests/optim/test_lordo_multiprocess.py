"""``lordo_sync`` across processes: two JAX processes (4 CPU devices each, gloo collectives)
run the same ``shard_map`` sync over one global 8-device ``data`` axis, each holding only its
own 4 workers, and get the single-host answer."""

import json
import os
import socket
import subprocess
import sys

import pytest

WORKER = r"""
import json, sys
import jax
pid, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lowrank_jax.optim import find_lordo_state, lordo, lordo_sync

M, LOCAL = 8, 4
params = {"w": jnp.zeros((16, 24)), "b": jnp.zeros((24,))}
tx = lordo(0.1, rank=2)
workers = jax.tree.map(lambda x: jnp.stack([x] * M), params)
states = jax.vmap(tx.init)(workers)
grads = {"w": jax.random.normal(jax.random.key(3), (M, 16, 24)),
         "b": jax.random.normal(jax.random.key(4), (M, 24))}
updates, states = jax.vmap(tx.update)(grads, states)
workers = optax.apply_updates(workers, updates)
want = lordo_sync(workers, params, states)  # the single-host answer, on every process

mesh = jax.make_mesh((M,), ("data",), axis_types=(AxisType.Explicit,))
spec = lambda tree, s: jax.tree.map(lambda _: s, tree)

def body(w, a, s):
    res = lordo_sync(w, a, s, axis_name="data")
    return res.anchor, res.worker_params, res.worker_opt_states, res.floats_sent

sync = jax.jit(jax.shard_map(
    body, mesh=mesh,
    in_specs=(spec(workers, P("data")), spec(params, P()), spec(states, P("data"))),
    out_specs=(spec(params, P()), spec(workers, P("data")), spec(states, P("data")), P())))

def to_global(x, s):  # each process contributes only its own workers
    local = x[LOCAL * pid: LOCAL * (pid + 1)] if s == P("data") else x
    return jax.make_array_from_process_local_data(NamedSharding(mesh, s), np.asarray(local),
                                                  x.shape)

anchor, new_workers, new_states, floats = sync(
    jax.tree.map(lambda x: to_global(x, P("data")), workers),
    jax.tree.map(lambda x: to_global(x, P()), params),
    jax.tree.map(lambda x: to_global(x, P("data")), states))
local = lambda x: np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
q = local(find_lordo_state(new_states).projection["w"])
q_want = np.asarray(find_lordo_state(want.worker_opt_states).projection["w"][0])
print(json.dumps({
    "devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
    "anchor_err": float(np.abs(np.asarray(anchor["w"].addressable_data(0))
                               - np.asarray(want.anchor["w"])).max()),
    "workers_err": float(np.abs(local(new_workers["w"])
                                - np.asarray(want.worker_params["w"][:LOCAL])).max()),
    "span": np.abs(np.swapaxes(q, 1, 2) @ q_want).sum(axis=(1, 2)).tolist(),
    "floats": int(floats.addressable_data(0)), "want_floats": int(want.floats_sent)}),
    flush=True)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sync_across_two_processes_matches_single_host():
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(pid), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-2000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for result in outputs:
        assert result["devices"] == 8 and result["local_devices"] == 4
        assert result["anchor_err"] < 1e-6 and result["workers_err"] < 1e-6
        assert result["span"] == pytest.approx([2.0] * 4, abs=1e-4)  # the global Q everywhere
        assert result["floats"] == result["want_floats"] == 16 * 24 + 24
