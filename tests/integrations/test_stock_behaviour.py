"""What a user does to a patched model behaves as on the stock model: hooks on the modules a
fused op computes itself (the gated MLP's projections, the LM head), ``torch.nn.utils.prune``,
a replaced activation, two threads sharing a model, and a hook that changes a norm's output in
place."""

import copy
import logging
import threading

import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import hf_actq
from hf_actq import ActQConfig
from hf_actq.testing import more_model, tiny_bert, tiny_llama


def _step(model, batch):
    model.zero_grad()
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out.loss.detach(), grads


def _llama_batch():
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _close(got, want, cosine):
    """The recipe's whole gradient against stock's, by cosine (4-bit rounding is noise)."""
    assert [a is None for a in got] == [b is None for b in want]
    flat_got = torch.cat([a.flatten() for a in got if a is not None])
    flat_want = torch.cat([b.flatten() for b in want if b is not None])
    assert torch.nn.functional.cosine_similarity(flat_got, flat_want, 0) > cosine


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("target", ["gate_proj", "down_proj", "lm_head"])
def test_forward_hooks_on_modules_a_fused_op_computes_run(target, when, caplog):
    # The fused gated MLP computes its projections, and the fused loss the head, without
    # calling them: their hooks never ran. Now a module with hooks is called (unfused).
    model = tiny_llama().train()
    module = model.lm_head if target == "lm_head" else getattr(model.model.layers[0].mlp, target)
    calls = []

    def record(mod, args, output):
        calls.append(output.shape)

    if when == "before":
        module.register_forward_hook(record)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    if when == "after":
        module.register_forward_hook(record)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        _step(model, _llama_batch())
    assert len(calls) == 1
    if when == "after" and target != "lm_head":  # the fused MLP says what it no longer packs
        assert "given hooks after hf_actq.apply" in caplog.text
    handle.revert()


def test_pruning_a_projection_trains_as_stock():
    # prune's pre-hook recomputes the weight before each call; uncalled, the weight was the
    # first step's tensor, and the second step's backward crashed through its freed graph.
    stock = tiny_llama().train()
    model = copy.deepcopy(stock)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    for each in (stock, model):
        torch.nn.utils.prune.l1_unstructured(each.model.layers[0].mlp.gate_proj, "weight", 0.5)
    for _ in range(2):
        stock_loss, stock_grads = _step(stock, _llama_batch())
        loss, grads = _step(model, _llama_batch())
        assert loss == pytest.approx(stock_loss.item(), rel=1e-5)
        _close(grads, stock_grads, cosine=0.87)


@pytest.mark.parametrize(
    ("replacement", "fused"), [(nn.GELU(), True), (nn.Tanh(), True), (nn.Identity(), False)]
)
def test_a_replaced_activation_is_followed(replacement, fused, caplog):
    # The fused MLP's derivative table was made at apply; a replaced act_fn used to be ignored
    # in training (the old activation computed). Supported: a table of its own; not: stock.
    stock = tiny_llama().train()
    model = copy.deepcopy(stock)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    for each in (stock, model):
        each.model.layers[0].mlp.act_fn = copy.deepcopy(replacement)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        loss, grads = _step(model, _llama_batch())
    stock_loss, stock_grads = _step(stock, _llama_batch())
    # The forward is exact either way: the new activation's values.
    assert loss == pytest.approx(stock_loss.item(), rel=1e-5)
    _close(grads, stock_grads, cosine=0.87)
    assert ("cannot fuse; the MLP runs stock" in caplog.text) == (not fused)
    state = model.model.layers[0].mlp.__dict__["_hf_actq"]
    assert (state.act_module is model.model.layers[0].mlp.act_fn) == fused
    handle.revert()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_a_forward_in_another_thread_during_a_fused_step_computes_as_stock(name):
    # The fused loss swapped the shared model's head for a recorder during its forward: a
    # forward in another thread at that moment returned zero logits.
    model, batch = more_model(name)  # no dropout: training mode changes no value
    model.train()
    with torch.no_grad():
        want = model(**batch).logits
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    meeting = threading.Barrier(2, timeout=30)

    def pause(module, args, output):  # after the decoder, before the head
        if threading.current_thread().name == "trainer":
            meeting.wait()  # the other thread runs its whole forward now
            meeting.wait()

    model.get_decoder().register_forward_hook(pause)
    results = {}

    def train():
        results["loss"] = model(**batch).loss

    def read():
        meeting.wait()
        with torch.no_grad():
            results["logits"] = model(**batch).logits
        meeting.wait()

    threads = [threading.Thread(target=train, name="trainer"), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert torch.isfinite(results["loss"])
    torch.testing.assert_close(results["logits"], want)


@pytest.mark.parametrize("recipe", ["fewbit", "checkpoint"])
def test_a_hook_changing_a_norm_output_in_place_trains_as_stock(recipe):
    # Exact norms keep their output to rebuild the input (memory sharing): a hook that changes
    # the output in place made their backward fail. A norm with hooks keeps its input now.
    stock = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    model = copy.deepcopy(stock)
    hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    for each in (stock, model):
        norm = each.bert.encoder.layer[0].output.LayerNorm
        norm.register_forward_hook(lambda module, args, output: output.mul_(1.5))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": torch.tensor([0, 1])}
    loss, grads = _step(model, batch)
    stock_loss, stock_grads = _step(stock, batch)
    assert loss == pytest.approx(stock_loss.item(), rel=1e-5)
    _close(grads, stock_grads, cosine=0.955)


def test_other_code_changing_an_exact_norm_output_in_place_fails_in_one_line():
    # No hook to see it coming: the memory-sharing norm's backward names the way out.
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    hf_actq.apply(model, ActQConfig.from_recipe("fewbit"))
    out = model(torch.randn(4, 8, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="share_norm_outputs=False"):
        out.backward()


class _ActThenLinear(nn.Module):
    """A user's block that relies on an in-place activation writing its input."""

    def __init__(self, act: nn.Module, in_place_use: bool):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), act, nn.Linear(32, 4)
        self.in_place_use = in_place_use

    def forward(self, x):
        h = self.fc1(x)
        if self.in_place_use:
            self.act(h)  # h now holds act(h)
            return self.fc2(h)
        return self.fc2(self.act(h))


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


IN_PLACE = [nn.SiLU, nn.ReLU, nn.ELU, nn.LeakyReLU, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU,
            nn.Hardswish, nn.Hardsigmoid, nn.Mish]  # fmt: skip


@pytest.mark.parametrize("recipe", ["fewbit", "uniform"])
@pytest.mark.parametrize("cls", IN_PLACE, ids=lambda c: c.__name__)
def test_an_in_place_activation_writes_its_input_as_stock(cls, recipe):
    torch.manual_seed(0)
    model, x = _ActThenLinear(cls(inplace=True), in_place_use=True), torch.randn(8, 16)
    stock_loss, stock_grads = _loss_and_grads(model, x)
    handle = hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    loss, grads = _loss_and_grads(model, x)
    handle.revert()
    assert torch.equal(loss, stock_loss)  # the forward, bit for bit: fc2 saw act(h)
    flat = torch.cat([g.flatten() for g in grads])
    stock_flat = torch.cat([g.flatten() for g in stock_grads])
    assert torch.nn.functional.cosine_similarity(flat, stock_flat, dim=0) > 0.95


def _subclasses():
    from transformers import activations as hf

    class ScaledGELU(nn.GELU):
        def forward(self, x):
            return 1.7 * super().forward(x)

    class ClippedGELU(hf.GELUActivation):
        def forward(self, x):
            return super().forward(x).clamp(-0.1, 0.1)

    class PythonGELU(hf.GELUActivation):  # the method its forward calls, replaced
        def _gelu_python(self, x):
            return x * torch.sigmoid(x)

    class TanhLike(hf.GELUTanh):
        def forward(self, x):
            return torch.tanh(x)

    return [ScaledGELU(), ClippedGELU(), PythonGELU(use_gelu_python=True), TanhLike()]


@pytest.mark.parametrize("index", range(4))
def test_a_subclassed_activation_keeps_its_own_forward(index):
    """Matched by type, a scaled or clipped GELU would be bound to plain GELU's few-bit op: it
    stays stock instead, and the handle says why."""
    act = _subclasses()[index]
    torch.manual_seed(0)
    model, x = _ActThenLinear(act, in_place_use=False), torch.randn(8, 16) * 3
    stock_loss, stock_grads = _loss_and_grads(model, x)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit"))
    assert "forward of its own" in handle.skipped["act"]
    loss, grads = _loss_and_grads(model, x)
    handle.revert()
    assert torch.equal(loss, stock_loss)
    for got, want in zip(grads, stock_grads):
        assert torch.equal(got, want)


def test_a_subclass_that_only_sets_up_differently_is_still_few_bit():
    class Quiet(nn.GELU):
        def __init__(self):
            super().__init__(approximate="tanh")

    model = _ActThenLinear(Quiet(), in_place_use=False)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit"))
    assert handle.patched["act"].startswith("activation gelu_tanh")
    handle.revert()
