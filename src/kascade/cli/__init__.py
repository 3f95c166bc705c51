"""The `kascade` command: demo | calibrate | eval | bench | costs, one module each (:mod:`.demo`, :mod:`.calibrate`,
:mod:`.eval`, :mod:`.bench`, :mod:`.costs`: ``add(sub)``, the command's options; ``run(args)``, what it runs). A
command's settings dataclass is built from its options field by field (:mod:`.settings`); the option value types are in
:mod:`.types`.

Every argument is checked before a model is loaded. An error the user can cause ends the command with one line,
``kascade <command>: error: ...``, and exit status 2 (argparse's convention); anything else shows its traceback.
"""

from __future__ import annotations

import argparse
import re
import sys

from . import bench, calibrate, costs, demo, eval  # eval: the command's module (importing it binds the name anyway)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors on one line (no usage block): ``kascade <command>: error: ...``, status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # arguments left over are reported by the command's parser, as `kascade <command>: error: ...`
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            getattr(ns, "parser", self).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kascade",
        description="Kascade sparse attention for Hugging Face models (arXiv 2512.16391): a few anchor layers select "
        "the top-k keys of each query tile, the layers after them reuse those keys. Commands: demo (one needle "
        "question, dense against Kascade), calibrate (make a plan for a model), eval (accuracy against dense and "
        "other sparse methods), bench (speed and memory), costs (measure the kernel times of the speed model on this "
        "GPU).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (demo, calibrate, eval, bench, costs):
        command.add(sub)
    return p


def main(argv=None) -> int:
    try:
        import torch

        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # while torch and the commands' modules load (the first second or two)
        print("kascade: interrupted", file=sys.stderr)
        return 130
    try:
        return args.func(args)
    except (ValueError, OSError, MemoryError, torch.OutOfMemoryError) as e:
        message = re.sub(r"\s*\n\s*", " ", str(e)).strip()  # some messages (transformers') span lines
        if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            message = f"out of memory ({message[:200] or 'no details'}); shorter lengths or fewer samples need less"
        print(f"kascade {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = ""
        if args.command == "eval":
            kept = f"; the finished rows are in {args.out}, and the same command resumes them"
        elif args.command == "costs":
            kept = f"; the configurations measured so far are in {args.out}"
        print(f"kascade {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
