"""FedTreeLoRA against FedSA / FedAvg-LoRA / FedHera (and local training) on a language model
whose clients hold different text domains, with the tree FedTreeLoRA builds plotted.

Clients: ``--clients-per-domain`` per on-machine text domain of
:mod:`lowrank_jax.data.continual_text` (licences, man pages, code, markdown by default); a
domain's train windows are dealt to its clients in turn, and every client of a domain is scored
on that domain's held-out windows. Every strategy starts from the same LoRA initialisation and
sees the same batches (:func:`lowrank_jax.federated.simulate`, one model, compiled once).

Writes ``docs/results/llm_federated.md`` (``--model smollm2``; the tiny random model writes
``runs/llm_federated_tiny.md``), the tree plot next to it (``docs/img/llm_federated_tree.png``)
and the numbers as JSON under ``runs/``. The results note is rewritten after every strategy, so a
run stopped by its time limit still leaves the finished strategies.

    python -m scripts.reproduce.llm_federated                       # SmolLM2-135M, ~10 CPU min
    python -m scripts.reproduce.llm_federated --model tiny --rounds 4   # random tiny Llama, smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny server-side SVDs on shared cores

import argparse
import datetime
import json
import pathlib
import time

import numpy as np
from flax import nnx

from lowrank_jax import federated as fed
from lowrank_jax.federated.experiment import plot_tree
from lowrank_jax.federated.report import client_row, fedtree_verdict, tree_of, write_domain_note
from lowrank_jax.data.continual_text import build_continual_text
from lowrank_jax.hub import load_model
from lowrank_jax.runs.results import machine_line, run_command
from lowrank_jax.models.presets import preset_model
from lowrank_jax.nn import LoRARule, apply_lora

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATTERN = r"self_attn/(q_proj|v_proj)$"


def strategies(args, n_domains):
    every = {
        "fedtreelora": fed.FedTreeLoRA(warmup_rounds=args.warmup_rounds, tau=args.tau,
                                       rebuild_every=args.rebuild_every),
        "fedsa": fed.FedSA(),
        "fedavg": fed.FedAvgLoRA(),
        "fedhera": fed.FedHera(),
        "local": fed.LocalOnly(),
        "clustered": fed.FedTreeLoRA(warmup_rounds=args.warmup_rounds, flat_groups=n_domains,
                                     rebuild_every=args.rebuild_every, name="clustered"),
    }
    names = args.strategies.split(",")
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"--strategies: unknown {unknown}; choose from {sorted(every)}")
    return {n: every[n] for n in names}


def load(args):
    """``(model with LoRA, encode, description)``."""
    if args.model == "smollm2":
        model, tokenizer = load_model("smollm2")
        encode = lambda text: tokenizer.encode(text, add_bos=False)  # noqa: E731
        name = "SmolLM2-135M-Instruct"
    else:
        model = preset_model("tiny", seed=args.seed)
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
        name = "random tiny Llama (byte level, 2 layers; NOT a pretrained model)"
    paths = apply_lora(model, LoRARule(args.pattern, rank=args.rank), rngs=nnx.Rngs(args.seed))
    return model, encode, name, paths


def make_clients(args, encode):
    domains = args.domains.split(",")
    per = args.clients_per_domain
    tasks = build_continual_text(encode, domains, length=args.length + 1,
                                 max_chars=12 * (args.length + 1) * per * args.train_windows
                                 + 10_000, max_train_windows=per * args.train_windows,
                                 max_heldout_windows=args.heldout_windows)
    clients, labels = [], []
    for task in tasks:
        if len(task.train) < per:
            raise SystemExit(f"domain {task.name}: {len(task.train)} train windows for {per} "
                             "clients; lower --clients-per-domain.")
        for j in range(per):
            clients.append(fed.token_window_client(task.train[j::per], task.heldout,
                                                   train_rank=args.rank,
                                                   download_rank=args.rank))
            labels.append(task.name)
    return clients, labels, tasks


def _outputs(args):
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "docs/results/llm_federated.md" if args.model == "smollm2"
        else ROOT / "runs/llm_federated_tiny.md")
    image = (ROOT / "docs/img/llm_federated_tree.png" if args.model == "smollm2"
             else out.with_name(out.stem + "_tree.png"))
    return out, image


def rewrite_note(args, parser):
    """Re-render the note (and its verdict) from a finished run's JSON; the run's own command,
    date and machine are kept (a JSON written before they were recorded gets its command rebuilt
    from the stored arguments)."""
    out, image = _outputs(args)
    json_path = ROOT / "runs" / (out.stem + ".json")
    payload = json.loads(json_path.read_text())
    written = datetime.date.fromtimestamp(json_path.stat().st_mtime).isoformat()
    run_args = argparse.Namespace(**payload["args"])
    meta = payload.get("meta") or {}
    if "command" not in meta:
        defaults = vars(parser.parse_args([]))
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in payload["args"].items()
                 if v != defaults.get(k) and k not in ("note_only", "out")]
        meta = {**meta, "command": " ".join(["python -m scripts.reproduce.llm_federated"]
                                            + flags),
                "date": meta.get("date", written),
                "machine": meta.get("machine", machine_line())}
    labels = payload["labels"]
    domains = meta.get("domains") or list(dict.fromkeys(labels))
    rows = {k: v["row"] for k, v in payload["runs"].items()}
    report = payload["runs"].get("fedtreelora", {}).get("tree")
    is_real = run_args.model == "smollm2"
    n_layers = meta.get("adapted") or (len(report["depths"]) if report else 0)
    model_name = meta.get("model_name") or ("SmolLM2-135M-Instruct" if is_real else "tiny")
    shown = image.name if image.parent == out.parent else f"../img/{image.name}"
    write_domain_note(out, run_args, model_name, rows, domains, report, shown, meta, n_layers,
                      is_real, fedtree_verdict(rows, report, is_real))
    print(out.read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--domains", default="licences,manpages,code,markdown")
    parser.add_argument("--clients-per-domain", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16, help="tokens per window (inputs)")
    parser.add_argument("--train-windows", type=int, default=64, help="per client")
    parser.add_argument("--heldout-windows", type=int, default=4, help="per domain")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--pattern", default=PATTERN)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--tau", type=float, default=0.5)
    parser.add_argument("--rebuild-every", type=int, default=5)
    parser.add_argument("--strategies",
                        default="fedtreelora,fedsa,fedavg,fedhera,clustered,local")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results note (default by --model)")
    parser.add_argument("--note-only", action="store_true",
                        help="rewrite the note from the run's JSON (runs/<note>.json), no training")
    args = parser.parse_args(argv)
    if args.note_only:
        return rewrite_note(args, parser)

    start = time.time()
    is_real = args.model == "smollm2"
    out, image = _outputs(args)
    meta = {"command": run_command().strip(), "date": datetime.date.today().isoformat(),
            "machine": machine_line()}
    model, encode, model_name, paths = load(args)
    clients, labels, tasks = make_clients(args, encode)
    domains = [t.name for t in tasks]
    print(f"{model_name}: {len(paths)} adapted projections, {len(clients)} clients "
          f"({time.time() - start:.0f} s)", flush=True)
    rows, report, runs = {}, None, {}
    for name, strategy in strategies(args, len(domains)).items():
        t0 = time.time()
        result = fed.simulate(model, clients, strategy, rounds=args.rounds,
                              local_steps=args.local_steps, batch_size=args.batch,
                              learning_rate=args.lr, seed=args.seed, eval_every=args.rounds,
                              progress=False)
        rows[name] = client_row(result, labels, domains)
        runs[name] = {"row": rows[name], "history": result.history,
                      "client_metrics": {k: np.asarray(v).tolist()
                                         for k, v in result.client_metrics.items()}}
        if name == "fedtreelora" and (report := tree_of(result, labels)) is not None:
            runs[name]["tree"] = report
            plot_tree(report, labels, image, f"FedTreeLoRA tree after round "
                      f"{report['built_round']} ({'SmolLM2-135M' if is_real else 'tiny model'})")
        print(f"{name}: personalised NLL {rows[name]['personal_nll']:.4f}, global NLL "
              f"{rows[name]['global_nll']:.4f}, {time.time() - t0:.0f} s", flush=True)
        shown = image.name if image.parent == out.parent else f"../img/{image.name}"
        verdict_text = fedtree_verdict(rows, report, is_real)
        meta.update(elapsed_s=time.time() - start, model_name=model_name, domains=domains,
                    adapted=len(paths))
        write_domain_note(out, args, model_name, rows, domains, report, shown, meta, len(paths),
                          is_real, verdict_text)
        json_path = ROOT / "runs" / (out.stem + ".json")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"args": vars(args), "meta": meta, "labels": labels,
                                         "runs": runs, "verdict": verdict_text}, indent=1,
                                        default=float))
    print(out.read_text())
    print(f"written {out}, " + (f"{image}, " if report is not None else "") + f"{json_path}")


if __name__ == "__main__":
    main()
