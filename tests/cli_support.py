"""What the command tests share: a character tokenizer, a file of random texts, a stand-in for ``load_model``
that serves a tiny model, and the check that a command refused its input in one line."""

import json
import random
import string
from types import SimpleNamespace

from kascade.cli import main


class CharTokenizer:
    """Characters as token ids 3..96 (inside the tiny models' vocabulary of 97)."""

    pad_token_id = eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[3 + ord(c) % 94 for c in text])


def texts_file(path, count, chars=300):
    """A JSONL file of ``count`` distinct random texts."""
    path.write_text("".join(json.dumps({"text": "".join(random.Random(i).choices(string.ascii_letters + " ", k=chars))})
                            + "\n" for i in range(count)))
    return path


def tiny_loader(model) -> SimpleNamespace:
    """``load`` stands in for ``kascade.models.load_model``: like it, it calls ``check(config, tokenizer)`` before it
    'reads the weights', which ``loads`` counts."""
    loads = []

    def load(path=None, *, device="cpu", dtype=None, check=None):
        tok = CharTokenizer()
        if check is not None:
            check(model.config, tok)
        loads.append(path)
        return model, tok

    return SimpleNamespace(model=model, loads=loads, load=load)


def one_line_error(command, argv, capsys) -> str:
    """The command's error output, checked to be one line `kascade <command>: error: ...` with exit status 2."""
    try:
        rc = main([command, *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"kascade {command}: error: ") and err.count("\n") == 1, (argv, rc, err)
    return err
