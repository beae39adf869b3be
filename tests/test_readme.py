"""The README documents every option and environment variable the EP reads."""
from pathlib import Path

from ortmlx.ep.options import SPEC

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_option_and_env_var_is_in_the_readme():
    missing = [k for k in SPEC if f"`{k}`" not in README]
    missing += [e for names, _ in SPEC.values() for e in names if f"`{e}`" not in README]
    assert missing == []


def test_readme_names_the_two_commands():
    assert "bash scripts/demo.sh" in README and "bash scripts/test.sh" in README
