"""Doc-to-LoRA training-data build: the batched build vs the previous one, in one run.

Builds the teacher top-16 log-probabilities and document features of the same synthetic needle
documents (``scripts.reproduce.doc_to_lora``) on SmolLM2 twice: with the previous round's
``build_distill_data`` (read from git commit ``c0414db``: batch 8, the LM head and top-k on
every position, every chunk slot encoded separately) and with the current one (length buckets,
batch 32, top-k on the answer positions only, first-chunk features from the teacher pass).
Each is called once on 40 of the documents first (the previous build compiles its jitted
functions inside every call, so its timing includes that compilation, as every use of it
did; the current one compiles once per shape per process); reports docs/s (wall and CPU
seconds), the ratio, and the largest differences of the outputs.

Usage::

    python -m scripts.bench.doc_to_lora_build [--docs 128] [--old-commit c0414db]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

import numpy as np

from lowrank_jax.hyper import build_distill_data
from lowrank_jax.hub import load_model
from lowrank_jax.hyper.needles import TRAIN_NAMES, make_documents, tokenize


def _old_build(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:lowrank_jax/hyper/train.py"],
                            check=True, capture_output=True, text=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("_old_d2l_train", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build_distill_data


def _timed(fn, tokens, build, repeats=1):
    fn(model_, *[x[:40] for x in tokens], **build)  # compile the shapes
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        out = fn(model_, *tokens, **build)
    return out, (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def main(argv=None) -> int:
    global model_
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--docs", type=int, default=128)
    parser.add_argument("--old-commit", default="c0414db")
    args = parser.parse_args(argv)
    model_, tok = load_model(args.model)
    docs = make_documents(np.random.default_rng(0), args.docs, TRAIN_NAMES,
                          list(range(10, 100)), 2, 7)
    tokens = tokenize(tok, docs)
    build = dict(layers=[8, 12, 16], chunk_len=64, max_chunks=2, top_k=16)
    old, t_old, c_old = _timed(_old_build(args.old_commit), tokens, build)
    new, t_new, c_new = _timed(build_distill_data, tokens, build)
    n = len(tokens[0])
    print(f"{n} documents (mean {np.mean([len(d) for d in tokens[0]]):.0f} tokens, "
          f"{int(new.mask[:, 1].any(-1).sum())} with 2 chunks)")
    print(f"previous build: {t_old:.1f} s wall, {c_old:.1f} CPU s -> {n / t_old:.2f} docs/s")
    print(f"batched build : {t_new:.1f} s wall, {c_new:.1f} CPU s -> {n / t_new:.2f} docs/s")
    print(f"speed-up: {t_old / t_new:.1f}x wall, {c_old / c_new:.1f}x CPU seconds")
    m = new.mask[..., None, :, None]
    diff = float(np.abs((old.features - new.features) * m).max())
    print(f"features on valid positions: max |diff| {diff:.2e} (max |value| "
          f"{float(np.abs(old.features * m).max()):.1f})",
          "| max |teacher log-prob diff|:",
          float(np.abs(old.teacher_logp - new.teacher_logp).max()),
          "| top-k ids equal:", bool((old.teacher_idx == new.teacher_idx).all()),
          "| queries/weights equal:", bool((old.queries == new.queries).all()
                                           and (old.weights == new.weights).all()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
