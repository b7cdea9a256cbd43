"""The results note of a federated run whose clients hold different text domains.

:func:`client_row` reads one strategy's :class:`~lowrank_jax.federated.FederatedResult` into a
row (personalised / global held-out NLL and accuracy, bytes sent, NLL per domain);
:func:`tree_of` is FedTreeLoRA's tree report (``None`` while the tree is not built yet);
:func:`fedtree_verdict` reads the rows and the tree against FedTreeLoRA's claim (better
personalised models than the baselines); :func:`write_domain_note` writes the Markdown note
(``scripts/reproduce/llm_federated.py``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

from lowrank_jax.federated.fedtreelora import tree_report
from lowrank_jax.runs.results import markdown_table


def client_row(result, labels: Sequence[str], domains: Sequence[str]) -> dict:
    """The note's row of one strategy: means over clients of the last evaluation.

    ``personal_*``: each client's own model on its domain; ``global_*``: the server's model;
    accuracies in %; ``mb_sent``: server → client megabytes over all rounds; the first and last
    rounds' training loss; ``nll_<domain>``: the personalised NLL of that domain's clients.
    """
    m = result.client_metrics
    row = {"personal_nll": float(np.mean(m["personal_loss"])),
           "personal_acc": 100 * float(np.mean(m["personal_accuracy"])),
           "global_nll": float(np.mean(m["global_loss"])),
           "global_acc": 100 * float(np.mean(m["global_accuracy"])),
           "mb_sent": sum(r["bytes_down"] for r in result.history) / 1e6,
           "train_loss_first": result.history[0]["train_loss"],
           "train_loss_last": result.history[-1]["train_loss"]}
    for d in domains:
        mask = np.array(labels) == d
        row[f"nll_{d}"] = float(np.mean(m["personal_loss"][mask]))
    return row


def tree_of(result, labels: Sequence[str]) -> dict | None:
    """:func:`~lowrank_jax.federated.fedtreelora.tree_report` of a FedTreeLoRA run, or ``None``
    when its tree was never built (every round a warm-up round)."""
    if int(result.state["built"]) < 0:
        return None
    return tree_report(result.state, labels, result.context.layers)


def fedtree_verdict(rows: dict, report: dict | None, is_real: bool) -> str:
    """One paragraph: is FedTreeLoRA's personalised NLL the best of ``rows`` (``{strategy:
    client_row}``), and does its tree (``report``) cut the clients into their domains?

    Example::

        >>> rows = {"fedtreelora": {"personal_nll": 1.0}, "fedavg": {"personal_nll": 2.0}}
        >>> fedtree_verdict(rows, None, True)
        'Partly reproduced (FedTreeLoRA is best, but its tree does not find the domains): \
personalised held-out NLL 1.0000 vs 2.0000 for the best other arm (fedavg).'
    """
    if "fedtreelora" not in rows:
        return "FedTreeLoRA did not run."
    tree = rows["fedtreelora"]["personal_nll"]
    others = {k: v["personal_nll"] for k, v in rows.items() if k != "fedtreelora"}
    best_name = min(others, key=others.get) if others else None
    beats_all = best_name is None or tree < others[best_name]
    parts = []
    if report is not None:
        parts.append(f"the tree's {len(report['cut_groups'])}-group cut "
                     + ("is exactly the text domains" if report["cut_is_domains"]
                        else f"mixes domains ({report['cut_groups']})")
                     + f", {report['same_domain_pairs']}/{report['pairs']} first merges pair "
                       "clients of one domain")
        ks = list(report["depths"].values())
        singletons = min(ks) == len(report["tree"]) + 1
        parts.append(f"chosen groups per layer k_l from {min(ks)} to {max(ks)}"
                     + (" (singletons everywhere: FedTreeLoRA = local training)"
                        if singletons else ""))
    tree_right = report is not None and report["cut_is_domains"]
    # the claim is better personalised models than the baselines; a right tree alone is not it
    if beats_all and tree_right:
        word = "Reproduced" if is_real else "Reproduced on the tiny random model only"
    elif beats_all:
        word = "Partly reproduced (FedTreeLoRA is best, but its tree does not find the domains)"
    else:
        word = ("Not reproduced (the tree finds the domains, but FedTreeLoRA is not the best "
                "personalised model)" if tree_right else "Not reproduced")
    if best_name is not None:
        parts.append(f"personalised held-out NLL {tree:.4f} vs {others[best_name]:.4f} for the "
                     f"best other arm ({best_name})")
    return f"{word}: " + "; ".join(parts) + "."


COLUMNS = [("strategy", None), ("personalised NLL", "personal_nll"),
           ("personalised acc %", "personal_acc"), ("global NLL", "global_nll"),
           ("global acc %", "global_acc"), ("MB sent", "mb_sent")]


def write_domain_note(path, settings, model_name: str, rows: dict, domains: Sequence[str],
                      report: dict | None, image: str, meta: dict, n_layers: int, is_real: bool,
                      verdict: str) -> None:
    """Write the Markdown note of a run: the command line, the setup, the table of ``rows``,
    the tree (``image``, a link relative to the note) and the verdict.

    Args:
        path: the note's file.
        settings: the run's settings (``rank``, ``pattern``, ``clients_per_domain``, ``rounds``,
            ``local_steps``, ``lr``, ``batch``, ``length``, ``train_windows``,
            ``heldout_windows``, ``seed``, ``warmup_rounds``, ``tau``, ``rebuild_every``), e.g.
            the script's ``argparse`` namespace.
        meta: ``command``, ``date``, ``machine`` and optionally ``elapsed_s``.
    """
    took = "" if meta.get("elapsed_s") is None else f", {meta['elapsed_s']:.0f} s"
    a = settings
    lines = [f"# FedTreeLoRA on {'SmolLM2-135M' if is_real else 'a tiny random Llama'}: "
             "clients on different text domains", "",
             f"`{meta['command']}` — {meta['date']}, {meta['machine']}{took}.", ""]
    if not is_real:
        lines += ["**Tiny random model (smoke run), not SmolLM2: the numbers say nothing about "
                  "the claim.**", ""]
    lines += [f"**Setup.** {model_name}; LoRA rank {a.rank} on `{a.pattern}` "
              f"({n_layers} adapted projections); {len(domains)} domains × "
              f"{a.clients_per_domain} clients = {len(domains) * a.clients_per_domain} "
              f"clients, all every round; {a.rounds} rounds × {a.local_steps} Adam steps "
              f"(lr {a.lr:g}, batch {a.batch} × {a.length} tokens, fresh optimizer "
              f"state each round); {a.train_windows} train windows per client, "
              f"{a.heldout_windows} held-out windows per domain; seed {a.seed}. "
              f"FedTreeLoRA: {a.warmup_rounds} local warm-up rounds, τ = {a.tau:g}, "
              f"rebuilt every {a.rebuild_every} rounds. FedHera with every client at the "
              "same rank (so its tiers do not matter: dense average + SVD push). Scores: "
              "next-token NLL (nats) and accuracy on held-out text after the last round — "
              "*personalised*: each client's own model on its domain, mean over clients; "
              "*global*: the server's model on every client's domain. *MB sent*: server → "
              "clients over all rounds, fp16.", ""]
    header = [c for c, _ in COLUMNS] + [f"NLL {d}" for d in domains]
    cells = [[name] + [f"{row[k]:.4f}" if "nll" in k else f"{row[k]:.2f}"
                       for _, k in COLUMNS[1:]] + [f"{row[f'nll_{d}']:.4f}" for d in domains]
             for name, row in rows.items()]
    lines += markdown_table(header, [dict(zip(header, c)) for c in cells]) + [""]
    if report is not None:
        lines += [f"![FedTreeLoRA tree]({image})", "",
                  f"Tree built at round {report['built_round']} from the B change of every "
                  f"client; cut at {len(domains)} groups: {report['cut_groups']}. Groups per "
                  f"adapted layer k_l (shallow → deep): {list(report['depths'].values())}.", ""]
    lines += [f"**Verdict.** {verdict}", ""]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


__all__ = ["COLUMNS", "client_row", "fedtree_verdict", "tree_of", "write_domain_note"]
