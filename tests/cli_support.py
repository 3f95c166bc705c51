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


class ChatCharTokenizer(CharTokenizer):
    """A CharTokenizer with a chat template (``<user>`` ... ``<assistant>``; each call recorded in ``chats``) and a
    decoder, for the generated tasks."""

    def __init__(self):
        self.chats = []

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return "".join(chr(32 + (i - 3) % 94) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False,
                            return_tensors=None):
        import torch

        self.chats.append(dict(messages=messages, add_generation_prompt=add_generation_prompt))
        s = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages) + ("<assistant>\n" if add_generation_prompt
                                                                              else "")
        if not tokenize:
            return s
        ids = self(s).input_ids
        if return_tensors == "pt":
            ids = torch.tensor([ids])
        if return_dict:
            return dict(input_ids=ids, attention_mask=torch.ones_like(ids) if return_tensors else [1] * len(ids))
        return ids


def texts_file(path, count, chars=300):
    """A JSONL file of ``count`` distinct random texts."""
    path.write_text("".join(json.dumps({"text": "".join(random.Random(i).choices(string.ascii_letters + " ", k=chars))})
                            + "\n" for i in range(count)))
    return path


def tiny_loader(model, tokenizer=None) -> SimpleNamespace:
    """``load`` stands in for ``kascade.models.load_model``: like it, it calls ``check(config, tokenizer)`` before it
    'reads the weights', which ``loads`` counts. The tokenizer: ``tokenizer``, else a fresh CharTokenizer per load."""
    loads = []

    def load(path=None, *, device="cpu", dtype=None, check=None):
        tok = tokenizer if tokenizer is not None else CharTokenizer()
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
