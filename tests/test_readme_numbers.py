"""The README's speed numbers are the committed measurements: every figure of its headline and of its Speed section
is recomputed from the benchmark JSON it comes from and must equal it at the precision shown (a README updated
without its JSON, or a JSON re-run without the README, fails here)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs" / "benchmarks"

# Where the Speed tables' rows come from (the sentences under each table say which run each row is), per card.
DECODE = {"H200": "decode_run11.json", "H100": "decode_run12_h100.json"}
PREFILL = {"H200": {(1, 131072): "prefill_run11_128k.json", (1, 32768): "prefill_run11_32k_sweep.json",
                    (4, 131072): "prefill_run9_b4.json", (4, 32768): "prefill_run9_b4.json"},
           "H100": {(1, 131072): "prefill_run12_h100.json", (1, 32768): "prefill_run12_h100.json",
                    (4, 131072): "prefill_run12_h100_b4.json", (4, 32768): "prefill_run12_h100_b4.json"}}
SCRATCH = ("prefill_run11_128k.json", "prefill_run11_32k_sweep.json", "prefill_run9_b4.json",  # "measured ... MB"
           "prefill_run12_h100.json", "prefill_run12_h100_b4.json")
SIZES = {"32K": 32768, "128K": 131072}


def _rows(name):
    return json.loads((DOCS / name).read_text())["rows"]


def _decode(B, N, HQ=32, card="H200"):
    (row,) = [r for r in _rows(DECODE[card]) if (r["B"], r["N"], r["HQ"]) == (B, N, HQ)]
    t = row["times_us"]
    return {"reuse": t["reuse"] / t["dense"], "anchor": t["anchor"] / t["dense"], "model": row["model_speedup"]}


def _prefill(B, N, model="llama-3.1-8b", card="H200"):
    (row,) = [r for r in _rows(PREFILL[card][(B, N)]) if (r["model"], r["B"], r["N"]) == (model, B, N)]
    return {"reuse": row["reuse_x"], "anchor": row["anchor_x"], "model": row["model_speedup"]}


def _shown(text: str, value: float) -> None:
    """``text`` (a number as printed) is ``value`` rounded to the digits shown."""
    digits = len(text.split(".")[1]) if "." in text else 0
    assert abs(float(text) - value) <= 0.5 * 10**-digits + 1e-9, (text, value)


def _find(pattern: str, text: str = README) -> tuple[str, ...]:
    m = re.search(pattern, text, flags=re.S)
    assert m, f"README no longer says {pattern!r}: update this test with it"
    return m.groups()


def _bench(text):
    """The `kascade bench` run the text links to, and its Llama-shape config at B, 128K."""
    (run,) = _find(r"\(docs/benchmarks/(bench_run\d+)/bench\.md\)", text)
    configs = json.loads((DOCS / run / "bench.json").read_text())["configs"]
    return {c["batch"]: c for c in configs if c["model"] == "llama8b" and c["length"] == 131072}


def _speed(card):
    """The Speed section's part about one card (its "### <card>" heading to the next)."""
    part = README[README.index(f"### {card}"):]
    return re.split(r"\n##", part[1:])[0]


def test_headline():
    head = README[README.index("<!-- headline -->"):README.index("On the embedded SmolLM2")]
    h200, h100 = head[:head.index("On an H100")], head[head.index("On an H100"):]
    c = _bench(h200)[1]
    speed, t_dense, t_kascade = _find(r"time to first token ([\d.]+)x faster \(([\d.]+) s -> ([\d.]+) s\)", h200)
    _shown(speed, c["ttft_speedup"]), _shown(t_dense, c["dense"]["ttft_s"]), _shown(t_kascade, c["kascade"]["ttft_s"])
    speed, i_dense, i_kascade = _find(r"decode ([\d.]+)x faster per token \(([\d.]+) -> ([\d.]+) ms\)", h200)
    _shown(speed, c["itl_speedup"])
    _shown(i_dense, 1e3 * c["dense"]["itl_s"]), _shown(i_kascade, 1e3 * c["kascade"]["itl_s"])
    (peak,) = _find(r"peak\s+memory \+([\d.]+)%", h200)
    _shown(peak, 100 * (c["peak_ratio"] - 1))
    dec, pre = _find(r"decode ([\d.]+)x faster at batch 32, prefill ([\d.]+)x faster than cuDNN", h200)
    _shown(dec, _decode(32, 131072)["model"]), _shown(pre, _prefill(1, 131072)["model"])
    c = _bench(h100)[1]
    ttft, itl = _find(r"time to first token ([\d.]+)x, decode ([\d.]+)x per token", h100)
    _shown(ttft, c["ttft_speedup"]), _shown(itl, c["itl_speedup"])
    dec, pre = _find(r"attention per model ([\d.]+)x \(decode, batch 32\) and ([\d.]+)x \(prefill\)", h100)
    _shown(dec, _decode(32, 131072, card="H100")["model"]), _shown(pre, _prefill(1, 131072, card="H100")["model"])


@pytest.mark.parametrize("card", ["H100", "H200"])
def test_speed_table(card):
    rows = re.findall(r"^\| (decode|prefill), B=(\d+), N=(\d+K) \| ([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x faster \|",
                      _speed(card), flags=re.M)
    assert len(rows) == 9, rows
    for mode, B, N, reuse, anchor, model in rows:
        got = (_decode if mode == "decode" else _prefill)(int(B), SIZES[N], card=card)
        for text, key in ((reuse, "reuse"), (anchor, "anchor"), (model, "model")):
            _shown(text, got[key])


@pytest.mark.parametrize("card", ["H100", "H200"])
def test_default_model_sentences(card):
    part = _speed(card)
    (smol_dec,) = _find(r"decode at B=8, 32K (?:is\s+)?([\d.]+)x faster per model", part)
    _shown(smol_dec, _decode(8, 32768, HQ=9, card=card)["model"])
    p32, p128 = _find(r"prefill ([\d.]+)x at 32K\s+and ([\d.]+)x at 128K", part)
    _shown(p32, _prefill(1, 32768, "smollm2-135m", card)["model"])
    _shown(p128, _prefill(1, 131072, "smollm2-135m", card)["model"])


def test_speed_section_sentences():
    speed = README[README.index("## Speed"):]
    lo, hi = _find(r"measured ([\d.]+)-([\d.]+) MB at B=1 and 4", speed)
    mb = [r["anchor_extra_mb"] for name in SCRATCH for r in _rows(name)]
    _shown(lo, min(mb)), _shown(hi, max(mb))
    assert {r["B"] for name in SCRATCH for r in _rows(name)} == {1, 4}
    c = _bench(_speed("H100"))
    ttft, itl1 = _find(r"TTFT ([\d.]+)x and ITL ([\d.]+)x at batch 1, 128K", _speed("H100"))
    _shown(ttft, c[1]["ttft_speedup"]), _shown(itl1, c[1]["itl_speedup"])
    assert c[2]["status"] == "skipped"  # "batch 2 at 128K does not fit its 80 GB"
    whole = speed[speed.index("Whole model on the H200"):]
    c = _bench(whole)
    ttft, itl1, itl2 = _find(r"first token ([\d.]+)x at batch 1.*?inter-token latency ([\d.]+)x at batch 1.*?"
                             r"and ([\d.]+)x at batch 2", whole)
    _shown(ttft, c[1]["ttft_speedup"]), _shown(itl1, c[1]["itl_speedup"]), _shown(itl2, c[2]["itl_speedup"])


@pytest.mark.parametrize("text,value,ok", [("1.71", 1.7099, True), ("1.7", 1.74, True), ("1.71", 1.716, False),
                                           ("4", 4.6, False)])
def test_shown_compares_at_the_digits_printed(text, value, ok):
    if ok:
        _shown(text, value)
    else:
        with pytest.raises(AssertionError):
            _shown(text, value)


def _heldout():
    """Mean agreement / KL per strategy of docs/eval/heldout_8k (windows of equal length: the pooled values)."""
    rows = [json.loads(line) for line in (ROOT / "docs/eval/heldout_8k/rows.jsonl").read_text().splitlines()]
    out = {}
    for name in {r["strategy"] for r in rows}:
        mine = [r for r in rows if r["strategy"] == name]
        assert len(mine) == 5 and {r["length"] for r in mine} == {8192}
        out[name] = (sum(r["agreement"] for r in mine) / 5, sum(r["kl"] for r in mine) / 5)
    return out


def test_accuracy_headline_compares_on_the_same_windows():
    """The headline's four strategies come from one run on the same five windows (docs/eval/heldout_8k)."""
    head = README[README.index("On the embedded SmolLM2"):README.index("The project's targets")]
    got = _heldout()
    agree, kl, f_agree, f_kl, s_agree, q_agree = _find(
        r"\(([\d.]+), KL ([\d.]+); on the same windows at the same\s+measured budget the paper's plan ([\d.]+) / ([\d.]+), "
        r"StreamingLLM ([\d.]+), Quest ([\d.]+);", head)
    _shown(agree, got["kascade"][0]), _shown(kl, got["kascade"][1])
    _shown(f_agree, got["kascade-faithful"][0]), _shown(f_kl, got["kascade-faithful"][1])
    _shown(s_agree, got["streamingllm"][0]), _shown(q_agree, got["quest"][0])
    assert "heldout_8k" in head
