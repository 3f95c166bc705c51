"""`kascade demo`: a needle in a long haystack of real text, answered densely and with Kascade."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from . import text
from .fidelity import DenseReference
from .integration.hf import enable
from .models import load_model
from .plan import ModelFingerprint, resolve_plan

NEEDLE = "The secret passphrase of the archive is {value}."
QUESTION = "What is the secret passphrase of the archive? Answer with the passphrase only."
VALUE = "blue-harbor-7421"


@dataclass
class RunResult:
    answer: str
    prefill_s: float
    decode_s: float
    new_tokens: int
    decode_steps: int  # forward calls after the first token


def build_prompt(tokenizer, tokens: int, seed: int = 0) -> torch.Tensor:
    """Chat-formatted prompt of about ``tokens`` tokens: haystack from the evaluation text, needle in the middle."""
    needle = NEEDLE.format(value=VALUE)
    frame = tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n\n" + needle + "\n\n" + QUESTION}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )
    room = tokens - len(frame)
    if room < 64:
        raise ValueError(f"--tokens {tokens} is too short for the haystack; use at least {len(frame) + 64}")
    hay = text.windows(tokenizer, "eval", room, 1, seed=seed)[0]
    half = [tokenizer.decode(x, clean_up_tokenization_spaces=False) for x in (hay[: room // 2], hay[room // 2 :])]
    content = half[0] + "\n\n" + needle + "\n\n" + half[1] + "\n\n" + QUESTION
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return torch.tensor([ids])


class _Clock:
    """A ``model.generate`` streamer: the times of the prompt, of every new token and of the end; a bar step per
    token. Tokens reach it on the host, so each stamp follows the device's work for that token."""

    def __init__(self, bar, device: torch.device):
        self.bar, self.stamps = bar, []
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def put(self, tokens):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) > 1:
            self.bar.update(1)

    def end(self):
        self.sync()
        self.stamps.append(time.perf_counter())


@torch.no_grad()
def greedy(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, bar) -> RunResult:
    """The greedy answer to ``ids [1, n]`` (``model.generate``), the time to its first token (the prefill) and the
    time of the tokens after it."""
    dev = next(model.parameters()).device
    clock = _Clock(bar, dev)
    ids = ids.to(dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, streamer=clock)
    new = out[0, ids.shape[1] :].tolist()
    t = clock.stamps  # prompt, first token, ..., end
    answer = tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
    return RunResult(answer, t[1] - t[0], t[-1] - t[1], len(new), len(new) - 1)


def run(tokens: int = 4096, max_new_tokens: int = 24, compare_last: int = 512, device: str = "cpu",
        model_path=None, plan=None, seed: int = 0) -> dict:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    print(f"loading {'the default model (SmolLM2-135M-Instruct)' if model_path is None else model_path} ...", flush=True)
    prompt, plans = [], []

    def check(config, tok):  # before the weights: the plan's model and the prompt's length
        fp = ModelFingerprint.from_config(config)
        plans.append(resolve_plan(plan, fp))
        diffs = plans[0].fingerprint.differences(fp)
        if diffs:
            raise ValueError("--plan was made for another model: " + "; ".join(diffs))
        prompt.append(build_prompt(tok, tokens, seed=seed))

    model, tok = load_model(model_path, device=device, dtype=dtype, check=check)
    load_s = time.perf_counter() - t0
    ids = prompt[0]
    plan = plans[0]
    results = {}
    with tqdm(total=2 * max_new_tokens, desc="dense + kascade", unit="step") as bar:
        bar.set_postfix_str("dense")
        results["dense"] = greedy(model, tok, ids, max_new_tokens, bar)
        bar.set_postfix_str("kascade")
        with enable(model, plan):
            results["kascade"] = greedy(model, tok, ids, max_new_tokens, bar)
        bar.update(bar.total - bar.n)
    # teacher-forced on the prompt's last `compare_last` positions (position t's logits predict token t + 1)
    print("teacher-forced comparison on the prompt ...", flush=True)
    ref = DenseReference(model, [ids[0]], positions=compare_last, backend="auto")
    (fid,) = ref.compare(plan)
    return dict(prompt_tokens=ids.shape[1], load_s=load_s, plan=plan, results=results, fidelity=fid,
                expected=VALUE, device=device)


def report(r: dict) -> str:
    plan = r["plan"]
    lines = [
        f"prompt: {r['prompt_tokens']} tokens (needle: {r['expected']!r}), device {r['device']}, model load {r['load_s']:.1f} s",
        f"plan: {len(plan.anchors)} anchors {list(plan.anchors)} of {plan.num_layers} layers, ratio {plan.ratio}, "
        f"k_min {plan.k_min}, tile {plan.tile}" + ("" if plan.calibrated else " (UNCALIBRATED)"),
        f"      {plan.source}",
        "",
        f"{'':8} {'prefill s':>10} {'decode s/tok':>13}  answer",
    ]
    for name, res in r["results"].items():
        per_tok = res.decode_s / max(1, res.decode_steps)
        lines.append(f"{name:8} {res.prefill_s:10.2f} {per_tok:13.3f}  {res.answer!r}")
    lines += ["", f"teacher-forced on the prompt's last {r['fidelity'].positions} positions: {r['fidelity']}"]
    return "\n".join(lines)
