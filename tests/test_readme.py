"""The README a newcomer reads: short, every ``kiln`` command in it parses, every link resolves
(and the docs' links too)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kiln.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _code_blocks(text: str) -> list[str]:
    """The shell code blocks (fenced as bash, sh or nothing) of a markdown text."""
    blocks, current, language = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh"):
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _kiln_commands(text: str) -> list[str]:
    commands = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("kiln "):
                commands.append(line)
    return commands


def test_readme_is_short():
    assert README.read_text().count("\n") <= 200


@pytest.mark.parametrize("command", _kiln_commands(README.read_text()))
def test_every_kiln_command_in_the_readme_parses(command):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as e:
        pytest.fail(f"{command!r} does not parse (exit {e.code})")


@pytest.mark.parametrize("page", [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_benchmarks_readme_is_the_report_of_results_jsonl():
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.main(["--check"]) == 0, "run python benchmarks/report.py"
    assert (ROOT / "benchmarks" / "README.md").read_text().count("\n") <= 120
