"""Kascade under torch.compile: a decode step over a static cache traces into one graph (fullgraph, no graph break,
no recompilation as the cache grows) whose attention is Kascade's custom ops, computing what eager mode computes;
and transformers' ``generate`` with a static cache and its compile config produces the tokens of eager Kascade
(greedy, sampling with a seed, beam search, a left-padded batch), its prefill running Kascade's prefill kernels.

CI compiles with ``backend="aot_eager"`` (the graph as the compiler sees it, without code generation) and, once,
with inductor; the Triton backend runs in the interpreter on the CPU. With KASCADE_TEST_DEVICE=cuda the same tests
run on the GPU, plus ``mode="reduce-overhead"`` (a CUDA graph per step)."""

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint
from kascade.models import cache_kwargs
from kernel_checks import dev

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan",
                                        "ignore:.*past_key_values.*:FutureWarning")

CUDA = dev(torch.zeros(())).device.type == "cuda"


def _model(head_dim=8, layers=4):
    model = dev(tiny_model("llama", head_dim=head_dim, num_hidden_layers=layers))
    fp = ModelFingerprint.from_model(model)
    # layer 0, a reuse layer through a non-identity head map, an anchor, a reuse layer; decode keeps k(N) = 12 of
    # ~80 keys, prefill tiles select min(s, 4) earlier keys
    head_map = ((0, 1),) * layers
    head_map = head_map[:1] + ((1, 0),) + head_map[2:]
    return model, KascadePlan(fp, (0, 2), head_map, ratio=0.1, k_min=12, tile=8)


def _ids(B, P, seed=0):
    return dev(torch.randint(3, 97, (B, P), generator=torch.Generator().manual_seed(seed)))


class _Graphs:
    """A torch.compile backend that keeps every graph it is given, then runs it as aot_eager would."""

    def __init__(self, then="aot_eager"):
        self.graphs, self.then = [], then

    def __call__(self, gm, inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.then)(gm, inputs)

    def ops(self):
        return sorted({str(n.target) for g in self.graphs for n in g.graph.nodes
                       if n.op == "call_function" and str(n.target).startswith("kascade.")})


def _decode_steps(model, forward, ids, steps, capacity, mask=None):
    """Prefill ``ids`` into a static cache (eagerly, as generate does), then ``steps`` greedy steps through
    ``forward``: ``(tokens [B, steps], logits of every step)``."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=capacity)
    kw = cache_kwargs(model, cache)
    full = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], capacity - mask.shape[1])], 1)
    out = model(input_ids=ids, use_cache=True, attention_mask=mask, **kw)
    nxt = out.logits[:, -1:].argmax(-1)
    tokens, logits = [], []
    for _ in range(steps):
        out = forward(input_ids=nxt, use_cache=True, attention_mask=full, **kw)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
        tokens.append(nxt)
    return torch.cat(tokens, 1), logits


# the Triton backend's decode steps in the interpreter take a minute: on the CPU the generate test below covers them
@pytest.mark.parametrize("backend", ["reference", "triton"] if CUDA else ["reference"])
def test_a_decode_step_compiles_into_one_graph_of_kascade_ops(backend):
    """fullgraph=True (a graph break would raise), one graph for every step (the cache position is a tensor: no
    recompilation as it grows), Kascade's ops as nodes of it, and the eager step's logits."""
    import torch._dynamo

    model, plan = _model(head_dim=16)
    ids = _ids(2, 45)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the mask covers the static cache's every slot
    torch._dynamo.reset()
    graphs = _Graphs()
    compiled = torch.compile(model.forward, fullgraph=True, backend=graphs)
    with torch.no_grad(), kascade.enable(model, plan, backend=backend):
        want, want_logits = _decode_steps(model, model.forward, ids, 5, 60, mask)
        got, got_logits = _decode_steps(model, compiled, ids, 5, 60, mask)
    assert len(graphs.graphs) == 1  # one trace served all five steps
    assert graphs.ops() == ["kascade.dense_select_decode.default", "kascade.select_decode.default",
                            "kascade.sparse_decode.default"]
    assert torch.equal(got, want)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_compiled_decode_step_has_no_graph_break():
    """torch._dynamo.explain of a decode step (without fullgraph, where a break would split the graph instead of
    raising): one graph, zero breaks."""
    import torch._dynamo
    from transformers import StaticCache

    model, plan = _model()
    ids = _ids(1, 40)
    with torch.no_grad(), kascade.enable(model, plan):
        cache = StaticCache(config=model.config, max_cache_len=48)
        kw = cache_kwargs(model, cache)
        model(input_ids=ids, use_cache=True, **kw)
        torch._dynamo.reset()
        report = torch._dynamo.explain(model.forward)(input_ids=ids[:, :1], use_cache=True, **kw)
    assert report.graph_break_count == 0, report.break_reasons
    assert report.graph_count == 1


def _generate(model, ids, mask, compile_backend, seed=0, new=6, **gen):
    """generate with a static cache, compiled (transformers' compile config, forced on for the CPU) or eager."""
    from transformers import CompileConfig

    if compile_backend is None:
        extra = dict(disable_compile=True)
    else:
        cc = CompileConfig(fullgraph=True, backend=compile_backend, mode=None)
        cc._compile_all_devices = True  # transformers compiles on GPUs by itself, on a CPU only when told to
        extra = dict(compile_config=cc)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          cache_implementation="static", **extra, **gen)


def test_compiled_generate_gives_eager_kascades_tokens():
    """Greedy, sampling with a fixed seed and beam search on a left-padded batch: the tokens of eager Kascade with
    the same plan (the reference backend), which differ from the dense model's. Greedy and sampling decode through
    one compiled graph; transformers' beam search (5.25) calls the model's forward uncompiled whatever the compile
    config says, so there the check is that asking for compilation changes nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, plan = _model()
    ids = _ids(2, 48, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        dense = _generate(model, ids, mask, None)
        with kascade.enable(model, plan):
            for gen in (dict(do_sample=False), dict(do_sample=True, top_k=20, seed=7),
                        dict(do_sample=False, num_beams=3)):
                want = _generate(model, ids, mask, None, **gen)
                got = _generate(model, ids, mask, "aot_eager", **gen)
                assert torch.equal(got, want), gen
            assert counters["stats"]["unique_graphs"] == 1  # greedy compiled the step, sampling reused it
            assert not torch.equal(want[:, 48:], dense[:, 48:])  # Kascade decoded, not the model's own attention


@pytest.mark.skipif(CUDA, reason="the CPU's interpreter run; on a GPU test_reduce_overhead_captures_a_cuda_graph")
def test_compiled_generate_on_the_triton_backend_keeps_the_prefill_kernels(monkeypatch):
    """The Triton backend (the interpreter): compiled generate gives eager generate's tokens, its prefill runs the
    prefill kernels (no fallback to the reference) and its decode steps the decode kernels inside the graph."""
    pytest.importorskip("triton")
    import torch._dynamo
    from kascade.ops.triton import decode, prefill

    model, plan = _model(head_dim=16)
    ids = _ids(2, 30, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = []
    for mod, names in ((prefill, ("dense_select_prefill", "select_prefill", "sparse_prefill")),
                       (decode, ("dense_select_decode_indices", "select_decode_indices", "sparse_decode"))):
        for name in names:
            orig = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    torch._dynamo.reset()
    with torch.no_grad(), kascade.enable(model, plan, backend="triton"):
        want = _generate(model, ids, mask, None, new=4)
        calls.clear()
        got = _generate(model, ids, mask, "aot_eager", new=4)
    assert torch.equal(got, want)
    # prefill: layer 0 (its selection inside), anchor 2, and three sparse layers; then 3 decode steps of 2 anchors
    # and 3 sparse layers (the first token comes from the prefill)
    assert calls.count("dense_select_prefill") == 1 and calls.count("sparse_prefill") == 3
    assert calls.count("dense_select_decode_indices") == 3 and calls.count("sparse_decode") == 9


def test_inductor_compiles_a_kascade_decode_step():
    """The default compiler (inductor, C++ on the CPU) on a two-anchor model of three layers: the eager tokens."""
    import torch._dynamo

    model, plan = _model(layers=3)
    ids = _ids(1, 40, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad(), kascade.enable(model, plan):
        want, want_logits = _decode_steps(model, model.forward, ids, 3, 48)
        got, got_logits = _decode_steps(model, compiled, ids, 3, 48)
    assert torch.equal(got, want)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: KASCADE_TEST_DEVICE=cuda only")
def test_reduce_overhead_captures_a_cuda_graph():
    """``mode="reduce-overhead"`` on the Triton backend: the decode steps run from a CUDA graph (no step skipped
    for a CPU tensor, a host read or a mutated input) and give eager generate's tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, plan = _model(head_dim=16)
    ids = _ids(2, 70, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), kascade.enable(model, plan, backend="triton"):
        want = _generate(model, ids, mask, None)
        torch.manual_seed(0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                             cache_implementation="static",
                             compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert torch.equal(got, want)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
