"""Every command's defaults are the defaults of the library constructor it calls."""

import argparse
import inspect

import pytest

from lowrank_jax.analysis.model_report import model_report
from lowrank_jax.bench import run_suite
from lowrank_jax.cli import build_parser
from lowrank_jax.data.selection import select_subset, text_embeddings
from lowrank_jax.editing import EditConfig, capability_data
from lowrank_jax.hyper import internalize
from lowrank_jax.hyper.doc_to_lora import DocToLoRAConfig
from lowrank_jax.kv import kv_cache_factory
from lowrank_jax.models.generate import generate, perplexity
from lowrank_jax.quantize.pipeline import calibration_tokens, quantize_model
from lowrank_jax.quant.unisvq import UniSVQConfig
from lowrank_jax.train.finetune import default_lr, finetune
from lowrank_jax.train.job import FinetuneJob
from lowrank_jax.train.jobs import run_jobs_file
from lowrank_jax.train.multihost import launch
from lowrank_jax.train.structure import export_salaad

KV = [kv_cache_factory, {"kv_ratio": "ratio", "kv_group": "group_size", "kv_sink": "sink_tokens"}]
# command -> the library callables its run() passes arguments to, with CLI dest -> parameter
# renames (a dest of the same name as a parameter needs no entry)
CALLS = {
    "finetune": [[finetune, {}], [FinetuneJob, {}]],
    "jobs": [[run_jobs_file, {}]],
    "edit": [[EditConfig, {}],
             [capability_data, {"capability_seqs": "n_capability", "held_seqs": "n_held"}]],
    "eval": [[perplexity, {}], KV],
    "generate": [[generate, {}], KV],
    "internalize": [[internalize, {}], [DocToLoRAConfig, {}]],
    "select": [[select_subset, {}], [text_embeddings, {}]],
    "quantize": [[quantize_model, {}], [UniSVQConfig, {}],
                 [calibration_tokens, {}]],
    "analyze": [[model_report, {}]],
    "export": [[export_salaad, {}]],
    "launch": [[launch, {}]],
    "bench": [[run_suite, {}]],
}
# (command, dest): why the CLI default may differ from the library's
EXEMPT = {
    ("select", "chunk_rows"): "the CLI streams only matrices taller than --chunk-rows "
                              "(it passes None below); the library streams when given a number",
    ("select", "rank"): "unset, it is the library's 32 capped below the embedding dimension "
                        "(a rank at the dimension leaves no residual)",
    ("eval", "kv_group"): "unset, it is the library's 4 capped at the model's layer count "
                          "(kv_factory_from_args)",
    ("generate", "kv_group"): "unset, it is the library's 4 capped at the model's layer count "
                              "(kv_factory_from_args)",
}


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _pairs():
    subs = _subparsers()
    for command, calls in CALLS.items():
        for fn, renames in calls:
            params = inspect.signature(fn).parameters
            for action in subs[command]._actions:
                name = renames.get(action.dest, action.dest)
                if name in params and params[name].default is not inspect.Parameter.empty:
                    yield command, action.dest, action.default, fn, name, params[name].default


def test_every_command_of_the_cli_is_covered():
    assert set(_subparsers()) - set(CALLS) == {"compile", "federate", "merge", "plan", "pretrain"}
    # those take a config file (its defaults are the config dataclasses') or none


def test_the_renames_name_real_arguments_and_parameters():
    subs = _subparsers()
    for command, calls in CALLS.items():
        dests = {a.dest for a in subs[command]._actions}
        for fn, renames in calls:
            params = inspect.signature(fn).parameters
            for dest, name in renames.items():
                assert dest in dests and name in params, (command, dest, fn, name)


@pytest.mark.parametrize("command", sorted(CALLS))
def test_cli_defaults_equal_the_library_defaults(command):
    pairs = [p for p in _pairs() if p[0] == command]
    assert pairs, command  # each command shares at least one default with its library call
    wrong = [f"{command} --{dest.replace('_', '-')}: CLI {cli!r} vs {fn.__qualname__}"
             f"({name}={lib!r})"
             for _, dest, cli, fn, name, lib in pairs
             if (command, dest) not in EXEMPT and not (cli == lib and type(cli) is type(lib))]
    assert not wrong, "\n".join(wrong)


def test_the_exemptions_are_still_needed():
    differing = {(c, d) for c, d, cli, _, _, lib in _pairs() if cli != lib}
    assert set(EXEMPT) <= differing


def test_finetune_maps_every_option_onto_a_finetune_job_field_with_its_default():
    """``finetune`` with no options builds the default FinetuneJob (every field from a flag;
    --no-progress is progress=False, --jobs is the jobs command)."""
    import dataclasses

    from lowrank_jax.commands import finetune as command

    args = build_parser().parse_args(["finetune"])
    fields = {f.name: f for f in dataclasses.fields(FinetuneJob)}
    assert set(command._JOB_FIELDS) == set(fields) - {"progress"}
    for name in command._JOB_FIELDS:
        value, default = getattr(args, name), fields[name].default
        assert value == default and type(value) is type(default), (name, value, default)
    assert args.no_progress is False and fields["progress"].default is True
    assert FinetuneJob(**{n: getattr(args, n) for n in command._JOB_FIELDS}) == FinetuneJob()


def test_finetune_lr_resolves_to_the_library_default_per_method():
    sub = _subparsers()["finetune"]
    lr = next(a for a in sub._actions if a.dest == "lr")
    assert lr.default is None and inspect.signature(finetune).parameters["lr"].default is None
    assert default_lr("balora") == 1e-4 and default_lr("lora") == default_lr("pissa") == 1e-3
    assert "0.0001 for balora" in lr.help
