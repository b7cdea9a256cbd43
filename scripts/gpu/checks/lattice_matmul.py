"""Device check of the UniSVQ lattice matmul: kernel vs reference, time vs bf16 dense, bandwidth.

``check(out_dir, quick)`` is called by ``scripts/gpu/check.py`` on the device machine. For each
shape it (1) compares the Pallas kernel (fold and dequant modes) with the XLA reference,
(2) times the kernel against a bf16 ``jnp.dot`` with the dense weight, and (3) reports the
kernel's achieved code bandwidth (bytes of packed codes + activations + output per second) as a
fraction of a device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import os
import time


def _timeit(fn, *args, warmup: int = 3, reps: int = 20) -> float:
    import jax
    import numpy as np

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device copy rate in bytes/s (read + write of a ``nbytes`` buffer)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    seconds = _timeit(copy, x)
    return 2 * nbytes / seconds


def check(out_dir: str, quick: bool) -> dict:
    """Run the checks; write ``lattice_matmul.json`` into ``out_dir``; return the summary."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.lattice_matmul.api import code_matmul
    from pallas_kernels.lattice_matmul.reference import code_matmul_reference

    shapes = [(4096, 4096)] if quick else [(4096, 4096), (12288, 4096), (4096, 12288)]
    tokens = [1, 16, 256] if quick else [1, 4, 16, 64, 256, 2048]
    bandwidth = copy_bandwidth(1 << 28 if quick else 1 << 30)
    rows, ok = [], True
    for m, n in shapes:
        k = jax.random.split(jax.random.PRNGKey(0), 4)
        codes = jax.random.randint(k[0], (m, n // 4), 0, 256).astype(jnp.uint8)
        affine = jax.random.normal(k[1], (4, 4)) * 0.3 + jnp.eye(4)
        offset = jax.random.normal(k[2], (4,)) * 0.1
        w_dense = jax.random.normal(k[3], (m, n)).astype(jnp.bfloat16)
        for t in tokens:
            x = jax.random.normal(jax.random.PRNGKey(t), (t, n)).astype(jnp.bfloat16)
            ref = code_matmul_reference(x.astype(jnp.float32), codes, affine, offset)
            row = {"m": m, "n": n, "t": t}
            for mode in ("fold", "dequant"):
                fn = jax.jit(lambda x, c, a, b, mode=mode: code_matmul(
                    x, c, a, b, mode=mode, implementation="pallas"))
                try:
                    got = fn(x, codes, affine, offset)
                    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                    seconds = _timeit(fn, x, codes, affine, offset)
                    moved = codes.size + x.size * 2 + t * m * 4
                    row[mode] = {"rel_err": rel, "seconds": seconds,
                                 "bandwidth_fraction": moved / seconds / bandwidth}
                    ok = ok and rel < 2e-2
                except Exception as err:  # report lowering failures instead of dying
                    row[mode] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    ok = False
            dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
            row["bf16_dense_seconds"] = _timeit(dense, x, w_dense)
            for mode in ("fold", "dequant"):
                if "seconds" in row[mode]:
                    row[mode]["speedup_vs_bf16"] = row["bf16_dense_seconds"] / row[mode]["seconds"]
            rows.append(row)
    summary = {
        "device": str(jax.devices()[0]),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "ok": bool(ok),
        "rows": rows,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "lattice_matmul.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for row in rows:
        parts = [f"m={row['m']} n={row['n']} t={row['t']}",
                 f"bf16 {row['bf16_dense_seconds'] * 1e6:.1f}us"]
        for mode in ("fold", "dequant"):
            r = row[mode]
            parts.append(f"{mode} " + (r["error"][:60] if "error" in r else
                                       f"{r['seconds'] * 1e6:.1f}us "
                                       f"bw {100 * r['bandwidth_fraction']:.1f}% "
                                       f"err {r['rel_err']:.1e}"))
        print(" | ".join(parts))
    return summary


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu_checks")
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    print(json.dumps({k: v for k, v in check(a.out, a.quick).items() if k != "rows"}))
