"""SavedTensorMeter and the independent graph walk count the same bytes, by storage."""

import threading

import pytest
import torch
from torch import nn

import hf_actq
from hf_actq.memory import OP_KINDS, SavedTensorMeter, graph_saved_bytes, op_kind
from hf_actq.memory.meter import ActivationMonitor
from hf_actq.report import build_model
from hf_actq.report.presets import preset_config
from hf_actq.testing import replicate_with_distinct_weights, tiny_llama


def test_linear_keeps_its_input_once_and_views_count_whole_storage():
    layer = nn.Linear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    with SavedTensorMeter(exclude=layer.parameters(), model=layer) as meter:
        y = layer(x)
        z = x[:4].exp()  # exp keeps its output (its own storage)
    assert meter.nbytes == x.numel() * 4 + z.numel() * 4
    assert graph_saved_bytes([y, z], exclude=layer.parameters()) == meter.nbytes
    assert meter.by_kind()["linear"] == x.numel() * 4
    assert meter.by_module()[""] == x.numel() * 4 + z.numel() * 4


def test_a_branch_the_forward_drops_is_not_counted_and_its_address_may_come_back():
    # sin keeps its input: the first branch is freed while the forward goes on (as GLM-4.5's
    # group-limited routing drops a scored branch), so autograd holds only the second, whose
    # input may take the freed address (1 KiB for 1 KiB: it did, and was not counted before).
    x, y = torch.randn(256, requires_grad=True), torch.randn(512, requires_grad=True)
    for size in (256, 512):
        with SavedTensorMeter() as meter:
            dropped = (x + 1).sin()
            del dropped
            kept = (y[:size] + 1).sin()
        assert meter.nbytes == size * 4 == graph_saved_bytes(kept)
    # A forward whose whole graph is freed inside the block (the output not kept) counts what
    # it saved: nothing was saved after it was freed.
    with SavedTensorMeter() as meter:
        (x + 1).sin()
    assert meter.nbytes == 256 * 4


def test_a_model_that_drops_a_branch_keeps_the_same_bytes_every_step():
    # GLM-4.5's router scores groups with autograd recording, then uses only their indices: the
    # saved tensors of that branch are freed mid-forward and their addresses reused. The meter
    # counted them, and deduplicated the next tensor at a reused address: a count that changed
    # from step to step (177,524, 177,332, 177,140 bytes) where the graph walk's did not. (The
    # walk also sees 8 bytes the hooks do not: a Python number multiplied in, see the meter.)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "glm4_moe", vocab_size=100, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(3, 100, (2, 12))
    counts = []
    for _ in range(3):
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            loss = model(input_ids=ids, labels=ids).loss
        counts.append((meter.nbytes, graph_saved_bytes(loss, exclude=model.parameters())))
        loss.backward()
    assert len(set(counts)) == 1 and 0 <= counts[0][1] - counts[0][0] <= 8


def test_parameters_are_excluded_only_when_asked():
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = layer(x)
    weight = layer.weight.untyped_storage().nbytes()
    assert meter.nbytes == x.numel() * 4 + weight
    assert graph_saved_bytes(y) == meter.nbytes


@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-llama"])
@pytest.mark.parametrize("recipe", [None, "fewbit", "uniform", "alam"])
def test_two_counts_agree_on_models(preset, recipe):
    config = preset_config(preset)
    task = "classification" if preset == "tiny-bert" else "causal-lm"
    model = build_model(config, 2, torch.float32, "none", task, "cpu")
    if recipe:
        hf_actq.apply(model, hf_actq.ActQConfig.from_recipe(recipe))
    model.train()
    ids = torch.randint(4, 512, (2, 24))
    labels = ids if task == "causal-lm" else torch.tensor([0, 1])
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params, model=model) as meter:
        loss = model(input_ids=ids, labels=labels).loss
    assert meter.nbytes > 0
    assert graph_saved_bytes(loss, exclude=params) == meter.nbytes
    kinds = meter.by_kind()
    assert set(kinds) <= set(OP_KINDS) and sum(kinds.values()) == meter.nbytes
    assert kinds["linear"] > 0 and kinds["attention"] > 0 and kinds["norm"] > 0


def test_op_kinds_of_common_modules():
    from transformers.activations import ACT2CLS

    gelu = ACT2CLS["gelu"]
    gelu = gelu[0]() if isinstance(gelu, tuple) else gelu()
    assert op_kind("x.dense", nn.Linear(2, 2)) == "linear"
    assert op_kind("x.LayerNorm", nn.LayerNorm(2)) == "norm"
    assert op_kind("x.act", gelu) == "activation"
    assert op_kind("x.act", nn.SiLU()) == "activation"
    assert op_kind("x.drop", nn.Dropout()) == "dropout"
    assert op_kind("x.emb", nn.Embedding(2, 2)) == "embedding"
    assert op_kind("model.layers.0.self_attn", nn.Module()) == "attention"
    assert op_kind("model.layers.0.mlp", nn.Module()) == "mlp"
    assert op_kind("model.layers.0", nn.Module()) == "other"


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "uniform"])
def test_the_monitor_meters_each_data_parallel_replica_in_its_own_thread(patched):
    """``nn.DataParallel`` runs its replicas at once, one thread each, through the model's
    hooks (which the replicas share): each replica is metered in its thread, without its
    device's weight copies. Before, one thread's meter was closed by another's forward, the
    weight copies counted as activations, and a meter was left open on the model."""
    model = tiny_llama().train()
    if patched:
        hf_actq.apply(model, bits=4)
    ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    halves = (ids[:2], ids[2:])
    alone = []
    for half in halves:
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            model(input_ids=half, labels=half)
        alone.append(meter.nbytes)
    monitor = ActivationMonitor(model)
    monitor.arm()
    replicas = replicate_with_distinct_weights(model)
    both_started = threading.Barrier(2)

    def run(replica, half):
        both_started.wait()
        replica(input_ids=half, labels=half).loss.backward()

    threads = [threading.Thread(target=run, args=pair) for pair in zip(replicas, halves)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert monitor.forwards == 2 and monitor.max_bytes == max(alone)
    monitor.disarm()
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        model(input_ids=halves[0], labels=halves[0])
    assert meter.nbytes == alone[0]  # nothing of the monitor's left on this thread
    monitor.remove()


@pytest.mark.parametrize("recipe", ["fewbit", "uniform", "alam"])
def test_the_monitor_estimates_the_unpatched_bytes_from_the_tensors_it_compressed(recipe):
    """``uncompressed_bytes``: the forward's bytes with each compressed tensor at its own size:
    about what the unpatched model keeps (within hf_actq's own small buffers above; it also
    keeps what hf_actq regenerates), close to it on an encoder, where nearly every saved tensor
    is a compressed one."""
    from hf_actq.testing import tiny_batch, tiny_model

    model, batch = tiny_model("bert").train(), tiny_batch("bert")
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        model(**batch)
    unpatched = meter.nbytes
    hf_actq.apply(model, hf_actq.ActQConfig.from_recipe(recipe, adaptive=False))
    monitor = ActivationMonitor(model)
    monitor.arm()
    model(**batch)
    assert monitor.max_bytes < monitor.uncompressed_bytes <= unpatched * 1.01
    assert (
        monitor.uncompressed_bytes
        > {"fewbit": 0.8, "uniform": 0.9, "alam": 0.9}[recipe] * unpatched
    )
