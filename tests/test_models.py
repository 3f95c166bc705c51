"""load_model: what it refuses, with which message, before reading any weights; the config check it runs first."""

import importlib.metadata

import pytest
import torch

from conftest import tiny_model
from kascade import models
from kascade.models import load_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A transformers model folder: a tiny random Llama and a word-level tokenizer, saved as from_pretrained reads
    them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(folder)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(90))])}
    inner = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return folder


def test_a_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no model at .*nothing\.gguf \(give a \.gguf file or a folder"):
        load_model(tmp_path / "nothing.gguf")


def test_a_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"weights\.bin is a file but not a \.gguf"):
        load_model(f)


def test_a_gguf_that_is_not_one(tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_text("hello")
    with pytest.raises(ValueError, match=r"cannot read the tokenizer of .*fake\.gguf: .*GGUF"):
        load_model(f)


def test_a_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json; give a .gguf file or a transformers model folder"):
        load_model(tmp_path)


def test_a_folder_with_a_config_but_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"cannot read the tokenizer of .*: ") as e:
        load_model(tmp_path)
    assert "\n" not in str(e.value)  # transformers' multi-line message, on one line


def test_the_default_model_not_installed(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"default model \(SmolLM2-135M-Instruct\) is not installed") as e:
        load_model()
    assert models.INSTALL_HINT in str(e.value)


def test_the_default_model_package_without_its_file(monkeypatch):
    class Empty:
        files = []

    monkeypatch.setattr(models.importlib.metadata, "distribution", lambda name: Empty())
    with pytest.raises(FileNotFoundError, match=f"{models.DEFAULT_MODEL_FILE} is missing from it"):
        load_model()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA device")
def test_a_cuda_device_without_cuda(tiny_folder):
    with pytest.raises(ValueError, match="sees no CUDA device"):
        load_model(tiny_folder, device="cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        load_model(tiny_folder, device="gpu0")


def test_a_folder_loads_and_check_sees_its_config_before_the_weights(tiny_folder, monkeypatch):
    seen = []
    model, tok = load_model(tiny_folder, check=lambda config, tok: seen.append((config.num_hidden_layers, tok)))
    assert seen[0][0] == 4 and seen[0][1] is tok
    assert tok.pad_token == tok.eos_token and tok.padding_side == "left" and not model.training
    assert next(model.parameters()).dtype == torch.float32

    import transformers

    def no_weights(*a, **k):
        raise AssertionError("weights read after the check refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)

    def refuse(config, tok):
        raise ValueError(f"--anchors must be in 1..{config.num_hidden_layers}")

    with pytest.raises(ValueError, match=r"--anchors must be in 1\.\.4"):
        load_model(tiny_folder, check=refuse)


def test_lengths_beyond_the_trained_context_get_a_note():
    from types import SimpleNamespace

    from kascade.models import beyond_context

    config = SimpleNamespace(max_position_embeddings=8192)
    assert beyond_context(config, [4096, 8192], "kascade eval") is None
    note = beyond_context(config, [4096, 9000, 16384, 9000], "kascade eval")
    assert note.startswith("note: kascade eval at 9000, 16384 tokens, beyond the 8192 the model was trained for")
    assert beyond_context(SimpleNamespace(), [10**6], "kascade eval") is None  # a config that does not say
