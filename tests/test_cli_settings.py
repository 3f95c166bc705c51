"""kascade.cli.settings: a command's settings dataclass built from its options, every field reached."""

import argparse
from dataclasses import dataclass, field, make_dataclass

import pytest

from kascade import bench
from kascade.calibrate import pipeline
from kascade.cli import build_parser
from kascade.cli import bench as bench_command
from kascade.cli import calibrate as calibrate_command
from kascade.cli import eval as eval_command
from kascade.cli.settings import build
from kascade.eval import runner

# every command with a settings dataclass: its module in kascade.cli, and where the module finds the dataclass
COMMANDS = {
    "calibrate": (calibrate_command, pipeline),
    "eval": (eval_command, runner),
    "bench": (bench_command, bench),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_commands_defaults_are_the_dataclass_defaults(command):
    """Every field is reached from the options (no TypeError), and with no flag given each is the dataclass's
    default."""
    module, home = COMMANDS[command]
    assert module.settings(build_parser().parse_args([command])) == home.Settings()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_field_no_option_reaches_is_refused(command, monkeypatch):
    """A field added to a command's settings without an option, a mapping or an unset rule fails loudly, naming it,
    instead of being left at its default."""
    module, home = COMMANDS[command]
    extended = make_dataclass("Extended", [("added_later", int, field(default=0))], bases=(home.Settings,),
                              frozen=True)
    monkeypatch.setattr(home, "Settings", extended)
    with pytest.raises(TypeError, match=r"Extended: fields with no option, no mapping and no unset rule: added_later$"):
        module.settings(build_parser().parse_args([command]))


@dataclass(frozen=True)
class Toy:
    seq_len: int = 1
    rolling: bool = True
    warmup: int | None = None


def test_fields_come_from_options_mappings_and_unset_defaults():
    args = argparse.Namespace(seq_len=7, no_rolling=True, out="x")
    assert build(Toy, args, {"rolling": not args.no_rolling}, unset=("warmup",)) == Toy(seq_len=7, rolling=False)
    assert build(Toy, argparse.Namespace(seq_len=7, rolling=False, warmup=3)) == Toy(7, False, 3)
    # a mapping wins over an option of the field's name
    assert build(Toy, argparse.Namespace(seq_len=7, rolling=True, warmup=3), {"rolling": False}) == Toy(7, False, 3)


@pytest.mark.parametrize("mapped, unset, why", [
    ({"rolling": False}, (), "fields with no option, no mapping and no unset rule: warmup$"),
    ({}, ("warmup",), "fields with no option, no mapping and no unset rule: rolling$"),
    ({"rolling": False, "rollng": True}, ("warmup",), "mapped or unset names that are no fields: rollng$"),
    ({"rolling": False}, ("warmup", "seq_len"), "fields left unset that an option of their name would set: seq_len$"),
])
def test_a_field_reached_wrongly_or_not_at_all_is_refused(mapped, unset, why):
    with pytest.raises(TypeError, match=r"\.Toy: " + why):
        build(Toy, argparse.Namespace(seq_len=7), mapped, unset)
