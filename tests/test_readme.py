"""The README documents every flag of the service's commands and every setting (a new one must be described)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.queue_helpers import REPO

README = (Path(REPO) / "README.md").read_text()


def subcommand(name: str) -> argparse.ArgumentParser:
    from cli.main import build_parser
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["up", "worker", "api", "batch-worker"])
def test_every_flag_is_in_the_readme(command):
    flags = [a.option_strings[-1] for a in subcommand(command)._actions
             if a.option_strings and a.option_strings[-1].startswith("--") and a.option_strings[-1] != "--help"]
    missing = [flag for flag in flags if f"`{flag}" not in README and f"{flag}`" not in README]
    assert not missing, f"gaggle {command}: undocumented flags {missing}"


def test_every_setting_is_in_the_readme():
    from api.settings import Settings
    missing = [f"GAGGLE_{name.upper()}" for name in Settings.model_fields if f"GAGGLE_{name.upper()}" not in README]
    assert not missing, f"undocumented settings {missing}"
