"""The mask reader refuses every file it cannot trust: wrong format, newer version, tensors
disagreeing with the metadata, nonzero counts that do not match."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_sparsity.storage.masks_file import load_masks, read_mask_metadata, save_masks
from hf_sparsity.utils import SparsityError

MASKS = {
    "a.weight": (torch.rand(6, 20) > 0.5).to(torch.uint8),
    "b.weight": torch.ones(4, 9, dtype=torch.uint8),
}


def _rewrite(path, edit_meta=None, edit_tensors=None):
    """Rewrite a mask file with its metadata / packed tensors edited (as a corrupt or foreign file would
    be)."""
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, path, metadata=meta)


@pytest.fixture
def mask_file(tmp_path):
    return save_masks(tmp_path / "m.safetensors", MASKS)


def test_round_trip_is_exact(mask_file):
    loaded, meta = load_masks(mask_file)
    assert set(loaded) == set(MASKS) and all(torch.equal(loaded[k], MASKS[k]) for k in MASKS)
    assert meta["format"] == "hf_sparsity.masks" and meta["format_version"] == "1"


def test_nonzero_count_mismatch_is_refused(mask_file):
    def bump(meta):
        info = json.loads(meta["tensors"])
        info["a.weight"]["nonzeros"] += 1
        meta["tensors"] = json.dumps(info)

    _rewrite(mask_file, edit_meta=bump)
    with pytest.raises(SparsityError, match="nonzeros"):
        load_masks(mask_file)


def test_flipped_bit_is_refused(mask_file):
    def flip(tensors):
        tensors["a.weight"][0, 0] ^= 1  # one packed bit flipped: the count no longer matches

    _rewrite(mask_file, edit_tensors=flip)
    with pytest.raises(SparsityError, match="corrupt"):
        load_masks(mask_file)


@pytest.mark.parametrize("name", ["safetensors", "", "hf_sparsity.mask"])
def test_other_format_name_is_refused(mask_file, name):
    _rewrite(mask_file, edit_meta=lambda m: m.update(format=name))
    with pytest.raises(SparsityError, match="not an hf_sparsity mask file"):
        read_mask_metadata(mask_file)
    with pytest.raises(SparsityError, match="not an hf_sparsity mask file"):
        load_masks(mask_file)


def test_newer_format_version_is_refused(mask_file):
    _rewrite(mask_file, edit_meta=lambda m: m.update(format_version="2"))
    with pytest.raises(SparsityError, match="version 2.*Upgrade"):
        load_masks(mask_file)


def test_metadata_naming_a_missing_tensor_is_refused(mask_file):
    _rewrite(mask_file, edit_tensors=lambda t: t.pop("b.weight"))
    with pytest.raises(SparsityError, match="disagree"):
        load_masks(mask_file)


def test_tensor_absent_from_metadata_is_refused(mask_file):
    def drop(meta):
        info = json.loads(meta["tensors"])
        info.pop("b.weight")
        meta["tensors"] = json.dumps(info)

    _rewrite(mask_file, edit_meta=drop)
    with pytest.raises(SparsityError, match="disagree"):
        load_masks(mask_file)


def test_file_carries_a_checksum(mask_file):
    meta = read_mask_metadata(mask_file)
    assert meta["checksum"].startswith("sha256:") and len(meta["checksum"]) == len("sha256:") + 64


def _swap_two_bits(tensors):
    """Swap a kept and a pruned bit of a.weight: every nonzero count stays the same."""
    packed = tensors["a.weight"]
    for i, byte in enumerate(packed.flatten().tolist()):
        if (byte & 1) != ((byte >> 1) & 1):
            packed.view(-1)[i] = byte ^ 0b11
            return
    raise AssertionError("no byte with two differing low bits")


def test_two_swapped_bits_are_refused(mask_file):
    """Only the checksum catches a change that keeps the counts."""
    _rewrite(mask_file, edit_tensors=_swap_two_bits)
    meta = read_mask_metadata(mask_file)  # the metadata alone still looks fine
    assert meta["tensors"]["a.weight"]["nonzeros"] == int(MASKS["a.weight"].sum())
    with pytest.raises(SparsityError) as err:
        load_masks(mask_file)
    msg = str(err.value)
    assert str(mask_file) in msg and "is corrupt" in msg and "checksum" in msg and "Restore it" in msg


def test_file_without_checksum_loads_with_one_warning(tmp_path, caplog):
    """Files written before checksums existed still load; the warning comes once per file."""
    path = save_masks(tmp_path / "old.safetensors", MASKS)
    _rewrite(path, edit_meta=lambda meta: meta.pop("checksum"))
    with caplog.at_level("WARNING", logger="hf_sparsity"):
        loaded, _ = load_masks(path)
        load_masks(path)
    assert all(torch.equal(loaded[k], MASKS[k]) for k in MASKS)
    warned = [r for r in caplog.records if "has no checksum" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0].getMessage()


def test_mask_reader_verifies_the_checksum(tmp_path):
    """Conversions read masks one at a time through MaskReader; it refuses a corrupt file up front."""
    from hf_sparsity.constants import SPARSITY_MASKS_NAME
    from hf_sparsity.storage.folders import MaskReader

    path = save_masks(tmp_path / SPARSITY_MASKS_NAME, MASKS)
    assert torch.equal(MaskReader(tmp_path).get("a.weight"), MASKS["a.weight"])
    _rewrite(path, edit_tensors=_swap_two_bits)
    with pytest.raises(SparsityError, match="is corrupt"):
        MaskReader(tmp_path)
