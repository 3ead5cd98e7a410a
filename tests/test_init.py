"""rollout-hpc init: the shipped examples written as a user gets them (comments and data files included), run
through the real CLI entry point in a directory outside the checkout. Also: every subcommand has a one-line help
and a row in docs/cli.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from rollout_hpc import cli
from rollout_hpc.commands.init import examples
from rollout_hpc.config import load_config

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str) -> int:
    return cli.main(list(argv))


def test_default_is_the_quickstart_with_its_data_and_it_validates(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("init") == 0
    assert (tmp_path / "quickstart.yaml").read_bytes() == (REPO / "configs" / "quickstart.yaml").read_bytes()
    for name in ("sums-train.jsonl", "sums-val.jsonl"):
        assert (tmp_path / "configs" / "data" / name).read_bytes() == (REPO / "configs" / "data" / name).read_bytes()
    assert "rollout-hpc submit quickstart.yaml" in capsys.readouterr().err
    assert run("validate", "quickstart.yaml") == 0  # reads both data files, relative to this directory
    assert "1800 training prompts" in capsys.readouterr().out


def test_every_shipped_config_is_an_example_that_loads(tmp_path, monkeypatch):
    shipped = {p.stem for p in (REPO / "configs").glob("*.yaml")} | {
        p.stem for p in (REPO / "configs" / "examples").glob("*.yaml")
    }
    assert set(examples()) == shipped
    monkeypatch.chdir(tmp_path)
    for name, source in examples().items():
        assert run("init", "--example", name, "--out", f"out/{name}.yaml") == 0
        written = tmp_path / "out" / f"{name}.yaml"
        assert written.read_text() == source.read_text()
        assert load_config(written, []).run.name  # parses and validates as a config
    # the CPU dataset example's data came along, under the path the config names
    assert (tmp_path / "out" / "configs" / "examples" / "data" / "arithmetic-digits.jsonl").is_file()


def test_out_elsewhere_puts_the_data_beside_it_and_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("init", "--example", "dataset-arithmetic-cpu", "--out", "sub/dir/my.yaml") == 0
    assert (tmp_path / "sub/dir/configs/examples/data/arithmetic-digits.jsonl").is_file()
    assert "cd sub/dir && rollout-hpc submit my.yaml" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path / "sub" / "dir")
    assert run("validate", "my.yaml") == 0


def test_unknown_example_lists_the_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("init", "--example", "quickstrat") == 2
    message = capsys.readouterr().err
    assert "quickstrat" in message and "Traceback" not in message
    for name in examples():
        assert name in message
    assert not list(tmp_path.iterdir())
    assert run("init", "--list") == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in examples())


def test_an_edited_file_is_not_overwritten_without_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("init", "--example", "smoke") == 0
    assert run("init", "--example", "smoke") == 0  # the same content again: nothing lost, no complaint
    (tmp_path / "smoke.yaml").write_text("run: {name: mine}\n")
    assert run("init", "--example", "smoke") == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "smoke.yaml").read_text() == "run: {name: mine}\n"
    assert run("init", "--example", "smoke", "--force") == 0
    assert (tmp_path / "smoke.yaml").read_bytes() == (REPO / "configs" / "smoke.yaml").read_bytes()


def test_out_dash_prints_the_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("init", "--example", "hello", "--out", "-") == 0
    assert capsys.readouterr().out == (REPO / "configs" / "hello.yaml").read_text()
    assert not list(tmp_path.iterdir())


def test_every_subcommand_has_a_help_line_and_a_row_in_docs_cli():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert set(helps) == set(subparsers.choices)
    missing_help = [name for name, text in helps.items() if not text or "\n" in text]
    assert not missing_help
    table = (REPO / "docs" / "cli.md").read_text()
    missing_row = [name for name in helps if f"| `{name}" not in table]
    assert not missing_row, f"docs/cli.md has no table row for {missing_row}"
