"""`kvfuse bench` wiring: subcommands, other packages' benches guarded, the recorded command line."""

from __future__ import annotations

import argparse

import pytest

from kvfuse.bench import cli as bench_cli
from kvfuse.bench.machine import command_line, machine_info


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuse")
    bench_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_bench_subcommands_parse():
    args = _parser().parse_args(["bench", "fidelity", "--task", "needle,musique", "--task", "vartrack",
                                 "--ratios", "0.1,1", "--methods", "vanilla,a3"])
    assert args.task == [["needle", "musique"], ["vartrack"]] and args.ratios == [0.1, 1.0]
    assert args.methods == ["vanilla", "a3"] and args.max_tokens is None
    args = _parser().parse_args(["bench", "speed", "--contexts", "1024,2048"])
    assert args.contexts == [1024, 2048] and args.repeats == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "speed", "--contexts", "1k"])


def test_command_line_spells_out_every_effective_option(monkeypatch: pytest.MonkeyPatch):
    for k in [k for k in __import__("os").environ if k.startswith("KVFUSE_")]:
        monkeypatch.delenv(k)
    args = _parser().parse_args(["bench", "fidelity", "--task", "needle", "--n", "2"])
    cmd = command_line("kvfuse bench fidelity", args.parser, args)
    assert cmd.startswith("kvfuse bench fidelity --task needle --n 2 --docs 8 --doc-tokens 512 ")
    assert "--ratios 0.05,0.15,0.3,1 " in cmd and "--json bench-results/fidelity.json" in cmd
    assert "--url" not in cmd and "--max-tokens" not in cmd  # unset options are not invented
    args = _parser().parse_args(["bench", "speed", "--no-cold"])
    assert " --no-cold " in command_line("kvfuse bench speed", args.parser, args)
    monkeypatch.setenv("KVFUSE_MODEL__THREADS", "1")
    monkeypatch.setenv("KVFUSE_SERVER__API_KEYS", "secret")
    monkeypatch.setenv("KVFUSE_REDIS_URL", "redis://:hunter2@db:6379/0")
    cmd = command_line("kvfuse bench speed", args.parser, args)
    assert cmd.startswith("KVFUSE_MODEL__THREADS=1 kvfuse bench speed ") and "secret" not in cmd
    assert "hunter2" not in cmd
    # token counts change the run and are no secret
    monkeypatch.setenv("KVFUSE_RETRIEVER__CHUNK_TOKENS", "256")
    cmd = command_line("kvfuse bench speed", args.parser, args)
    assert cmd.startswith("KVFUSE_MODEL__THREADS=1 KVFUSE_RETRIEVER__CHUNK_TOKENS=256 kvfuse bench speed ")


def test_machine_info_names_cpu_cores_and_torch():
    info = machine_info()
    assert info["cpu_model"] and info["cpu_cores"] >= 1 and info["torch"]


def test_fidelity_layouts_and_their_tasks():
    parse = _parser().parse_args
    args = parse(["bench", "fidelity", "--layout", "haystack,multidoc", "--doc-order", "retrieval,shuffled"])
    assert args.layout == ["haystack", "multidoc"] and args.doc_order == ["retrieval", "shuffled"]
    # no --task: every task the layout has
    assert bench_cli._fidelity_tasks(args) == {"haystack": ["needle", "multikey", "multivalue", "vartrack",
                                                            "musique"],
                                               "multidoc": ["needle", "multikey", "multivalue"]}
    args = parse(["bench", "fidelity", "--task", "needle"])
    assert args.doc_order is None and not args.answer_prefix  # the service's order and prompt (set at run time)
    assert bench_cli._fidelity_tasks(args) == {"haystack": ["needle"]}
    args = parse(["bench", "fidelity", "--layout", "multidoc", "--task", "multikey"])
    assert bench_cli._fidelity_tasks(args) == {"multidoc": ["multikey"]}
    for bad, says in ((["--layout", "multidoc", "--task", "vartrack"], "multidoc layout has the tasks"),
                      (["--layout", "pile"], "unknown pile"), (["--doc-order", "best"], "unknown best")):
        with pytest.raises(ValueError, match=says):
            bench_cli._fidelity_tasks(parse(["bench", "fidelity", *bad]))


def test_an_unsupported_layout_task_exits_2_before_any_model_loads(capsys, shared_data):
    from kvfuse.cli import main

    assert main(["bench", "fidelity", "--layout", "multidoc", "--task", "musique", "--data-dir",
                 str(shared_data)]) == 2
    assert "musique" in capsys.readouterr().err
