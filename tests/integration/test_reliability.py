"""What a careful user does with an enabled model, and what must then hold: concurrent forwards, static caches,
refusals before any work, nothing held after the block, inference only."""

import gc
import threading
import warnings
import weakref

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan")


def _ids(n, B=1, seed=0):
    return torch.randint(3, 97, (B, n), generator=torch.Generator().manual_seed(seed))


def _plan(model, **budget):
    b = {**dict(ratio=0.1, k_min=8, tile=16), **budget}
    return KascadePlan.uniform(ModelFingerprint.from_model(model), 2, **b)


def test_concurrent_forwards_on_one_enabled_model_are_each_correct():
    """Two threads share one enabled model: each forward keeps its own state (geometry, selections), so every
    result equals the same input run alone."""
    model = tiny_model("llama", num_hidden_layers=6)
    plan = _plan(model)
    inputs = [_ids(n, seed=n) for n in (150, 230, 90, 310)]
    with torch.no_grad(), kascade.enable(model, plan):
        want = [model(x).logits for x in inputs]
        got, errors = {}, []

        def work(t):
            try:
                for r in range(6):
                    i = (t + r) % len(inputs)
                    got[(t, r)] = (i, model(inputs[i]).logits)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert len(got) == 18
    for i, logits in got.values():
        assert torch.equal(logits, want[i])


def test_static_cache_generate_equals_dynamic_cache_generate():
    model = tiny_model("llama")
    ids = _ids(70, B=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad(), kascade.enable(model, _plan(model)):
        a = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        b = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
        from transformers import StaticCache

        c = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                           past_key_values=StaticCache(config=model.config, max_cache_len=96))
    assert torch.equal(a, b) and torch.equal(a, c)


def test_length_aware_plan_picks_its_sub_plan_from_the_sequence_not_the_cache_capacity():
    """A static cache's key axis is its capacity; the sub-plan must follow the tokens actually in the cache."""
    from transformers import StaticCache

    model = tiny_model("llama")
    fp = ModelFingerprint.from_model(model)
    long = _plan(model)
    short = KascadePlan(fp, (0, 1), ((0, 1),) * 4, ratio=0.1, k_min=8, tile=16)
    plan = long.__class__(**{**long.__dict__, "by_length": ((200, short),)})
    ids = _ids(120)
    with torch.no_grad(), kascade.enable(model, plan):
        dyn = model.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        sta = model.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                             past_key_values=StaticCache(config=model.config, max_cache_len=1024))
    with torch.no_grad(), kascade.enable(model, short):
        alone = model.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
    for x, y in ((dyn, sta), (dyn, alone)):
        assert torch.equal(x.sequences, y.sequences)
        for s, t in zip(x.scores, y.scores):
            torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-5)


def test_refused_right_padding_leaves_the_cache_untouched():
    """The padding check runs before any layer: a refused call changes nothing, and a retry works."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = _ids(40, B=2)
    right = torch.ones_like(ids)
    right[1, -5:] = 0
    left = torch.ones_like(ids)
    left[1, :5] = 0
    with torch.no_grad(), kascade.enable(model, _plan(model)):
        cache = DynamicCache()
        with pytest.raises(ValueError, match="left padding"):
            model(ids, attention_mask=right, past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 0
        out = model(ids, attention_mask=left, past_key_values=cache, use_cache=True).logits
        ref = model(ids, attention_mask=left).logits
    assert torch.equal(out, ref)


def test_static_cache_decode_step_refuses_a_mask_that_is_not_left_padding():
    """A static cache's decode step checks its mask like every other pass: a hole in it (a masked-out token
    mid-sequence) is refused, not ignored (it once was: the check was left to the prefill, and the step attended
    the masked tokens, a silent difference from dense attention). A left-padded mask then decodes as dense does."""
    from transformers import StaticCache

    model = tiny_model("llama")
    full = KascadePlan.uniform(ModelFingerprint.from_model(model), 4, ratio=1.0, k_min=1, tile=1)  # = dense
    ids, nxt = _ids(40), _ids(1, seed=5)
    hole = torch.ones(1, 41, dtype=torch.long)
    hole[0, 10:20] = 0
    left = torch.ones(1, 41, dtype=torch.long)
    left[0, :3] = 0

    def step(mask):  # the prompt prefilled unpadded (or left-padded), then one decode step under ``mask``
        cache = StaticCache(config=model.config, max_cache_len=64)
        model(ids, attention_mask=mask[:, :40].cummax(1).values, past_key_values=cache, cache_position=torch.arange(40))
        return model(nxt, attention_mask=mask, past_key_values=cache, cache_position=torch.tensor([40])).logits

    with torch.no_grad():
        want = step(left)
        with kascade.enable(model, full):
            with pytest.raises(ValueError, match="left padding"):
                step(hole)
            got = step(left)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_decode_steps_device_check_of_the_mask_is_the_host_check():
    """A decode step checks its mask on the device (:func:`_left_padded`: nothing read back until its flag is
    needed): for every mask of 6 slots and every query slot (past the mask's end too: the rest is valid), the flag
    says what the host check says."""
    import itertools

    from kascade.integration.functions import _left_padded, _left_padding_start

    rows = torch.tensor(list(itertools.product([0, 1], repeat=6)), dtype=torch.bool)
    for q in range(9):
        for row in rows:
            try:
                _left_padding_start(row[None], q + 1)
                ok = True
            except ValueError:
                ok = False
            assert bool(_left_padded(row[None], torch.tensor(q))) == ok, (row.tolist(), q)
    both = rows[[7, 40]]  # 000111 and 101000: one bad row refuses the batch
    assert bool(_left_padded(both[:1], torch.tensor(5))) and not bool(_left_padded(both, torch.tensor(5)))


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_gpu_decode_steps_mask_check_is_read_after_its_last_layer(cache, monkeypatch, op_calls):
    """On a GPU a decode step's padding check runs on the device and is read once the step's last layer is launched
    (the host does not wait for the device before the layers): made to behave so on the CPU, a hole in the mask is
    still refused in the same call, after every layer ran, and a left-padded mask decodes as at once."""
    from transformers import DynamicCache, StaticCache

    from kascade.integration import functions

    model = tiny_model("llama")
    ids, nxt = _ids(40), _ids(1, seed=5)
    hole = torch.ones(1, 41, dtype=torch.long)
    hole[0, 10:20] = 0
    left = torch.ones(1, 41, dtype=torch.long)
    left[0, :3] = 0

    def step(mask):
        c = StaticCache(config=model.config, max_cache_len=64) if cache == "static" else DynamicCache()
        model(ids, attention_mask=mask[:, :40].cummax(1).values, past_key_values=c)
        return model(nxt, attention_mask=mask, past_key_values=c).logits

    with torch.no_grad(), kascade.enable(model, _plan(model)):
        want = step(left)
        monkeypatch.setattr(functions, "DEFERRED_CHECK", ("cuda", "cpu"))
        op_calls.clear()
        with pytest.raises(ValueError, match="left padding"):
            step(hole)
        # the prefill's ops, then the refused step's: layer 0, a reuse layer, anchor 2 (select, sparse), a reuse layer
        names = ["dense_select", "sparse_attention", "select", "sparse_attention", "sparse_attention"]
        assert [n for n, *_ in op_calls] == names * 2
        assert torch.equal(step(left), want)


def test_eager_decode_steps_are_planned_on_the_device(forwards):
    """generate's decode steps over a dynamic cache (a left-padded batch) are planned on the device like a static
    cache's, so the host reads nothing back before their layers run; they generate what a static cache does."""
    model = tiny_model("llama")
    ids = _ids(70, B=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad(), kascade.enable(model, _plan(model)):
        dyn = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        steps = [fwd.step for fwd in forwards]
        sta = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache_implementation="static")
    assert [s.on_device for s in steps] == [False, True, True, True]
    assert torch.equal(dyn, sta)


def test_length_aware_plan_follows_the_batchs_longest_sequence():
    """The documented rule (docs/ARCHITECTURE.md, Semantics): a forward runs one sub-plan, chosen by its longest
    sequence, so a short sequence batched with a long one runs the long one's sub-plan; alone, its own."""
    model = tiny_model("llama")
    fp = ModelFingerprint.from_model(model)
    long_plan = _plan(model)
    short_plan = KascadePlan(fp, (0, 1), ((0, 1),) * 4, ratio=0.1, k_min=8, tile=16)
    plan = long_plan.__class__(**{**long_plan.__dict__, "by_length": ((100, short_plan),)})
    short, other = _ids(60, seed=1), _ids(150, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 90, dtype=torch.long), short], 1), other])
    mask = torch.ones_like(batch)
    mask[0, :90] = 0
    with torch.no_grad():
        with kascade.enable(model, plan):
            alone = model(short).logits[0]
            batched = model(batch, attention_mask=mask).logits[0, 90:]
        with kascade.enable(model, short_plan):
            want_alone = model(short).logits[0]
        with kascade.enable(model, long_plan):
            want_batched = model(batch, attention_mask=mask).logits[0, 90:]
    torch.testing.assert_close(alone, want_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, want_batched, rtol=1e-5, atol=1e-5)


def test_nested_enable_is_refused_and_disable_always_restores():
    model = tiny_model("llama")
    plan = _plan(model)
    with kascade.enable(model, plan):
        with pytest.raises(RuntimeError, match="already enabled"):
            kascade.enable(model.model, plan)
    with kascade.enable(model.model, plan):
        with pytest.raises(RuntimeError, match="already enabled on a model this one contains"):
            kascade.enable(model, plan)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_kascade_runtime") for m in model.modules())
    with torch.no_grad(), kascade.enable(model, plan):  # usable again
        model(_ids(30))


def test_a_handle_entered_again_runs_kascade_again():
    """``h = enable(m, plan)``; ``with h:`` twice: the second block ran plain dense attention, silently."""
    model = tiny_model("llama")
    ids = _ids(200)
    with torch.no_grad():
        dense = model(ids).logits
        h = kascade.enable(model, _plan(model))
        with h:
            first = model(ids).logits
        assert not torch.allclose(first, dense, atol=1e-3), "the plan must change the output for this test"
        assert torch.equal(model(ids).logits, dense)
        with h:
            assert h.active and model.config._attn_implementation == "kascade"
            again = model(ids).logits
        assert not h.active and model.config._attn_implementation == "sdpa"
        h.disable()
        with h:  # disabled by hand, then entered: routed again as well
            third = model(ids).logits
        with kascade.enable(model, _plan(model)):  # the handle let go of the model
            pass
    assert torch.equal(again, first) and torch.equal(third, first)
    assert not any(hasattr(m, "_kascade_runtime") for m in model.modules())


def test_enable_takes_the_path_of_a_plan_file(tmp_path, monkeypatch):
    """``kascade.enable(model, "cal/plan.json")`` said "unknown shipped plan variant"."""
    model = tiny_model("llama")
    plan = _plan(model)
    (tmp_path / "cal").mkdir()
    plan.save(tmp_path / "cal" / "plan.json")
    monkeypatch.chdir(tmp_path)
    for given in ("cal/plan.json", tmp_path / "cal" / "plan.json"):
        with kascade.enable(model, given) as h:
            assert h.plan == plan
    with pytest.raises(ValueError, match=r"no plan file at cal \(it is a folder\)"):
        kascade.enable(model, "cal")
    with pytest.raises(ValueError, match="'fastest' is neither a shipped plan .* nor a plan file"):
        kascade.enable(model, "fastest")
    with pytest.raises(ValueError, match="no shipped 'faithful' plan for this model"):
        kascade.enable(model, "faithful")
    assert model.config._attn_implementation == "sdpa"


def test_a_model_on_the_meta_device_is_refused_by_name():
    """An empty model (weights on the meta device) failed deep in torch ("Tensor.item() cannot be called on meta
    tensors") at its first forward."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny_model("llama").config).eval()
    with pytest.raises(ValueError, match="weights are on the meta device"):
        kascade.enable(model, _plan(tiny_model("llama")))
    assert model.config._attn_implementation == "sdpa"


def test_prompt_lookup_decoding_runs_and_a_full_budget_makes_it_greedy_dense():
    """Speculative decoding verifies several tokens per forward: Kascade runs those as prefill chunks (documented in
    enable: tokens may differ from one-token decoding under a sparse plan); with every key kept both are dense."""
    model = tiny_model("llama")
    ids = _ids(300)
    ids[0, 250:280] = ids[0, 100:130]  # a repeat for the prompt lookup to find
    full = KascadePlan.uniform(ModelFingerprint.from_model(model), 2, ratio=1.0, k_min=1, tile=16)
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=30, do_sample=False)
        with kascade.enable(model, full):
            looked_up = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=5)
        with kascade.enable(model, _plan(model)):  # a sparse plan: it runs, whatever tokens it picks
            sparse = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=5)
    assert torch.equal(looked_up, dense) and sparse.shape == dense.shape


def test_training_and_gradients_are_refused_clearly():
    model = tiny_model("llama")
    ids = _ids(40)
    with kascade.enable(model, _plan(model)):
        out = model(ids).logits  # gradients enabled, eval mode: the forward works...
        with pytest.raises(RuntimeError, match="Kascade is for inference"):
            out.sum().backward()  # ...a backward through it does not
        model.train()
        try:
            with pytest.raises(ValueError, match="training mode"):
                model(ids)
        finally:
            model.eval()
        with pytest.raises(ValueError, match="output_attentions"):
            with torch.no_grad():
                model(ids, output_attentions=True)


def test_a_tiny_per_layer_scale_still_attends_a_key():
    """round(0.01 * k) is 0: the layer must keep at least one key (a query without keys outputs zeros)."""
    model = tiny_model("llama")
    plan = _plan(model, k_min=16).with_reuse(factor=(1.0, 0.01, 1.0, 1.0))
    from transformers import DynamicCache

    with torch.no_grad(), kascade.enable(model, plan, account=True) as h:
        cache = DynamicCache()
        model(_ids(64), past_key_values=cache, use_cache=True)
        h.runtime.attended.clear()
        model(_ids(1, seed=5), past_key_values=cache, use_cache=True)
    att, dense = h.runtime.attended[1]
    assert att == 2 and dense == 2 * 65  # one key per KV head


def test_nothing_is_held_after_the_block():
    """The selections of a forward belong to it: once it returns, they are freed (the handle keeps none)."""
    from kascade import ops

    model = tiny_model("llama")
    refs = []
    orig = ops.dense_select

    def spy(*a, **kw):
        out, sel = orig(*a, **kw)
        refs.append(weakref.ref(sel.indices))
        return out, sel

    ops.dense_select = spy
    try:
        with torch.no_grad(), kascade.enable(model, _plan(model)) as h:
            model(_ids(100))
    finally:
        ops.dense_select = orig
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert not any(isinstance(v, torch.Tensor) for v in vars(h.runtime).values())


def test_graph_decoder_capture_is_refused_where_there_is_nothing_to_capture():
    """``GraphDecoder.capture`` (public: tensor-parallel ranks capture before any replays) refuses an eager decoder and
    one that has not prefilled, with a message instead of a CUDA error."""
    from kascade.integration.graphs import GraphDecoder

    dec = GraphDecoder(tiny_model("llama"), batch_size=1, max_cache_len=16, use_graph=False)
    with pytest.raises(RuntimeError, match="runs eagerly"):
        dec.capture()
    dec.use_graph = True  # as on a GPU, before any prefill
    with pytest.raises(RuntimeError, match="call prefill"):
        dec.capture()


def test_graph_decoder_recaptures_when_the_routing_changes():
    """A decoder's captured graph runs the kernels of the routing it was captured under: after Kascade is
    disabled (or enabled again) it must not replay it. (CUDA graphs need a GPU; here a stand-in graph records
    whether it was replayed.)"""
    from kascade.integration.graphs import GraphDecoder

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    model = tiny_model("llama")
    plan = _plan(model)
    handle = kascade.enable(model, plan)
    dec = GraphDecoder(model, batch_size=1, max_cache_len=48, use_graph=False)
    dec.prefill(_ids(30))
    dec.graph, dec._captured_under = Graph(), dec._routing()
    dec.step()
    assert Graph.replays == 1
    handle.disable()
    with pytest.warns(UserWarning, match="capturing a new graph"):
        dec.step()  # eager again (no GPU here): not a replay of the Kascade graph
    assert Graph.replays == 1 and dec.graph is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        dec.step()


def test_vision_language_model_routes_only_its_language_model():
    """A Llava-style model: the language model's attention goes through Kascade, the vision tower keeps its own;
    an image forward at full budget equals the dense model, and disable restores both."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_index=100,
                                                      vision_feature_layer=-1)).eval()
    ids = torch.cat([torch.tensor([[1, 2]]), torch.full((1, 16), 100), _ids(46) % 99 + 1], 1)  # 64: whole tiles
    pixels = torch.randn(1, 3, 16, 16)
    fp = ModelFingerprint.from_model(model)
    assert fp.num_layers == 4 and fp.num_kv_heads == 2
    with torch.no_grad():
        dense = model(input_ids=ids, pixel_values=pixels).logits
        with kascade.enable(model, KascadePlan.all_anchors(fp, ratio=1.0, k_min=1, tile=8)) as h:
            assert model.config.vision_config._attn_implementation == "sdpa"
            assert model.config.text_config._attn_implementation == "kascade"
            full = model(input_ids=ids, pixel_values=pixels).logits
        with kascade.enable(model, _plan(model), account=True) as h:
            model(input_ids=ids, pixel_values=pixels)
        assert sorted(h.runtime.attended) == [0, 1, 2, 3]
        assert model.config.text_config._attn_implementation == "sdpa"
        after = model(input_ids=ids, pixel_values=pixels).logits
    torch.testing.assert_close(full, dense, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, dense)


def test_a_fixed_top_k_plan_attends_k_keys_at_every_length():
    """KascadePlan.from_anchors(model, anchors=[2], topk=8): ratio 0, so a decode step keeps 8 keys per KV head
    whatever the context's length."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    plan = KascadePlan.from_anchors(model, anchors=[2], topk=8, tile=16)
    for n in (64, 300):
        with torch.no_grad(), kascade.enable(model, plan, account=True, warn_uncalibrated=False) as h:
            cache = DynamicCache()
            model(_ids(n), past_key_values=cache, use_cache=True)
            h.runtime.attended.clear()
            model(_ids(1, seed=5), past_key_values=cache, use_cache=True)
        assert h.runtime.attended[2] == [2 * 8, 2 * (n + 1)]  # 2 KV heads
