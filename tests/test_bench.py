"""`kascade bench` on a tiny random Llama (CPU, reference backend): structure of the results, not speed."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from conftest import tiny_model
from kascade import bench
from kascade.bench import memory, models, runner, timing
from kascade.bench.settings import Settings
from kascade.cli import build_parser, main
from kascade.integration.hf import attach, enable
from kascade.integration.runtime import NoAttention
from kascade.plan import KascadePlan, ModelFingerprint

FAST = ["--models", "tiny", "--backend", "reference", "--repeats", "1", "--decode-steps", "2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model's ops are too small to share among threads; on a busy machine the spinning costs ~20x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny():
    return models.random_llama(models.TINY, device="cpu", dtype=torch.float32, max_positions=1024)


def test_the_names_other_code_uses_are_importable_from_the_package():
    """kascade.cli imports MODELS and Settings and calls main_args; benchmarks/e2e_check.py uses the rest."""
    from kascade.bench import LLAMA8B, MODELS, Settings, decode, main_args, prefill, random_llama  # noqa: F401

    assert MODELS == ("default", "llama8b", "tiny") and bench.run is runner.run and bench.Settings is Settings


def test_bench_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    for opt in ("--models", "--lengths", "--batches", "--repeats", "--decode-steps", "--prefill-chunk", "--backend",
                "--plan", "--seed", "--memory-limit", "--time-budget", "--out", "--model", "--device",
                "TTFT", "ITL", "attention share", "llama8b", "tiny", "8K"):
        assert opt in out, opt


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", *FAST, "--lengths", "96", "160", "--batches", "1", "2", "--out", str(out)])
    assert rc == 0
    return out, json.loads((out / "bench.json").read_text())


def test_every_configuration_is_measured(tiny_run):
    _, r = tiny_run
    assert [(c["model"], c["batch"], c["length"]) for c in r["configs"]] == [
        ("tiny", 1, 96), ("tiny", 1, 160), ("tiny", 2, 96), ("tiny", 2, 160)]
    for c in r["configs"]:
        assert c["status"] == "ok", c.get("reason")
        for mode in ("dense", "kascade", "noattn"):
            assert c[mode]["ttft_s"] > 0 and c[mode]["itl_s"] > 0
            assert len(c[mode]["first_token"]) == c["batch"]
        assert c["kascade"]["backend"] == "reference"
        assert c["ttft_speedup"] == pytest.approx(c["dense"]["ttft_s"] / c["kascade"]["ttft_s"])
        assert c["itl_speedup"] == pytest.approx(c["dense"]["itl_s"] / c["kascade"]["itl_s"])
        for phase, key in (("prefill", "ttft_s"), ("decode", "itl_s")):
            share = c[f"attn_share_{phase}"]
            assert share == pytest.approx(1 - c["noattn"][key] / c["dense"][key])
            # no bound below: on a loaded 2-core CPU a tiny model's attention is within timing noise (the no-op
            # is checked by the logits below and by test_no_attention_returns_zeros_and_restores)
            assert share < 1.0
        assert c["noattn_logits_max_diff"] > 1e-3  # the zero attention really replaced the model's
    env = r["environment"]
    assert env["torch"] == torch.__version__ and env["transformers"] == transformers.__version__
    assert r["settings"]["lengths"] == [96, 160] and r["settings"]["backend"] == "reference"


def test_kascade_really_ran(tiny_run):
    """At N = 96 the budget keeps every key (k_min 128): dense-equal; at 160 it does not, so the logits move."""
    _, r = tiny_run
    by = {(c["batch"], c["length"]): c for c in r["configs"]}
    assert by[1, 96]["kascade_logits_max_diff"] < 1e-4
    assert by[1, 160]["kascade_logits_max_diff"] > 1e-6


def test_table_and_plot_are_written(tiny_run, capsys):
    out, _ = tiny_run
    md = (out / "bench.md").read_text()
    assert md.count("| tiny |") == 4 and "TTFT dense s" in md and "torch " + torch.__version__ in md
    assert (out / "bench.png").stat().st_size > 5000


def test_a_cpu_table_says_its_timings_are_noise_and_a_negative_share_is_shown_as_such(tiny_run):
    """On a CPU, identical runs gave speedups of 0.5-5.5x and negative attention shares, printed without a word."""
    import copy

    from kascade.bench import report

    _, r = tiny_run
    r = copy.deepcopy(r)
    r["configs"][0]["attn_share_decode"] = -0.31
    md = report.table(r)
    assert "measured on a CPU" in md and "not what Kascade gains" in md
    assert "<0 (noise)" in md and "-0.31" not in md
    r["environment"]["gpu"] = "NVIDIA H100 80GB HBM3"
    assert "measured on a CPU" not in report.table(r)


def test_measure_config_restores_the_model():
    model = _tiny()
    plan = models.plan_for("tiny", model, None)
    ids = timing.prompt(1, 64, 256, 0, "cpu")
    with torch.no_grad():
        before = model(ids).logits
    s = bench.Settings(lengths=(64,), batches=(1,), decode_steps=2, backend="reference")
    r = timing.measure_config(model, plan, batch=1, length=64, settings=s)
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model, "_kascade_handle", None) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert r["noattn_logits_max_diff"] > 1e-3


def test_no_attention_mode_returns_zeros_and_registers_nothing(monkeypatch):
    """The no-attention mode is the NoAttention runtime attached for its measurement: the attention outputs are
    zeros, no attention function of its own is registered in transformers, and the model is restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model = _tiny()
    registered = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
    seen = []
    real = timing.measure_mode

    def measure_mode(model, ids, settings, *, warmup):
        handle = getattr(model, "_kascade_handle", None)
        if handle is None or not isinstance(handle.runtime, NoAttention):
            return real(model, ids, settings, warmup=warmup)
        hook = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, o: seen.append(a[0]))
        try:
            return real(model, ids, settings, warmup=warmup)
        finally:
            hook.remove()

    monkeypatch.setattr(timing, "measure_mode", measure_mode)
    s = bench.Settings(lengths=(40,), batches=(1,), decode_steps=1, warmup_decode_steps=0, backend="reference")
    timing.measure_config(model, models.plan_for("tiny", model, None), batch=1, length=40, settings=s)
    assert len(seen) == 2 and seen[0].shape == (1, 40, 64)  # the prefill and the decode step
    assert all(torch.count_nonzero(x) == 0 for x in seen)
    assert model.config._attn_implementation == "sdpa" and getattr(model, "_kascade_handle", None) is None
    assert set(AttentionInterface._global_mapping) - registered[0] <= {"kascade"}
    assert set(AttentionMaskInterface._global_mapping) - registered[1] <= {"kascade"}


def test_without_matplotlib_only_the_chart_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    s = bench.Settings(lengths=(64,), batches=(1,), decode_steps=1, backend="reference", time_budget_s=None)
    r = bench.run(["tiny"], s, tmp_path)
    assert r["configs"][0]["status"] == "ok"
    assert sorted(Path(f).name for f in r["files"]) == ["bench.json", "bench.md"]
    assert not (tmp_path / "bench.png").exists() and "| tiny | 1 | 64 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_out_that_cannot_take_files_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch, capsys, where):
    f = tmp_path / "results"
    f.write_text("not a folder")
    out = f if where == "file" else f / "bench"
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = main(["bench", *FAST, "--lengths", "64", "--batches", "1", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err
    assert ("is a file, not a folder" if where == "file" else "cannot write the results there") in err
    assert f.read_text() == "not a folder"


def test_an_out_in_use_by_another_run_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch, capsys):
    from kascade.files import hold

    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with hold(tmp_path, "kascade bench"):
        rc = main(["bench", *FAST, "--lengths", "64", "--batches", "1", "--out", str(tmp_path)])
    assert rc == 2
    assert f"--out {tmp_path} is in use by kascade bench (process " in capsys.readouterr().err


def test_a_read_only_out_is_refused(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        try:
            (out / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("this user writes into read-only folders (root)")
        s = bench.Settings(lengths=(64,), batches=(1,), decode_steps=1, backend="reference")
        with pytest.raises(ValueError, match="cannot write the results there"):
            bench.run(["tiny"], s, out)
    finally:
        out.chmod(0o755)


def test_skipped_configurations_carry_a_reason(tmp_path, monkeypatch):
    rc = main(["bench", *FAST, "--lengths", "64", "--batches", "1", "--memory-limit", "0.01",
               "--out", str(tmp_path / "m")])
    assert rc == 0
    (c,) = json.loads((tmp_path / "m" / "bench.json").read_text())["configs"]
    assert c["status"] == "skipped" and c["reason"].startswith("needs ~") and "GB free" in c["reason"]
    assert "skipped: needs ~" in (tmp_path / "m" / "bench.md").read_text()

    real = memory.predict_seconds
    monkeypatch.setattr(runner, "predict_seconds",
                        lambda done, b, n, s: None if not done else 1e4 + real(done, b, n, s))
    rc = main(["bench", *FAST, "--lengths", "64", "128", "--batches", "1", "--time-budget", "3600",
               "--out", str(tmp_path / "t")])
    assert rc == 0
    a, b = json.loads((tmp_path / "t" / "bench.json").read_text())["configs"]
    assert a["status"] == "ok"  # nothing to predict from yet
    assert b["status"] == "skipped" and "s left of --time-budget" in b["reason"] and b["predicted_s"] > 1e4

    s = bench.Settings(lengths=(64,), batches=(1,), decode_steps=1, backend="reference", time_budget_s=1e-9)
    (c,) = bench.run(["tiny"], s, tmp_path / "z")["configs"]
    assert c["status"] == "skipped" and "before this model was loaded" in c["reason"]


def test_chunked_prefill_fills_the_same_cache():
    model = _tiny()
    ids = timing.prompt(2, 100, 256, 1, "cpu")
    whole, n1, l1, _ = timing.prefill(model, ids, 0)
    chunked, n2, l2, _ = timing.prefill(model, ids, 32)
    assert chunked.get_seq_length() == whole.get_seq_length() == 100
    assert torch.equal(n1, n2)
    torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)


def test_memory_estimate_for_llama8b_on_an_h200():
    """The defaults' Llama-3.1-8B configurations: B=1 fits everywhere, B=8 at 128K never, B=8 at 64K only chunked."""
    cfg = transformers.LlamaConfig(**models.LLAMA8B, max_position_embeddings=131072)
    plan = KascadePlan.uniform(ModelFingerprint.from_config(cfg), 5)
    weights = 2 * 8_030_261_248  # bf16 parameters

    def gb(batch, length, chunk=0):
        s = bench.Settings(device="cuda", prefill_chunk=chunk)
        e = memory.estimate_bytes(cfg, plan, weights=weights, batch=batch, length=length, settings=s)
        return e["total"] / 2**30

    h200 = 139
    assert gb(1, 131072) < h200 and gb(8, 32768) < h200
    assert gb(8, 131072, 8192) > h200 and gb(8, 65536) > h200 > gb(8, 65536, 8192)
    e = memory.estimate_bytes(cfg, plan, weights=weights, batch=1, length=1000, settings=bench.Settings(device="cuda"))
    # graph decoding (the default on CUDA): a static cache for the prompt, 2 + 16 steps and two spare slots
    assert e["kv_cache"] == 1 * (1000 + 2 + 16 + 2) * 32 * 2 * 8 * 128 * 2 and e["cache_growth"] == 0


def test_memory_estimate_counts_what_chunked_dense_prefill_adds():
    """Llama-3.1-8B, B=4, 128K in chunks of 32K ran out of memory on an H200 (~139 GiB) where the estimate said it
    fit: it left out what the chunks after the first add (here by hand). Now the configuration is skipped."""
    cfg = transformers.LlamaConfig(**models.LLAMA8B, max_position_embeddings=131072)
    plan = KascadePlan.uniform(ModelFingerprint.from_config(cfg), 5)
    s = bench.Settings(device="cuda", prefill_chunk=32768)
    assert s.decode == "eager" and s.warmup_decode_steps == 16
    B, L, C, bf16 = 4, 131072, 32768, 2
    e = memory.estimate_bytes(cfg, plan, weights=2 * 8_030_261_248, batch=B, length=L, settings=s)
    layer_kv = B * (L + 16 + 16) * 2 * 8 * 128 * bf16
    assert e["kv_cache"] == 32 * layer_kv
    assert e["cache_growth"] == layer_kv  # DynamicCache: torch.cat next to the previous K and V of a layer
    bool_mask = B * C * L  # transformers' [B, 1, chunk, N] mask
    additive = B * C * L * bf16  # SDPA's additive copy of it in the model's dtype (N is a multiple of 16)
    repeat_kv = 2 * B * 32 * L * 128 * bf16  # K and V repeated to the 32 query heads
    assert e["dense"] == bool_mask + additive + repeat_kv
    assert e["dense"] > e["kascade"] and e["counted"] == sum(
        e[k] for k in ("weights", "kv_cache", "cache_growth", "activations", "logits", "dense"))
    assert e["total"] / 2**30 > 139


def _peak_bytes(fn) -> int:
    """Most bytes held at once by tensors that ``fn`` allocated on the CPU (the profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    assert events and peak > 0
    return peak


@pytest.mark.parametrize("batch, length, chunk", [(2, 300, 0), (2, 300, 64), (1, 1000, 256)],
                         ids=["B2-L300-whole", "B2-L300-C64", "B1-L1000-C256"])
def test_memory_estimate_bounds_what_each_mode_allocates(batch, length, chunk):
    """Each mode's measured allocations (prefill, decode steps) stay under what every mode holds plus that mode's
    own term: the tiny model on the CPU, where the profiler sees every tensor (the reference backend, SDPA with an
    explicit mask for the later chunks)."""
    model = _tiny()
    plan = models.plan_for("tiny", model, None)
    s = bench.Settings(lengths=(length,), batches=(batch,), decode_steps=2, warmup_decode_steps=2,
                       prefill_chunk=chunk, backend="reference")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    e = memory.estimate_bytes(model.config, plan, weights=weights, batch=batch, length=length, settings=s)
    shared = e["kv_cache"] + e["cache_growth"] + e["activations"] + e["logits"]  # the weights are already there
    ids = timing.prompt(batch, length, 256, 0, "cpu")
    measured = {"dense": _peak_bytes(lambda: timing.measure_mode(model, ids, s, warmup=False))}
    with enable(model, plan, backend="reference", warn_uncalibrated=False):
        measured["kascade"] = _peak_bytes(lambda: timing.measure_mode(model, ids, s, warmup=False))
    with attach(model, NoAttention()):
        measured["noattn"] = _peak_bytes(lambda: timing.measure_mode(model, ids, s, warmup=False))
    for mode, got in measured.items():
        assert got > e["kv_cache"], mode  # the measurement saw the cache at least
        assert got <= shared + e[mode], (mode, got, shared, e[mode])
    assert e["total"] > e["counted"] >= weights + shared + max(e["dense"], e["kascade"], e["noattn"])


def test_random_llama_is_built_in_the_requested_dtype():
    model = models.random_llama(models.TINY, device="cpu", dtype=torch.bfloat16, max_positions=4096)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies are not rounded to bf16
    assert model.config.max_position_embeddings == 4096 and torch.get_default_dtype() == torch.float32


def test_predicted_time_is_an_upper_bound_shape():
    done = [dict(batch=1, length=1000, wall_s=2.0)]
    assert memory.predict_seconds([], 1, 1000) is None
    assert memory.predict_seconds(done, 1, 2000) == pytest.approx(8.0)
    assert memory.predict_seconds(done, 8, 500) == pytest.approx(8.0)


def test_predicted_time_scales_the_timed_work_and_counts_compilation_once():
    """By hand: 1 repeat, 16 + 2 (warm-up) + 2 decode steps per mode; prefills: dense 2 x 1.0 s, Kascade 2 x 0.8 s,
    no-attention 1 x 0.5 s = 4.1 s; decode 20 x (10 + 10 + 5) ms = 0.5 s; the other 15.4 s of the 20 s wall time
    (compilation, capture) once. 4x the length at attention share 0.5: prefills x (0.5 * 4 + 0.5 * 16) = x10, decode
    x4. Half the length at 8x the batch: prefills x0.5 (linear at worst), decode steps not cheaper, all x8. (The
    bound from the wall time alone would be 320 s for the first.)"""
    s = Settings(repeats=1, decode_steps=16, warmup_decode_steps=2)
    done = [dict(batch=1, length=1000, wall_s=20.0, attn_share_prefill=0.5, dense=dict(ttft_s=1.0, itl_s=0.01),
                 kascade=dict(ttft_s=0.8, itl_s=0.01), noattn=dict(ttft_s=0.5, itl_s=0.005))]
    assert memory.predict_seconds(done, 1, 4000, s) == pytest.approx(15.4 + 41.0 + 2.0)
    assert memory.predict_seconds(done, 8, 500, s) == pytest.approx(15.4 + 8 * (4.1 * 0.5 + 0.5))
    assert memory.predict_seconds(done, 1, 4000) == pytest.approx(320.0)  # no settings: the wall-time bound


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt5"], "unknown model"),
    (["--lengths", "0"], "length must be a positive integer"),
    (["--batches", "-2"], "batch size must be a positive integer"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", *argv])
    assert message in capsys.readouterr().err


def test_a_plan_for_another_model_is_refused(tmp_path, capsys):
    other = KascadePlan.uniform(ModelFingerprint("llama", 30, 9, 3, 64), 6)
    other.save(tmp_path / "plan.json")
    rc = main(["bench", *FAST, "--lengths", "64", "--batches", "1", "--plan", str(tmp_path / "plan.json"),
               "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "another model" in err and "num_layers: plan has 30, model has 4" in err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefill_chunk"):
        bench.Settings(prefill_chunk=-1)
    with pytest.raises(ValueError, match="lengths"):
        bench.Settings(lengths=())


def test_out_of_memory_is_recorded_per_configuration(tmp_path, monkeypatch):
    real = timing.measure_mode

    def measure_mode(model, ids, settings, *, warmup):
        if getattr(model, "_kascade_handle", None) is not None and ids.shape[1] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 GiB")
        return real(model, ids, settings, warmup=warmup)

    monkeypatch.setattr(timing, "measure_mode", measure_mode)
    s = bench.Settings(lengths=(64, 96), batches=(1,), decode_steps=1, backend="reference", time_budget_s=None)
    r = bench.run(["tiny"], s, tmp_path)
    a, b = r["configs"]
    assert a["status"] == "oom" and "Tried to allocate 42.00 GiB" in a["reason"] and "['dense']" in a["reason"]
    assert a["partial"]["dense"]["ttft_s"] > 0 and "kascade" not in a["partial"]
    assert b["status"] == "ok"  # the run went on, Kascade disabled again after the failure
    assert "| tiny | 1 | 64 | oom:" in (tmp_path / "bench.md").read_text()


def test_decode_mode_settings_are_checked():
    assert bench.Settings(device="cpu").decode == "eager"
    assert bench.Settings(device="cpu").warmup_decode_steps == 16  # eager: kernels specialise on N % 16
    assert bench.Settings(device="cuda").decode == "graph"
    assert bench.Settings(device="cuda").warmup_decode_steps == 2
    assert bench.Settings(device="cuda", prefill_chunk=8192).decode == "eager"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        bench.Settings(device="cpu", decode="graph")
    with pytest.raises(ValueError, match="needs --decode eager"):
        bench.Settings(device="cuda", decode="graph", prefill_chunk=8192)
    with pytest.raises(ValueError, match="'graph' or 'eager'"):
        bench.Settings(device="cpu", decode="lazy")


def test_triton_backend_off_cuda_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = main(["bench", *FAST, "--backend", "triton", "--models", "tiny", "--out", str(tmp_path / "o")])
    assert rc == 2 and "backend 'triton' runs the Triton kernels on a CUDA device" in capsys.readouterr().err


def test_a_plan_for_another_default_model_is_refused_from_its_config(tmp_path, monkeypatch, capsys):
    """--models default --plan P: the plan is checked against the model's config, read without its weights (the
    default model's were loaded first, ~20 s, before the refusal)."""
    folder = tmp_path / "m"
    tiny_model("llama").config.save_pretrained(folder)  # a config, no weights: loading them would fail
    other = KascadePlan.uniform(ModelFingerprint("llama", 30, 9, 3, 64), 6)
    other.save(tmp_path / "plan.json")
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = main(["bench", *FAST, "--models", "default", "--model", str(folder), "--plan", str(tmp_path / "plan.json"),
               "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "another model than 'default'" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_an_out_made_and_then_found_unwritable_is_not_left_behind(tmp_path, monkeypatch):
    """check_out makes the missing folders, then probes them with a file; when the probe fails (a full disk, a
    mount that takes folders but no files) the folders it made used to stay behind, empty."""
    import tempfile

    from kascade import files

    def no_files(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_files)
    with pytest.raises(ValueError, match="cannot write the results there"):
        with files.output_folder(tmp_path / "new" / "deeper" / "out", "kascade bench"):
            pytest.fail("the folder was held")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(ValueError, match="cannot write the results there"):
        with files.output_folder(kept / "out", "kascade bench"):
            pytest.fail("the folder was held")
    assert kept.is_dir() and not (kept / "out").exists()


def test_a_shipped_plan_named_for_a_model_without_it_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = main(["bench", *FAST, "--plan", "faithful", "--out", str(tmp_path / "o")])
    assert rc == 2 and "no shipped 'faithful' plan for this model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_decode_through_generate_eager_and_compiled(tmp_path):
    """--decode-modes eager,compiled: dense and Kascade each timed through generate in both modes in the same run
    (compiled: a static cache and torch.compile, aot_eager on the CPU), in a table naming each row's mode."""
    rc = main(["bench", *FAST, "--lengths", "64", "--batches", "1", "--decode-modes", "eager,compiled",
               "--compile-backend", "aot_eager", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["settings"]["generate"] == ["eager", "compiled"] and r["settings"]["decode"] == "eager"
    (c,) = r["configs"]
    assert c["status"] == "ok" and c["generate_wall_s"] > 0
    for mode in ("eager", "compiled"):
        g = c["generate"][mode]
        for who in ("dense", "kascade"):
            assert g[who]["ttft_s"] > 0 and g[who]["itl_s"] > 0 and len(g[who]["first_token"]) == 1
        assert g["itl_speedup"] == pytest.approx(g["dense"]["itl_s"] / g["kascade"]["itl_s"])
        assert g["kascade"]["backend"] == "reference"
    md = (tmp_path / "bench.md").read_text()
    assert md.count("| tiny | 1 | 64 |") == 3  # the main row, then one per generate mode
    assert "| tiny | 1 | 64 | eager generate |" in md and "| tiny | 1 | 64 | compiled generate |" in md
    assert 'cache_implementation="static"' in md and "ITL: eager Python loop" in md


def test_step_clock_stamps_every_generated_token():
    model = _tiny()
    ids = timing.prompt(1, 20, 256, 0, "cpu")
    clock = timing.StepClock(torch.device("cpu"))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, stopping_criteria=[clock],
                             pad_token_id=0)
    assert out.shape[1] == 25 and len(clock.stamps) >= 5  # (and one more when transformers defers its stop check)
    assert 0 < clock.seconds(0, 4) and clock.seconds(1, 4) < clock.seconds(0, 4)


def test_decode_modes_map_onto_the_settings(capsys):
    assert runner.decode_modes(["eager", "compiled", "graph"], None) == ("graph", ("eager", "compiled"))
    assert runner.decode_modes(["compiled"], None) == ("eager", ("compiled",))
    assert runner.decode_modes(None, "graph") == ("graph", ())
    with pytest.raises(ValueError, match="not both"):
        runner.decode_modes(["eager"], "graph")
    with pytest.raises(ValueError, match="distinct ones"):
        bench.Settings(generate=("eager", "eager"))
    with pytest.raises(ValueError, match="distinct ones"):
        bench.Settings(generate=("graph",))
    with pytest.raises(ValueError, match="whole prompt at once"):
        bench.Settings(generate=("compiled",), prefill_chunk=1024)
    with pytest.raises(SystemExit):
        main(["bench", "--decode-modes", "lazy"])
    assert "unknown decode mode" in capsys.readouterr().err


def test_memory_estimate_counts_eager_generates_cache_growth():
    """Graph decoding alone keeps a static cache; eager generate (a DynamicCache) grows by torch.cat as well."""
    cfg = transformers.LlamaConfig(**models.LLAMA8B, max_position_embeddings=131072)
    plan = KascadePlan.uniform(ModelFingerprint.from_config(cfg), 5)
    kw = dict(weights=0, batch=1, length=1000)
    graph = memory.estimate_bytes(cfg, plan, settings=bench.Settings(device="cuda"), **kw)
    both = memory.estimate_bytes(cfg, plan, settings=bench.Settings(device="cuda", generate=("eager", "compiled")),
                                 **kw)
    assert graph["cache_growth"] == 0 and both["cache_growth"] > 0 and both["kv_cache"] == graph["kv_cache"]


def test_configs_pick_batch_and_length_pairs(tmp_path, capsys):
    """--configs 2x64 1x96: exactly those configurations (not every batch x length), by batch then length."""
    rc = main(["bench", *FAST, "--configs", "2x64", "1x96", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "bench.json").read_text())
    assert [(c["batch"], c["length"]) for c in r["configs"]] == [(1, 96), (2, 64)]
    assert all(c["status"] == "ok" for c in r["configs"])
    s = bench.Settings(pairs=[(1, 300), (4, 100)])
    assert s.lengths == (100, 300) and s.batches == (1, 4) and s.configurations() == [(1, 300), (4, 100)]
    with pytest.raises(SystemExit):
        main(["bench", "--configs", "1x"])
    assert "BATCHxLENGTH" in capsys.readouterr().err
