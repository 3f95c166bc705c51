"""The `kascade` command as a whole: what happens before any command runs."""

import subprocess
import sys

import pytest

from kascade import cli


def test_importing_the_command_loads_neither_torch_nor_transformers():
    """The console script imports kascade.cli before main() can answer Ctrl-C: that import must be quick (it took
    1.6 s, torch and transformers included, and Ctrl-C in that time printed a traceback)."""
    code = "import sys, kascade.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_ctrl_c_while_the_command_starts_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err == "kascade: interrupted\n"


def test_every_commands_help_lists_every_option_with_its_help(capsys):
    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert set(commands) == {"demo", "calibrate", "eval", "bench", "costs"}
    for name, sub in commands.items():
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
        listed = "".join(options.split())  # argparse wraps lines at spaces and hyphens
        for a in sub._actions:
            assert a.option_strings and len(a.help) > 20, (name, a.dest)
            line = f"{sub._get_formatter()._format_action_invocation(a)} {a.help}"  # e.g. "--seq-len SEQ_LEN tokens..."
            assert "".join(line.split()) in listed, (name, a.option_strings)
