"""PackCache: shares one packed copy between consumers without keeping anything alive itself."""

import dataclasses
import gc
import threading
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.ops import dedup
from hf_actq.ops.dedup import PackCache, sharing_group
from hf_actq.ops.linear import CompressedLinear


def _qkv(cache):
    torch.manual_seed(0)
    return [CompressedLinear(nn.Linear(64, 64), uniform(4), cache) for _ in range(3)]


def test_without_checkpointing_consumers_share_one_packed_copy():
    cache = PackCache()
    q, k, v = _qkv(cache)
    x = torch.randn(8, 64, requires_grad=True)
    out = q(x) + k(x) + v(x)
    assert len(cache) == 1  # kept alive by the three autograd nodes, not by the cache
    out.sum().backward()
    del out
    assert len(cache) == 0


def test_aliases_of_an_input_share_its_packed_copy_while_its_storage_lives():
    # DeepSpeed ZeRO-3 gives every module its own detach() of each input, dropped when the
    # module returns: q, k and v each see another tensor over the same data.
    cache = PackCache()
    codec = uniform(4)
    x = torch.randn(8, 64)
    first = cache.pack(x.detach(), codec)
    again = cache.pack(x.detach(), codec)
    assert again.tensors[0] is first.tensors[0]
    # A view elsewhere in the storage, or the same data changed in place, is packed afresh.
    assert cache.pack(x[1:].detach(), codec).tensors[0] is not first.tensors[0]
    x.mul_(2)
    assert cache.pack(x.detach(), codec).tensors[0] is not first.tensors[0]


def test_a_reshape_of_a_packed_or_offered_tensor_takes_its_form_reshaped():
    # A MoE block flattens the norm's [batch, seq, hidden] output to [tokens, hidden] for its
    # router and experts: they take the form the cache holds for it (the norm's offered one in
    # a model, tests/integrations/test_more_models.py), rebuilt in their shape. A reshape of a
    # tensor the cache does not hold is packed as before, and a view of part of one is not
    # taken for it.
    cache = PackCache()
    codec = uniform(4)
    x = torch.randn(2, 6, 64)
    held = cache.pack(x, codec)
    taken = cache.pack(x.view(-1, 64), codec)
    assert all(a is b for a, b in zip(taken.tensors, held.tensors, strict=True))
    assert torch.equal(taken.unpack(), held.unpack().view(12, 64))
    assert cache.pack(x[:1].view(-1, 64), codec).tensors[0] is not held.tensors[0]
    other = torch.randn(2, 6, 64)
    fresh = cache.pack(other.view(-1, 64), codec)
    assert fresh.unpack().shape == (12, 64) and fresh.tensors[0] is not held.tensors[0]


def test_a_new_tensor_in_freed_memory_is_not_taken_for_the_old_one():
    # Two storages over one buffer, one after the other: what an allocator reusing a freed
    # block does, made certain.
    memory = bytearray(8 * 64 * 4)
    cache = PackCache()
    codec = uniform(4)
    x = torch.frombuffer(memory, dtype=torch.float32).view(8, 64)
    x.copy_(torch.randn(8, 64))
    kept = cache.pack(x, codec)  # the buffers stay alive, the input does not
    del x
    gc.collect()
    y = torch.frombuffer(memory, dtype=torch.float32).view(8, 64)
    assert cache.pack(y, codec).tensors[0] is not kept.tensors[0]


def test_non_reentrant_checkpointing_frees_what_the_first_pass_packed():
    # The layer's input is the checkpoint's own input, alive until backward; the cache used to
    # keep its packed copy alive with it, which checkpointing meant to free.
    cache = PackCache()
    q, k, v = _qkv(cache)
    x = torch.randn(8, 64, requires_grad=True)
    out = checkpoint(lambda t: q(t) + k(t) + v(t), x, use_reentrant=False)
    assert len(cache) == 0
    out.sum().backward()
    assert all(p.grad is not None for m in (q, k, v) for p in m.parameters())


class _CollectingCodec(AverageQuantCodec):
    """Runs a garbage collection whenever the cache compares codecs, as any allocation in the
    cache's own code may."""

    def __eq__(self, other):
        gc.collect()
        return super().__eq__(other)

    __hash__ = AverageQuantCodec.__hash__


def test_a_garbage_collection_inside_the_cache_does_not_deadlock():
    cache = PackCache()
    codec = _CollectingCodec(bits=4)
    kept = torch.randn(64)
    cache.pack(kept, codec)

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me, cycle.x = cycle, torch.randn(64)  # freed only by the collector
    cache.pack(cycle.x, codec)
    del cycle
    worker = threading.Thread(target=cache.pack, args=(kept, codec), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "PackCache.pack deadlocked in a garbage collection"


def test_inference_tensors_are_packed_without_caching():
    cache = PackCache()
    linear = CompressedLinear(nn.Linear(32, 32), uniform(4), cache)
    with torch.inference_mode():
        x = torch.randn(4, 32)
    linear(x).sum().backward()  # grad enabled, weight trainable: x is packed
    assert linear.weight.grad is not None and len(cache) == 0


def test_traced_packs_key_their_seeds_by_sharing_group_for_linear_inputs_only(monkeypatch):
    """Under compile, the linears of one parent (q/k/v, also through PEFT's wrappers) round
    with one seed key, so their identical pack ops merge; any other slot (a norm's input, the
    attention op's q and k, multiplied together in backward) keeps a key of its own."""
    keys = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(dedup, "traced_pack", lambda x, codec, key: keys.append(key))
    layer = "model.layers.3"
    linears = [
        f"{layer}.self_attn.q_proj:input",
        f"{layer}.self_attn.k_proj.base_layer:input",
        f"{layer}.self_attn.k_proj.lora_A.default:input",
        f"{layer}.self_attn.v_proj.lora_B.adapter_2:input",
    ]
    others = [
        f"{layer}.input_layernorm:input",
        f"{layer}.post_attention_layernorm:input",
        f"{layer}.self_attn:q",
        f"{layer}.self_attn:k",
    ]
    cache, x, codec = PackCache(), torch.randn(2, 8), uniform(4)
    for slot in linears:
        cache.pack(x, codec, slot, linear_input=True)
    for slot in others:
        cache.pack(x, codec, slot)
    assert keys == [f"{layer}.self_attn:input"] * len(linears) + others
    # Another layer's linears: another key.
    assert sharing_group(linears[0]) != sharing_group(linears[0].replace(".3.", ".4."))


def test_a_consumer_that_leaves_a_share_is_not_waited_for():
    from hf_actq.codecs.packed import UnpackShare

    packed = AverageQuantCodec(4, 1).pack(torch.randn(8, 128), seed=0)
    # Before anyone unpacked: the other consumer unpacks alone, nothing is kept.
    share = UnpackShare(consumers=2)
    object.__setattr__(packed, "_share", share)
    share.leave()
    assert share.consumers == 1
    packed.unpack()
    assert share.value is None
    # After one unpacked (kept for the second): leaving releases it.
    share = UnpackShare(consumers=2)
    object.__setattr__(packed, "_share", share)
    packed.unpack()
    assert share.value is not None
    share.leave()
    assert share.value is None


def test_the_cache_holds_a_tensor_only_while_its_packed_data_lives():
    """``holds`` (the gated product's check before it packs ``up`` in its own kernel) says what
    ``pack`` would find: not an entry a freed tensor left at the address a new one reuses."""
    cache = PackCache()
    x = torch.randn(8, 128)
    assert not cache.holds(x)
    cache.pack(x, uniform(4))
    assert cache.holds(x) and cache.holds(x.detach())  # the same data
    x.add_(1)  # changed since it was packed
    assert not cache.holds(x)
    # A freed tensor's entry under the key of a live one: as when memory is reused.
    y = torch.randn(8, 128)
    cache.pack(y, uniform(4))
    entry = cache._entries.pop(dedup._where(y))
    gone = torch.randn(3)
    dead = dataclasses.replace(entry, storage=weakref.ref(gone.untyped_storage()))
    del gone
    gc.collect()
    cache._entries[dedup._where(y)] = dead
    assert dead.storage() is None and not cache.holds(y)
