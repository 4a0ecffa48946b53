"""The packed weights' huge-page buffer (hf_sparsity.backends.arena)."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from hf_sparsity.backends import _native
from hf_sparsity.backends.arena import HUGE_PAGE, _packed_backends, huge_buffer, pack_weights
from hf_sparsity.inference import sparsify_for_inference
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine

from .conftest import tiny_model

needs_native = pytest.mark.skipif(_native.load() is None, reason="the native kernel library did not build")


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return None


def _smaps(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    inside, fields = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_huge_buffer_is_aligned_exactly_sized_and_zeroed():
    for n in (0, 1, 100, 3 * HUGE_PAGE + 5):
        t = huge_buffer(n)
        assert t.dtype == torch.uint8 and t.numel() == n
        assert t.data_ptr() % HUGE_PAGE == 0
        assert t.untyped_storage().nbytes() == max(n, 1)  # resident-memory counts see the bytes asked for
        assert int(t.count_nonzero()) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_huge_buffer_is_advised_for_huge_pages():
    t = huge_buffer(8 * HUGE_PAGE)
    t.fill_(1)
    fields = _smaps(t.data_ptr())
    # "hg": madvise(MADV_HUGEPAGE) took; whether the kernel finds free 2 MiB pages depends on its memory
    # (AnonHugePages, 16384 kB here when it does)
    assert "hg" in fields["VmFlags"].split(), fields


def _masked(arch, level=0.5):
    model = tiny_model(arch).eval()
    eng = SparsityEngine(model, SparsityConfig(sparsity=level))
    eng.build_masks()
    eng.apply()
    return model, eng


def _storages(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for b in _packed_backends(model) for t in b.storage_tensors()}


@needs_native
@pytest.mark.parametrize("values", [None, "int8"])
@pytest.mark.parametrize("backend", ["bitmask", "native_dense", "auto"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sparsify_puts_the_packed_weights_in_one_buffer_and_outputs_hold(arch, backend, values):
    model, eng = _masked(arch)
    ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    opts = {"values": values} if values else {}
    if backend == "auto":
        opts.update(formats=("bitmask",), margin=-100.0, model_tolerance=float("inf"), check=False)
        opts.update(rounds=2, sample_layers=2)  # every layer bitmask whatever the timings
    sparsify_for_inference(model, backend, masks=eng.masks, **opts)
    backends = _packed_backends(model)
    # + the LM head: int8 with int8 values (every backend), maybe the native GEMV with auto
    assert len(backends) - len(eng.masks) in ((1,) if values else (0, 1) if backend == "auto" else (0,))
    assert len(_storages(model)) == 1  # one buffer for every layer
    first = backends[0].storage_tensors()[0]
    assert first.data_ptr() % HUGE_PAGE == 0
    ptrs = [t.data_ptr() for b in backends for t in b.storage_tensors()]
    assert ptrs == sorted(ptrs), "the weights lie in module (reading) order"
    with torch.no_grad():
        got = model(ids).logits
        got1 = model(ids[:, :1]).logits  # the batch-1 call (its prepared pointers) reads the buffer
    tol = 0.15 if values else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # packing again: a fresh buffer, the same outputs bit for bit, the old pointers not reused
    old = _storages(model)
    assert pack_weights(model) > 0
    assert _storages(model) != old
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, got, rtol=0, atol=0)
        torch.testing.assert_close(model(ids[:, :1]).logits, got1, rtol=0, atol=0)


@needs_native
def test_a_packed_model_copies_and_pickles():
    model, eng = _masked("llama")
    sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int8")
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded):
        assert _storages(other).isdisjoint(_storages(model))
        with torch.no_grad():
            torch.testing.assert_close(other(ids).logits, want, rtol=0, atol=0)
    del model  # the copies own their memory
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, want, rtol=0, atol=0)


def test_nothing_to_pack():
    model = tiny_model("gpt2")
    assert pack_weights(model) == 0


@needs_native
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bytes_per_token_count_each_packed_tensor(arch):
    from hf_sparsity.inference.bench import decode_bytes_per_token

    model, eng = _masked(arch)
    sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int8")
    packed = sum(t.numel() * t.element_size() for b in _packed_backends(model) for t in b.storage_tensors())
    got = decode_bytes_per_token(model)
    # the LM head is packed too (int8); + one float embedding row, unless it reads the head's codes (tied)
    tied = type(model.get_input_embeddings()).__name__ == "Int8Embedding"
    assert tied == (arch == "gpt2") and (got == packed if tied else got > packed)
    assert decode_bytes_per_token(copy.deepcopy(model)) == got  # the same count off the shared buffer


@needs_native
@pytest.mark.parametrize("tied", [False, True])
def test_an_fp32_head_on_the_native_gemv_is_not_held_twice(tied):
    # as auto converts an fp32 LM head when its GEMV is faster: native_dense over the head's own weight,
    # the dense module kept for restore_dense
    from hf_sparsity.backends import get_backend
    from hf_sparsity.inference import SparseLinear, resident_weight_bytes
    from hf_sparsity.modeling import replace_module

    model, eng = _masked("llama")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    sparsify_for_inference(model, "bitmask", masks=eng.masks)
    head = model.lm_head
    gemv = get_backend("native_dense").from_dense(
        head.weight.detach(), torch.ones_like(head.weight, dtype=torch.uint8)
    )
    assert gemv.values.data_ptr() == head.weight.data_ptr()
    replace_module(model, "lm_head", SparseLinear(head, gemv, keep_dense=True))
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    before = resident_weight_bytes(model)
    pack_weights(model)
    # moved with the head's weight (and the embedding it is tied to): one place, on the buffer
    assert gemv.values.data_ptr() == head.weight.data_ptr()
    assert len(_storages(model)) == 1
    if tied:
        assert model.model.embed_tokens.weight.data_ptr() == gemv.values.data_ptr()
        assert model.model.embed_tokens.weight is head.weight  # still one parameter
    assert resident_weight_bytes(model) <= before
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)


@needs_native
def test_no_buffer_leaves_the_converted_model_working(monkeypatch, caplog):
    import hf_sparsity.backends.arena as arena

    def refuse(nbytes):
        raise OSError("Cannot allocate memory")

    monkeypatch.setattr(arena, "huge_buffer", refuse)
    model, eng = _masked("llama")
    ids = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    with caplog.at_level("WARNING"):
        sparsify_for_inference(model, "bitmask", masks=eng.masks)
    assert "stay where they are" in caplog.text
    assert len(_storages(model)) == 3 * len(eng.masks)  # each tensor its own, as converted
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
