"""Patched models under torch.compile: no graph break in hf_actq's ops, gradients equal to the
eager patched run, and a compiled Trainer run with the callback.

The backend is "aot_eager": AOTAutograd's forward/backward split with eager kernels. Inductor
(code generation, and a partitioner that recomputes more) is measured by
benchmarks/bench_compile.py and the slow test in test_apply.py (minutes on two CPU cores).

Tracing dominates these tests' time (tens of seconds per model on two cores), so the models have
one layer (every layer is traced alike), and the default run keeps one case of each property,
on the cheapest model that has it (under 2 minutes on two cores); ``-m slow`` runs every model
and recipe.
"""

import contextlib
import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import Trainer

import hf_actq
from hf_actq import ActQCallback, ActQConfig
from hf_actq.memory.meter import graph_saved_bytes
from hf_actq.ops import dedup
from hf_actq.testing import tiny_bert, tiny_llama

RECIPES = {
    "fewbit": ActQConfig.from_recipe("fewbit"),
    "uniform": ActQConfig.from_recipe("uniform", bits=4),
    "alam": ActQConfig.from_recipe("alam", adaptive=False),
    "blpa": ActQConfig.from_recipe("uniform", codec="blpa"),
}


def _llama():
    model = tiny_llama(attn_implementation="sdpa", num_hidden_layers=1)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _bert(dropout=0.0):
    # Dropout under compile is stock dropout (see the last tests), with masks of its own.
    model = tiny_bert(
        attn_implementation="sdpa",
        num_hidden_layers=1,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": torch.tensor([0, 1])}


def _cases(default: tuple[str, ...]) -> list:
    """(build, recipe) pairs, BERT and the LLaMA (a gated MLP, RMSNorm, the fused loss) under
    every recipe; those not in ``default`` ("bert-uniform", ...) run only with -m slow."""
    cases = []
    for recipe in RECIPES:
        for name, build in (("bert", _bert), ("llama", _llama)):
            marks = () if f"{name}-{recipe}" in default else pytest.mark.slow
            cases.append(pytest.param(build, recipe, id=f"{name}-{recipe}", marks=marks))
    return cases


# Every codec packs through one traced op (``hf_actq::pack``), so "alam" and "blpa" trace as
# "uniform" does; the LLaMA's one graph is checked where it is compiled below
# (test_compiled_consumers_of_a_shared_input_keep_it_packed_once).
@pytest.mark.parametrize(("build", "recipe"), _cases(("bert-fewbit", "bert-uniform")))
def test_patched_forward_compiles_into_one_graph(build, recipe):
    model, batch = build()
    hf_actq.apply(model, RECIPES[recipe])
    explained = torch._dynamo.explain(lambda: model(**batch).loss)()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def _gradients(base, batch, config, compiled):
    model = copy.deepcopy(base)
    hf_actq.apply(model, config)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    torch.manual_seed(2)
    loss = run(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


# The LLaMA's compiled gradients are compared under packed checkpointing below; "alam" and
# "blpa" are codecs like "uniform"'s.
@pytest.mark.parametrize(("build", "recipe"), _cases(("bert-fewbit", "bert-uniform")))
def test_compiled_gradients_equal_the_eager_patched_gradients(build, recipe, monkeypatch):
    # A trace rounds a shared input (q/k/v, gate/up) once with a seed mixed from the step
    # seed; eager reuses the first consumer's codes. With reuse and the step seed off every
    # pack draws its own seed, in the same order in both, so stochastic rounding is compared
    # exactly too.
    monkeypatch.setattr(dedup._Entry, "reuse", lambda self, x, codec: None)
    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)
    torch._dynamo.reset()
    base, batch = build()
    eager_loss, eager = _gradients(base, batch, RECIPES[recipe], compiled=False)
    compiled_loss, compiled = _gradients(base, batch, RECIPES[recipe], compiled=True)
    torch.testing.assert_close(compiled_loss, eager_loss)
    assert eager.keys() == compiled.keys()
    for name, grad in eager.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow  # the tests around it compare compiled and eager gradients more closely
def test_compiled_gradients_differ_from_eager_only_by_the_shared_inputs_seeds():
    # With reuse on (the default), a stochastic recipe's compiled gradient is another draw of
    # the same estimate: as close to the exact gradient as eager's.
    torch._dynamo.reset()
    base, batch = _llama()
    exact = copy.deepcopy(base)
    exact(**batch).loss.backward()
    flat = torch.cat([p.grad.flatten() for p in exact.parameters()])
    cosines = {}
    for compiled in (False, True):
        _, grads = _gradients(base, batch, RECIPES["uniform"], compiled)
        approx = torch.cat([g.flatten() for g in grads.values()])
        cosines[compiled] = torch.nn.functional.cosine_similarity(flat, approx, 0).item()
    assert cosines[False] > 0.9 and cosines[True] > 0.9
    assert abs(cosines[True] - cosines[False]) < 0.05


def test_compiled_consumers_of_a_shared_input_keep_it_packed_once():
    """q, k and v (and gate and up) round their common input with one seed under compile, so
    the compiler merges their pack ops and backward keeps one packed copy per layer, as eager
    does (its cache packs a shared input once): a pack per consumer would keep at least k's
    and v's copies more, in every layer."""
    base, batch = _llama()
    saved = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        handle = hf_actq.apply(model, RECIPES["uniform"])
        counters.clear()
        run = torch.compile(_loss, backend="aot_eager") if compiled else _loss
        loss = run(model, **batch)
        if compiled:
            # One graph (a break would split it): the gated MLP, RMSNorm, SDPA and the fused
            # loss all trace. (counters["graph_break"] also lists breaks dynamo resolved.)
            assert counters["stats"]["unique_graphs"] == 1
        saved[compiled] = graph_saved_bytes(loss, exclude=model.parameters())
        loss.backward()
        handle.revert()
        assert not model._forward_pre_hooks and not model._forward_hooks
    config = model.config
    hidden = torch.zeros(batch["input_ids"].numel(), config.hidden_size)
    one_copy = RECIPES["uniform"].make_codec().pack(hidden).nbytes
    # Measured: 188 bytes more compiled (of 13 KB); a second copy of any input would add 576.
    assert saved[True] < saved[False] + one_copy, saved


def _loss(model, **batch):
    return model(**batch).loss


@pytest.mark.slow  # 26 s; the step seed advances: test_apply.py and tests/ops/test_dedup.py
def test_compiled_rounding_is_fresh_each_forward_and_accumulates():
    """The step seed advances with every forward, so micro-batches (and steps) round with new
    noise, and their backwards may run after later forwards (gradient accumulation keeps two
    graphs alive) although the seed was changed in place since."""
    torch._dynamo.reset()
    base, batch = _llama()
    exact = copy.deepcopy(base)
    exact(**batch).loss.backward()
    expected = torch.cat([p.grad.flatten() for p in exact.parameters()])
    model = copy.deepcopy(base)
    hf_actq.apply(model, RECIPES["uniform"])
    compiled = torch.compile(model, backend="aot_eager")
    first, second = compiled(**batch).loss, compiled(**batch).loss
    torch.testing.assert_close(first, second)  # exact forward, the same batch
    grads = []
    for loss in (first, second):
        loss.backward()
        grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
        model.zero_grad()
    assert not torch.equal(grads[0], grads[1])
    for grad in grads:
        assert torch.nn.functional.cosine_similarity(grad, expected, 0) > 0.9


def test_dropout_under_compile_runs_the_stock_ops_without_a_break():
    model, batch = _bert(dropout=0.1)
    hf_actq.apply(model, RECIPES["uniform"])
    torch._dynamo.reset()
    counters.clear()
    torch.compile(_loss, backend="aot_eager")(model, **batch).backward()
    assert counters["stats"]["unique_graphs"] == 1  # a break would split the graph
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "config",
    [
        # 27 s: the Trainer's compile path with the patched ops, which the tests above compile
        # without it.
        pytest.param(ActQConfig(bits=4), id="default", marks=pytest.mark.slow),
        pytest.param(ActQConfig.from_recipe("checkpoint"), id="checkpoint", marks=pytest.mark.slow),
    ],
)
def test_compiled_trainer_with_the_callback_trains(tmp_path, config):
    from test_trainer import Toy, _args, _losses

    torch._dynamo.reset()
    callback = ActQCallback(config)
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    args.max_steps, args.learning_rate = 12, 1e-2
    trainer = Trainer(
        model=tiny_llama(attn_implementation="sdpa", num_hidden_layers=1),
        args=args,
        train_dataset=Toy(True, n=8),
        callbacks=[callback],
    )
    trainer.train()
    losses = _losses(trainer)
    assert callback.handle is not None and callback.handle.patched
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5


CHECKPOINT = ActQConfig.from_recipe("checkpoint", bits=8)


def _lora_llama(lora_dropout=0.0):
    from peft import LoraConfig, get_peft_model

    model, batch = _llama()
    lora = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=lora_dropout
    )
    return get_peft_model(model, lora), batch


def _t5():
    from hf_actq.testing import more_model

    return more_model("t5")  # dropout 0


def _stock_checkpointing(model):
    model.gradient_checkpointing_enable({"use_reentrant": False})


def _lora_llama_with_dropout():
    return _lora_llama(lora_dropout=0.1)


# LLaMA's attention forward, wrapped by the `kernels` package transformers requires
# (`use_kernelized_func`), sets a module-global context variable under compile
# (kernels/_internals/layer/layer.py:507); dynamo refuses that mutation inside a higher-order op
# ("HOP: Unsafe side effect"). Stock checkpointing's op hits it once; the traced packed
# checkpoint's autograd.Function once or twice more (5 and 6 breaks against 4, transformers
# 5.25, kernels 0.19). Strict: a fix on either side makes these pass and fail the marker.
_KERNELS_CONTEXT_VARIABLE = pytest.mark.xfail(
    strict=True, reason="the kernels package mutates a global inside the traced checkpoint"
)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_llama, id="llama", marks=[pytest.mark.slow, _KERNELS_CONTEXT_VARIABLE]),
        pytest.param(_bert, id="bert"),
        pytest.param(
            _lora_llama_with_dropout,
            id="lora-dropout",
            marks=[pytest.mark.slow, _KERNELS_CONTEXT_VARIABLE],
        ),
        pytest.param(_t5, id="t5", marks=pytest.mark.slow),
    ],
)
def test_packed_checkpointing_breaks_no_more_than_stock_checkpointing(build):
    # Checkpointed layers of a model without dropout take the traced form, and so do layers
    # with PEFT's LoRA dropouts (they replay their masks from a key drawn once per layer;
    # otherwise every layer would break). The breaks both have are transformers' warning that
    # checkpointing turns use_cache off (a logging call) and PEFT's hook that makes the
    # embeddings require grad: with use_cache=False the LLaMA compiles into one graph. Stock
    # checkpointing breaks T5 where its attention sets requires_grad on a zero position bias;
    # inside a packed layer checkpointing is off, so it does not.
    breaks = {}
    for patch in (_stock_checkpointing, lambda model: hf_actq.apply(model, CHECKPOINT)):
        model, batch = build()
        patch(model)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda m=model, **b: m(**b).loss)(**batch)
        breaks[patch] = explained.graph_break_count
    stock, packed = breaks.values()
    assert packed == stock or (build is _t5 and packed == 0 < stock), breaks
    if build is _llama:
        model, batch = build()
        hf_actq.apply(model, CHECKPOINT)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda: model(**batch, use_cache=False).loss)()
        assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_lora_dropouts_replay_only_while_packed_checkpointing_is_applied():
    """PEFT's LoRA dropouts get a replay key (not saved with the weights) for the traced form
    (the graph breaks: test_packed_checkpointing_breaks_no_more_than_stock_checkpointing);
    revert gives the stock nn.Dropout back."""
    model, _ = _lora_llama_with_dropout()
    handle = hf_actq.apply(model, CHECKPOINT)
    assert not any("replay" in key for key in model.state_dict())
    dropouts = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert len(dropouts) == 3  # one layer, three adapted projections
    assert all(list(dropout.buffers()) for dropout in dropouts)
    handle.revert()
    for dropout in dropouts:
        assert "forward" not in vars(dropout) and not list(dropout.buffers())


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_llama, id="llama", marks=pytest.mark.slow),  # 8 s
        pytest.param(_bert, id="bert"),
        pytest.param(_lora_llama, id="lora", marks=pytest.mark.slow),
        pytest.param(_t5, id="t5", marks=pytest.mark.slow),
    ],
)
def test_compiled_packed_checkpointing_gradients_equal_the_eager_ones(build, monkeypatch):
    # Without the step seed, traced packs draw their seeds from torch's RNG as eager does.
    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)
    torch._dynamo.reset()
    base, batch = build()
    eager_loss, eager = _gradients(base, batch, CHECKPOINT, compiled=False)
    compiled_loss, compiled = _gradients(base, batch, CHECKPOINT, compiled=True)
    torch.testing.assert_close(compiled_loss, eager_loss)
    trained = [name for name, grad in eager.items() if grad is not None]
    assert trained == [name for name, grad in compiled.items() if grad is not None]
    for name in trained:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_packed_checkpointing_keeps_the_packed_inputs():
    """The compiled graph keeps what the eager checkpoint recipe keeps (the layers' packed
    inputs), far below compiled stock checkpointing's full-precision inputs."""
    saved = {}
    for name, patch in (("stock", _stock_checkpointing), ("packed", None)):
        for compiled in (False, True):
            model, batch = _bert()
            if patch is None:
                hf_actq.apply(model, CHECKPOINT)
            else:
                patch(model)
            torch._dynamo.reset()
            run = torch.compile(model, backend="aot_eager") if compiled else model
            loss = run(**batch).loss
            saved[name, compiled] = graph_saved_bytes(loss, exclude=model.parameters())
    assert saved["packed", True] <= 1.05 * saved["packed", False]
    assert saved["packed", True] < 0.6 * saved["stock", True]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("t5", marks=pytest.mark.slow),  # 26 s
        # BART repeats T5's seq2seq loss; Mixtral's experts op compiles in the test after this.
        pytest.param("deberta-v2", marks=pytest.mark.slow),
        pytest.param("bart", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),
        pytest.param("gemma3", marks=pytest.mark.slow),  # 70 s
    ],
)
def test_more_model_types_add_no_graph_break(name):
    # T5's attention with its position bias, the seq2seq fused loss, DeBERTa (whose attention
    # runs the stock module under compile), the MoE experts op and Gemma 3's (1 + w) norms in a
    # vision-language model: the patched model breaks no more often than the stock one
    # (DeBERTa's own relative-position code breaks once, Gemma 3's image merging three times).
    from hf_actq.testing import more_model

    breaks = {}
    for patched in (False, True):
        model, batch = more_model(name)
        if patched:
            hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(lambda m=model, **b: m(**b).loss)(**batch)
        breaks[patched] = explanation.graph_break_count
    assert breaks[True] == breaks[False]


@pytest.mark.slow  # 25 s
def test_compiled_moe_experts_gradients_equal_the_eager_ones(monkeypatch):
    # The traced backward goes through transformers' grouped-matmul operator; eager through
    # grouped_mm and a per-expert loop: the same gradients.
    from hf_actq.testing import more_model

    monkeypatch.setattr(dedup._Entry, "reuse", lambda self, x, codec: None)
    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)
    torch._dynamo.reset()
    base, batch = more_model("mixtral")
    config = ActQConfig.from_recipe("uniform", bits=4)
    eager_loss, eager = _gradients(base, batch, config, compiled=False)
    compiled_loss, compiled = _gradients(base, batch, config, compiled=True)
    torch.testing.assert_close(compiled_loss, eager_loss)
    experts = [name for name in eager if ".experts." in name]
    assert experts
    for name, grad in eager.items():
        if grad is not None:
            torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.needs_kernels
@pytest.mark.parametrize(
    "build,recipe",
    [
        pytest.param(_llama, "uniform", id="llama-uniform"),
        pytest.param(_bert, "checkpoint", id="bert-checkpoint"),
        pytest.param(_bert, "alam", id="bert-alam", marks=pytest.mark.slow),
        pytest.param(_llama, "blpa", id="llama-blpa", marks=pytest.mark.slow),
    ],
)
def test_a_compiled_step_runs_the_kernels_with_the_twins_gradients(build, recipe):
    """The compiled graph on a GPU: the pack ops launch the kernels (here under the
    interpreter), which read their seeds on the device, and give the twins' gradients. A custom
    op's outputs may not alias, so a pack whose tensors are views of one allocation returns that
    allocation (the kernels' packs are; torch refused them before, on any GPU)."""
    from hf_actq.kernels.registry import kernels_on_cpu

    config = RECIPES.get(recipe) or ActQConfig.from_recipe(recipe)
    base, batch = build()
    grads = []
    for kernels in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the step seed starts from torch's seed
        model = copy.deepcopy(base)
        hf_actq.apply(model, config)
        with kernels_on_cpu() if kernels else contextlib.nullcontext():
            torch.compile(model, backend="aot_eager")(**batch).loss.backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_compiled_eager_recompute_attention_gradients_equal_the_eager_ones(monkeypatch):
    # A decoder set to eager attention (Gemma 2's default): its own eager function runs in the
    # forward and again, under torch.func.vjp, in the traced backward, without a graph break.
    monkeypatch.setattr(dedup._Entry, "reuse", lambda self, x, codec: None)
    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)
    torch._dynamo.reset()
    base = tiny_llama(attn_implementation="eager", num_hidden_layers=1)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    config = ActQConfig.from_recipe("uniform", bits=4)
    model = copy.deepcopy(base)
    handle = hf_actq.apply(model, config)
    assert "eager, recomputed" in handle.patched["model.layers.0.self_attn"]
    explained = torch._dynamo.explain(lambda: model(**batch).loss)()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    eager_loss, eager = _gradients(base, batch, config, compiled=False)
    compiled_loss, compiled = _gradients(base, batch, config, compiled=True)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for name, grad in eager.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-7, msg=name)
