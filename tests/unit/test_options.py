"""Each setting is declared once: ``node join``'s options, README's table and the defaults in force agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from node.cli.app import join_flags, parse_join_args
from node.cli.options import TABLE_BEGIN, TABLE_END, default_text, flag_name, markdown_table, readme_with_table
from node.config import OUTER_DEFAULTS, NodeConfig
from node.config.defaults import by_replicas_text

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_option_table_is_the_generated_one() -> None:
    text = README.read_text()
    assert TABLE_BEGIN in text and TABLE_END in text
    assert readme_with_table(text) == text, "README's option table is stale: run python -m node.cli.options"


def test_every_setting_is_a_flag_and_every_flag_a_setting() -> None:
    assert set(join_flags.__annotations__) - {"config", "return"} == set(NodeConfig.model_fields)
    table = markdown_table()
    for name in NodeConfig.model_fields:
        assert f"| `--{flag_name(name)}` |" in table


@pytest.mark.parametrize("name", [n for n, f in NodeConfig.model_fields.items()
                                  if f.get_default(call_default_factory=True) not in (None, [])])
def test_a_plain_default_reads_as_the_value_in_force(name: str) -> None:
    """The help's default is the value a node gets when the flag is left out (no second copy to drift)."""
    value = getattr(NodeConfig(), name)
    shown = default_text(name)
    if isinstance(value, bool):
        assert shown == ("on" if value else "off")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        assert float(shown) == float(value)
    elif isinstance(value, list):
        assert shown == ", ".join(value)
    else:
        assert shown == str(value)


def test_outer_defaults_in_the_help_are_the_ones_in_force() -> None:
    """``--outer-lr``'s default is written once (OUTER_DEFAULTS): the help quotes what each algorithm gets."""
    lr_text, momentum_text = default_text("outer_lr"), default_text("outer_momentum")
    for algorithm in ("diloco", "noloco", "sparseloco"):
        lr, momentum = parse_join_args(["--algorithm", algorithm]).outer_hyper
        assert (lr, momentum) == OUTER_DEFAULTS[algorithm]
        if algorithm != "diloco":
            assert f"{lr} for {algorithm}" in lr_text and f"{momentum} for {algorithm}" in momentum_text
    assert lr_text.startswith(f"{OUTER_DEFAULTS['diloco'][0]};")
    lossy = parse_join_args(["--compression", "q2"]).outer_hyper
    assert f"{lossy[0]} for diloco with a lossy codec" in lr_text and f"{lossy[1]} for diloco with a lossy codec" in momentum_text


def test_inner_steps_default_in_the_help_is_the_one_in_force() -> None:
    shown = default_text("inner_steps")
    assert shown.startswith(f"{parse_join_args([]).inner_steps};") and parse_join_args(["--algorithm", "sparseloco"]).inner_steps == "auto"
    steps = parse_join_args(["--algorithm", "noloco"]).inner_steps
    assert re.search(rf"\b{steps} for [a-z ]*noloco", shown), shown
    median = default_text("round_steps")  # auto's median H: the by-replicas tables
    assert median.startswith(f"by replicas ({by_replicas_text('diloco')})")
    assert f"by replicas ({by_replicas_text('sparseloco')}) for sparseloco" in median


def test_env_and_flag_spellings() -> None:
    assert flag_name("model_config_file") == "model-config" and flag_name("inner_steps") == "inner-steps"
    assert parse_join_args(["--model-config", str(README)]).model_config_file == README  # any file passes the flag parser
