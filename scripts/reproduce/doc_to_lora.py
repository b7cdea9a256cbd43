"""Reproduce Doc-to-LoRA at CPU scale on SmolLM2-135M: needle-in-a-haystack documents.

Each document is filler sentences with one inserted fact, "The secret code of NAME is NN.".
The question "What is the secret code of NAME? The secret code of NAME is" is answered
WITHOUT the document by: the base model, the base model with the document in context (the
ceiling), per-document context distillation (a fresh LoRA, Adam steps on the teacher's top-k;
the slow baseline) and Doc-to-LoRA (one hypernetwork pass). Test facts are unseen in training:
held-out (name, code) pairs -- test names never occur in training; codes come from the closed
vocabulary 10..99 that training also uses, so the hypernetwork must read the code from the
document (a document-independent adapter can only guess, 1 in 90). Also measured:
time and working memory to internalise one document, and KV-cache bytes saved vs keeping the
document in context.

Paper: Charakorn et al., Doc-to-LoRA, https://arxiv.org/abs/2602.15902

Usage::

    python -m scripts.reproduce.doc_to_lora            # default
    python -m scripts.reproduce.doc_to_lora --quick    # fewer documents and steps
    python -m scripts.reproduce.doc_to_lora --run-dir runs/d2l            # resumable, curve
    python -m scripts.reproduce.doc_to_lora --run-dir runs/d2l --eval-only  # table from the
                                                       # newest checkpoint (no training)

The prepared data (teacher top-k log-probs and document features) is cached in
``--cache-dir`` under a key of the tokens and settings, so reruns and resumes skip it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.hyper import (
    DistillData,
    DocToLoRA,
    adapter_bytes,
    internalizer,
    kv_cache_bytes,
    restore_hypernetwork,
    save_hypernetwork,
    train_doc_to_lora,
)
from lowrank_jax.hyper.evaluate import (
    answer_scores,
    cached_distill_data,
    context_distillation_scores,
    hypernetwork_evaluator,
    pad_tokens,
    plot_learning_curve,
    teacher_floor,
    working_memory,
)
from lowrank_jax.hyper.needles import (
    TEST_NAMES,
    TRAIN_NAMES,
    VARIED_TEST_NAMES,
    VARIED_TRAIN_NAMES,
    make_documents,
    make_varied_documents,
    tokenize,
)
from lowrank_jax.hub import load_model

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--layers", default="8,12,16")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--chunk-len", type=int, default=64)
    p.add_argument("--train-docs", type=int, default=400)
    p.add_argument("--test-docs", type=int, default=16)
    p.add_argument("--data", choices=("varied", "v1"), default="v1",
                   help="varied: template filler and a distinct (name, code) pair per document "
                        "(156 training / 40 test names); v1: the previous rounds' 12 filler "
                        "sentences, 20 / 8 names")
    p.add_argument("--feature-dtype", choices=("float32", "float16"), default="float32",
                   help="storage of the cached document features (float16 halves memory)")
    p.add_argument("--cd-docs", type=int, default=None,
                   help="context distillation on the first N test documents (default all)")
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--l1-weight", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--cd-steps", type=int, default=25)
    p.add_argument("--cd-lr", type=float, default=5e-3)
    p.add_argument("--out", default="docs/results/doc_to_lora.json")
    p.add_argument("--target", default="down_proj", help="the projection that gets adapters")
    p.add_argument("--ce-weight", type=float, default=0.0,
                   help="auxiliary cross-entropy on the answer (the paper's NIAH objective)")
    p.add_argument("--eval-every", type=int, default=100,
                   help="evaluate held-out / seen accuracy every N steps (the learning curve)")
    p.add_argument("--run-dir", default=None, help="checkpoint folder (resumable training)")
    p.add_argument("--eval-only", action="store_true",
                   help="no training: the table from the newest checkpoint in --run-dir")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "lowrank_jax" /
                                               "doc_to_lora"),
                   help="where the prepared teacher data / document features are cached")
    p.add_argument("--plot", default=None,
                   help="learning-curve png (default docs/img/doc_to_lora_curve.png; "
                        "none with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.train_docs, args.test_docs, args.steps, args.cd_steps = 48, 8, 60, 15
        args.eval_every = min(args.eval_every, 20)
    if args.eval_only and args.run_dir is None:
        raise ValueError("--eval-only reads the newest checkpoint of --run-dir; pass "
                         "--run-dir DIR of a run started with --run-dir.")
    if args.plot is None and not args.quick:
        args.plot = "docs/img/doc_to_lora_curve.png"
    layers = [int(x) for x in args.layers.split(",")]
    t0 = time.time()
    model, tok = load_model(args.model)
    rng = np.random.default_rng(0)
    codes = list(range(10, 100))  # the closed answer vocabulary (pairs held out via names)
    if args.data == "varied":
        train = make_varied_documents(rng, args.train_docs, VARIED_TRAIN_NAMES, codes, 2, 7)
        test = make_varied_documents(rng, args.test_docs, VARIED_TEST_NAMES, codes, 2, 7)
    else:
        train = make_documents(rng, args.train_docs, TRAIN_NAMES, codes, 2, 7)
        test = make_documents(rng, args.test_docs, TEST_NAMES, codes, 2, 7)
    assert not {d["name"] for d in train} & {d["name"] for d in test}
    max_chunks = 2
    tr, te = tokenize(tok, train), tokenize(tok, test)
    mean_train, mean_test = np.mean([len(d) for d in tr[0]]), np.mean([len(d) for d in te[0]])
    print(f"loaded in {time.time() - t0:.0f}s; doc tokens: train mean {mean_train:.0f}, "
          f"test mean {mean_test:.0f}"
          f" (max {max(len(d) for d in tr[0] + te[0])}, chunk {args.chunk_len})", flush=True)
    build = dict(layers=layers, chunk_len=args.chunk_len, max_chunks=max_chunks, top_k=16)
    if args.feature_dtype != "float32":
        build["feature_dtype"] = args.feature_dtype
    t0 = time.time()
    train_data = cached_distill_data(args.cache_dir, args.model, model, tr, build)
    test_data = cached_distill_data(args.cache_dir, args.model, model, te, build)
    floor = teacher_floor(train_data)
    build_seconds = time.time() - t0
    print(f"teacher + features in {build_seconds:.0f}s; KL floor {floor:.3f}", flush=True)

    hyper = DocToLoRA.for_model(model, layers=layers, target=args.target, rank=args.rank,
                                d_latent=128, n_latents=8, num_blocks=2, n_heads=4,
                                rngs=nnx.Rngs(0))
    n_seen = min(len(te[0]), len(tr[0]))
    seen = DistillData(*(np.asarray(x)[:n_seen] for x in train_data))
    evaluate, d2l_scores = hypernetwork_evaluator(model, hyper, {
        "heldout": (test_data, te[1], te[2]), "seen": (seen, tr[1][:n_seen], tr[2][:n_seen])})
    t0 = time.time()
    if args.eval_only:
        steps_done, curve = restore_hypernetwork(hyper, args.run_dir,
                                                 log=lambda s: print(s, flush=True))
        history = []
        print(f"evaluating the step-{steps_done} checkpoint of {args.run_dir}", flush=True)
        if not (Path(args.run_dir) / "hypernetwork").exists():  # for internalize --hyper
            save_hypernetwork(hyper, Path(args.run_dir) / "hypernetwork")
    else:
        history = train_doc_to_lora(hyper, model, train_data, steps=args.steps,
                                    batch_size=args.batch_size, learning_rate=args.lr,
                                    warmup=args.warmup, l1_weight=args.l1_weight,
                                    ce_weight=args.ce_weight, evaluate=evaluate,
                                    eval_every=args.eval_every, run_dir=args.run_dir,
                                    resume=args.run_dir is not None, save_every=50,
                                    log=lambda s: print(s, flush=True))
        steps_done = args.steps
        curve = ([r for r in history if "heldout_acc" in r] if args.run_dir is None
                 else restore_hypernetwork(nnx.clone(hyper), args.run_dir)[1])
    train_seconds = time.time() - t0
    print(f"trained D2L in {train_seconds:.0f}s", flush=True)
    for r in curve:
        print(f"curve step {r['step']}: kl {r['kl_mean']:.3f} held-out acc "
              f"{r['heldout_acc']:.3f} digits {r['heldout_digits']:.3f} | seen acc "
              f"{r['seen_acc']:.3f} digits {r['seen_digits']:.3f}", flush=True)

    documents, questions, answers = te
    starts_q = [len(q) - 1 for q in questions]
    student = jnp.asarray(pad_tokens([q + a for q, a in zip(questions, answers)]))
    with_doc = jnp.asarray(pad_tokens([d + q + a for d, q, a in
                                       zip(documents, questions, answers)]))
    starts_doc = [len(d) + len(q) - 1 for d, q in zip(documents, questions)]
    results = {}
    results["base (no document)"] = answer_scores(model(student)[0], student, starts_q, answers)
    results["base + document in context (ceiling)"] = answer_scores(
        model(with_doc)[0], with_doc, starts_doc, answers)

    # Doc-to-LoRA: one pass per document; on the first training documents too (seen facts),
    # which separates "did not fit" from "did not generalise"
    results["Doc-to-LoRA"] = d2l_scores(hyper, "heldout")
    results["Doc-to-LoRA on training documents (seen facts)"] = d2l_scores(hyper, "seen")
    run = internalizer(model, hyper, chunk_len=args.chunk_len)
    for d in documents[:2]:  # compile for 1 and 2 chunks
        run(d).a.block_until_ready()
    t0 = time.time()
    for d in documents:
        run(d).a.block_until_ready()
    d2l_seconds = (time.time() - t0) / len(documents)

    # per-document context distillation (same layers, same total rank)
    total_rank = (max_chunks + 1) * args.rank
    n_cd = len(documents) if args.cd_docs is None else min(args.cd_docs, len(documents))
    *cd_scores, cd_times = context_distillation_scores(
        model, hyper.config, test_data, questions, answers, total_rank=total_rank,
        steps=args.cd_steps, learning_rate=args.cd_lr, n_docs=n_cd)
    cd_name = ("context distillation (per doc)" if n_cd == len(documents) else
               f"context distillation (per doc, first {n_cd} test docs)")
    results[cd_name] = tuple(cd_scores)
    cd_seconds = float(np.mean(cd_times[1:] if len(cd_times) > 1 else cd_times))

    # memory: what XLA plans for one internalisation vs one context-distillation step
    memory = working_memory(model, hyper, test_data, layers=layers, chunk_len=args.chunk_len,
                            max_chunks=max_chunks, total_rank=total_rank)
    mem_d2l, mem_cd = memory["doc_to_lora"], memory["context_distillation_step"]

    mean_tokens = float(np.mean([len(d) for d in documents]))
    kv = kv_cache_bytes(model.cfg, mean_tokens)
    one_bank = run(documents[0])
    rows = []
    for name, (hits, lps, digits) in results.items():
        rows.append({"method": name, "accuracy": float(np.mean(hits)),
                     "answer_logp": float(np.mean(lps)), "digit_accuracy": float(np.mean(digits))})
    report = {
        "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "model": args.model,
        "layers": layers, "rank_per_chunk": args.rank, "chunk_len": args.chunk_len,
        "train_docs": args.train_docs, "test_docs": args.test_docs, "steps": args.steps,
        "data": args.data, "feature_dtype": args.feature_dtype, "cd_docs": n_cd,
        "build_seconds": build_seconds,
        "cd_steps": args.cd_steps, "lr": args.lr, "warmup": args.warmup,
        "steps_done": steps_done, "eval_only": args.eval_only, "target": args.target,
        "ce_weight": args.ce_weight, "kl_floor": floor, "curve": curve,
        "l1_weight": args.l1_weight, "batch_size": args.batch_size,
        "train_seconds": train_seconds, "rows": rows,
        "internalize_seconds": {"doc_to_lora": d2l_seconds, "context_distillation": cd_seconds},
        "working_memory_bytes": {"doc_to_lora": mem_d2l, "context_distillation_step": mem_cd},
        "mean_doc_tokens": mean_tokens, "kv_cache_bytes_mean_doc": kv,
        "adapter_bytes_one_doc": adapter_bytes(one_bank),
        "kv_bytes_per_token": kv_cache_bytes(model.cfg, 1),
        "final_train_loss": history[-1]["loss"] if history else None,
        "first_train_loss": history[0]["loss"] if history else None,
        "train_curve": [{"step": h["step"], "kl": h["kl"]} for h in history
                        if h["step"] % 50 == 0 or h["step"] == 1],
    }
    print("\n| method | accuracy (no doc in prompt) | digit accuracy | answer log-prob |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['accuracy']:.3f} | {r['digit_accuracy']:.3f} | "
              f"{r['answer_logp']:.2f} |")
    print(f"\ninternalize one doc: D2L {d2l_seconds:.3f}s, context distillation {cd_seconds:.2f}s "
          f"({args.cd_steps} steps); working memory D2L {mem_d2l}, CD step {mem_cd} bytes")
    print(f"KV cache of a {mean_tokens:.0f}-token doc: {kv} bytes; adapter "
          f"{report['adapter_bytes_one_doc']} bytes")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    if args.plot and curve:
        plot_learning_curve(curve, floor, args.plot, f"Doc-to-LoRA on {args.model}: "
                            f"{args.train_docs} training docs, lr {args.lr}, warm-up "
                            f"{args.warmup}, {steps_done} steps")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
