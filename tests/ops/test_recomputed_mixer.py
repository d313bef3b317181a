"""Linear-attention mixers (Qwen3.5's and Qwen3-Next's gated delta rule) kept as their packed
input and run again in backward (hf_actq/ops/recomputed_mixer.py)."""

import copy

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.testing import HYBRID_EXACT, hybrid_model, metered_step


def _mixers(model):
    return {path: m for path, m in model.named_modules() if path.endswith("linear_attn")}


def _equal(grads, want):
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, want))


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"])
def test_an_exact_recompute_gives_the_stock_forward_and_gradients_bit_for_bit(name):
    """With the input kept exact, the recompute's backward is the stock one: only the mixer's
    input is kept (its chunk matrices and states are not), and its patch says so."""
    model, batch = hybrid_model(name)
    forward, grads, nbytes = metered_step(model, batch)
    patched = copy.deepcopy(model)
    handle = hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    assert set(_mixers(patched)) <= set(handle.patched) and _mixers(patched)
    assert all("run again in backward" in handle.patched[p] for p in _mixers(patched))
    got_forward, got_grads, got_bytes = metered_step(patched, batch)
    assert torch.equal(got_forward, forward) and _equal(got_grads, grads)
    assert got_bytes < nbytes / 3
    handle.revert()
    assert _equal(metered_step(patched, batch)[1], grads)


def _mixer_bytes(model, batch):
    """Bytes the mixers' own ops keep (their packed input where they keep one)."""
    with SavedTensorMeter(exclude=list(model.parameters()), model=model) as meter:
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad()
    return sum(n for path, n in meter.by_module().items() if ".linear_attn" in path + ".")


def test_the_mixer_keeps_the_norms_offered_pack_and_nothing_of_its_own():
    """Under "uniform" the norm before the mixer offers its output: the mixer keeps none of its
    own bytes; without the offer, exactly its input's pack."""
    model, batch = hybrid_model("qwen3_5_text")
    shared = copy.deepcopy(model)
    hf_actq.apply(shared, ActQConfig.from_recipe("uniform"))
    assert _mixer_bytes(shared, batch) == 0
    own = copy.deepcopy(model)
    hf_actq.apply(own, ActQConfig.from_recipe("uniform", share_norm_outputs=False))
    codec = hf_actq.ActQConfig.from_recipe("uniform").make_codec()
    tokens, hidden = batch["input_ids"].numel(), model.config.hidden_size
    expected = codec.pack(torch.randn(tokens, hidden)).nbytes
    assert _mixer_bytes(own, batch) == expected


def test_four_bits_keep_the_gradient_close():
    model, batch = hybrid_model("qwen3_5_text")
    _, grads, nbytes = metered_step(model, batch)
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig.from_recipe("uniform", bits=4))
    torch.manual_seed(0)
    _, got, got_bytes = metered_step(patched, batch)
    flat = [torch.cat([g.flatten() for g in gs if g is not None]) for gs in (got, grads)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.99
    assert got_bytes < nbytes / 20


def _graph_names(tensor) -> set[str]:
    seen, names, todo = set(), set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_a_cache_holding_state_runs_the_stock_mixer():
    """A forward that continues from a cache (the mixers read and write its recurrent state)
    runs stock, with grad enabled too: the same logits and cache as the unpatched model, and
    no recompute in its graph; a fresh cache (a training forward's ``use_cache``) takes the
    recompute."""
    model, batch = hybrid_model("qwen3_5_text")
    ids = batch["input_ids"]
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    results = []
    for m in (model, patched):
        with torch.no_grad():
            cache = m(input_ids=ids[:, :6], use_cache=True).past_key_values
        out = m(input_ids=ids[:, 6:10], past_key_values=cache, use_cache=True)
        with torch.no_grad():  # reads what the forward left in the cache
            after = m(input_ids=ids[:, 10:], past_key_values=cache, use_cache=True).logits
        results.append((out.logits, after))
    (logits, after), (got_logits, got_after) = results
    assert torch.equal(got_logits, logits) and torch.equal(got_after, after)
    assert not any("PackedCheckpoint" in name for name in _graph_names(got_logits))
    fresh = patched(input_ids=ids, use_cache=True).logits
    assert any("PackedCheckpoint" in name for name in _graph_names(fresh))


def test_a_forward_hook_on_the_mixer_runs_once_and_its_gradient_is_the_stock_one():
    model, batch = hybrid_model("qwen3_5_text")
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    calls = []

    def doubled(module, args, output):
        calls.append(module)
        return output * 2

    for m in (model, patched):
        for mixer in _mixers(m).values():
            mixer.register_forward_hook(doubled)
    _, grads, _ = metered_step(model, batch)
    calls.clear()
    _, got, _ = metered_step(patched, batch)
    assert len(calls) == len(_mixers(patched))  # not again in the recompute
    assert _equal(got, grads)


def test_without_grad_and_in_eval_the_mixer_runs_stock():
    model, batch = hybrid_model("qwen3_5_text")
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig.from_recipe("uniform"))
    with torch.no_grad():
        want = model(**batch).logits
        got = patched.eval()(**batch).logits
    assert torch.equal(got, want)


def test_lora_on_the_mixers_projections_trains_as_stock():
    """PEFT's adapters inside the mixer get the stock gradients from the exact recompute (the
    recompute swaps the trainable parameters in and returns their gradients)."""
    from peft import LoraConfig, get_peft_model

    model, batch = hybrid_model("qwen3_5_text")
    torch.manual_seed(0)
    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj"]
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    _, grads, _ = metered_step(lora, batch)
    patched = copy.deepcopy(lora)
    hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    _, got, _ = metered_step(patched, batch)
    trained = [i for i, p in enumerate(lora.parameters()) if p.requires_grad]
    assert any("in_proj_qkv.lora_A" in n for n, p in lora.named_parameters() if p.requires_grad)
    assert all(torch.equal(got[i], grads[i]) for i in trained)


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_stock_checkpointing_the_gradients_stay_the_stock_ones(reentrant):
    """Inside a layer that transformers' checkpointing runs again, the mixer runs its own
    recompute in that recompute's backward: with its input exact, stock gradients bit for bit."""
    model, batch = hybrid_model("qwen3_5_text")
    _, grads, _ = metered_step(model, batch)
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    # activation_checkpointing_enable since transformers 5.23, gradient_... before
    prefix = "activation" if hasattr(patched, "activation_checkpointing_enable") else "gradient"
    options = {f"{prefix}_checkpointing_kwargs": {"use_reentrant": reentrant}}
    getattr(patched, f"{prefix}_checkpointing_enable")(**options)
    patched.train()
    assert _equal(metered_step(patched, batch)[1], grads)


def test_under_torch_compile_the_mixer_runs_stock():
    """A compiled model traces the mixer's stock forward (no graph break, no recompute node)."""
    model, batch = hybrid_model("qwen3_5_text")
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert not any("PackedCheckpoint" in name for name in _graph_names(compiled(**batch).loss))
    assert any("PackedCheckpoint" in name for name in _graph_names(model(**batch).loss))


def test_a_mixer_called_with_positional_arguments_recomputes_as_called_by_name():
    """``mixer(x, cache, mask)`` positionally: the cache and the mask go where they belong."""
    model, batch = hybrid_model("qwen3_5_text")
    hf_actq.apply(model, ActQConfig(**HYBRID_EXACT))
    (mixer,) = _mixers(model).values()
    x = torch.randn(2, 12, model.config.hidden_size, requires_grad=True)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    outs, grads = [], []
    for positional in (True, False):
        out = mixer(x, None, mask) if positional else mixer(hidden_states=x, attention_mask=mask)
        assert any("PackedCheckpoint" in name for name in _graph_names(out))
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        outs.append(out.detach()), grads.append(grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
