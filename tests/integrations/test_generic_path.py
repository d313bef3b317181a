"""Real transformers architectures with no registered patcher take the generic path: a warning
that says so and what it patched, a forward bit-identical to the unpatched model's, gradients
within the documented bounds (docs/reference.md, "Gradient error per recipe"), fewer bytes kept,
and a revert that leaves the model as it was. The toy model in test_apply.py shows the warning;
these are the decoders a user may bring (OPT, Falcon, GPT-J, BLOOM, Nemotron, Arcee, PhiMoE)."""

import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_actq
from hf_actq import ActQConfig
from hf_actq.integrations.registry import MODEL_TYPE_TO_APPLY_FN
from hf_actq.testing import metered_step

# Model type: the config settings a 32-wide, 2-layer model needs, and that turn off what draws
# from the RNG (functional dropout, router jitter): patched and unpatched steps draw differently.
UNREGISTERED = {
    "opt": {"dropout": 0.0, "ffn_dim": 64},
    "falcon": {},
    "gptj": {"rotary_dim": 4},
    "bloom": {},
    "nemotron": {},
    "arcee": {},
    "phimoe": {"router_jitter_noise": 0.0, "input_jitter_noise": 0.0},
}
SIZES = dict(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _model(model_type):
    config = AutoConfig.for_model(model_type, **SIZES, **UNREGISTERED[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _batch():
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


def _cosine(a, b):
    flat = [torch.cat([g.flatten() for g in grads if g is not None]) for grads in (a, b)]
    return torch.nn.functional.cosine_similarity(*flat, dim=0).item()


@pytest.mark.parametrize("model_type", sorted(UNREGISTERED))
@pytest.mark.parametrize("recipe,bits,bound", [("fewbit", 3, 0.98), ("uniform", 8, 0.99)])
def test_an_unregistered_decoder_takes_the_generic_path(model_type, recipe, bits, bound, caplog):
    assert model_type not in MODEL_TYPE_TO_APPLY_FN  # registered now: move it to its own tests
    base, batch = _model(model_type), _batch()
    model = copy.deepcopy(base)
    forward, grads, nbytes = metered_step(model, batch)
    before = repr(model)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle = hf_actq.apply(model, ActQConfig.from_recipe(recipe, bits=bits))
    assert f"model type '{model_type}' has no registered patcher" in caplog.text
    torch.manual_seed(0)
    patched_forward, patched_grads, patched_bytes = metered_step(model, batch)
    if handle.patched:  # Nemotron has no activation module few-bit can take (the warning says)
        assert torch.equal(patched_forward, forward)
        assert _cosine(patched_grads, grads) > bound
        assert patched_bytes < nbytes
    else:
        assert recipe == "fewbit" and "patched nothing" in caplog.text
    handle.revert()
    assert repr(model) == before
