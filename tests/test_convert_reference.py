"""`convert_hf(..., reference=True)` copies no weight the source holds as eprt reads it: the checkpoint
reads the source's files in place (stacked experts from their per-expert pieces), every tensor reads
as from a copied conversion, every export is the same bytes, and a changed or missing source is refused."""

import filecmp
import os
import shutil

import pytest
import torch

from eprt.errors import CheckpointError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.storage.pins import SOURCE
from eprt.testing.tiny import make_tiny

SOURCES = {
    "qwen3_moe": dict(family="qwen3_moe"),
    "qwen3_5_moe": dict(family="qwen3_5_moe"),  # experts held fused, one tensor per projection
    "deepseek_v3": dict(family="deepseek_v3"),  # with its MTP layer, carried through
}
ENCODED = {
    "int4": dict(family="deepseek_v3", source_format="int4", model_type="kimi_k2", num_nextn_predict_layers=0),
    "fp8-block": dict(
        family="deepseek_v3",
        source_format="fp8-block",
        hidden_size=192,
        intermediate_size=304,
        moe_intermediate_size=144,
    ),
}


def converted(tmp_path, family, shards=3, **kw):
    src = make_tiny(family, str(tmp_path / "hf"), shards=shards, **kw)
    return (
        src,
        convert_hf(src, str(tmp_path / "copy"), progress=False),
        convert_hf(src, str(tmp_path / "ref"), progress=False, reference=True),
    )


def same_files(a: str, b: str) -> None:
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for f in os.listdir(a):
        assert filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False), f


def check_reads_and_exports(tmp_path, copy: str, ref: str) -> None:
    assert sorted(os.listdir(ref)) == [MANIFEST, "hf"]  # no weight of its own
    with Checkpoint(copy) as a, Checkpoint(ref) as b:
        assert list(a.tensors) == list(b.tensors)
        assert all(f.startswith(SOURCE) for f in b.weight_files())
        for name, meta in a.tensors.items():
            assert torch.equal(a.read(name), b.read(name)), name
            if len(meta.shape) == 3 and meta.shape[0] > 2:  # a rank's rows of stacked experts
                assert torch.equal(a.read(name, rows=(1, 3)), b.read(name, rows=(1, 3))), name
                for c in meta.components or {}:
                    assert torch.equal(a.read_component(name, c, (1, 3)), b.read_component(name, c, (1, 3)))
    export_hf(copy, str(tmp_path / "e-copy"), max_shard_bytes=200_000, progress=False)
    export_hf(ref, str(tmp_path / "e-ref"), max_shard_bytes=200_000, progress=False)
    same_files(str(tmp_path / "e-copy"), str(tmp_path / "e-ref"))


@pytest.mark.parametrize("which", sorted(SOURCES))
def test_a_referencing_checkpoint_reads_and_exports_as_a_copy(tmp_path, which):
    _, copy, ref = converted(tmp_path, **SOURCES[which])
    check_reads_and_exports(tmp_path, copy, ref)
    export_hf(copy, str(tmp_path / "q-copy"), recipe="fp8_block", progress=False)
    export_hf(ref, str(tmp_path / "q-ref"), recipe="fp8_block", progress=False)
    same_files(str(tmp_path / "q-copy"), str(tmp_path / "q-ref"))


@pytest.mark.parametrize("which", sorted(ENCODED))
def test_encoded_sources_are_read_in_place(tmp_path, which):
    if which == "int4":
        pytest.importorskip("compressed_tensors")
    _, copy, ref = converted(tmp_path, shards=2, **ENCODED[which])
    check_reads_and_exports(tmp_path, copy, ref)


def test_a_changed_source_is_refused(tmp_path):
    src, _, ref = converted(tmp_path, "qwen3_moe")
    shard = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[1]
    st = os.stat(os.path.join(src, shard))
    os.utime(os.path.join(src, shard), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match=f"{shard}.*changed since conversion \\(mtime_ns differ"):
        Checkpoint(ref)


def test_a_source_moved_with_its_checkpoint_is_found_and_one_gone_is_refused(tmp_path):
    _, _, ref = converted(tmp_path, "qwen3_moe")
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(tmp_path / "hf", moved / "hf", copy_function=shutil.copy2)  # keeps the files' times
    shutil.move(ref, moved / "ref")
    with Checkpoint(str(moved / "ref")) as ck:
        assert ck.source_dir == str(moved / "hf")
        ck.read("model.layers.0.mlp.experts.w13")
    shutil.rmtree(moved / "hf")
    shutil.rmtree(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="source checkpoint whose weight files it reads is gone"):
        Checkpoint(str(moved / "ref"))


def test_a_cast_tensor_is_written_and_the_rest_referenced(tmp_path):
    src = make_tiny("deepseek_v3", str(tmp_path / "hf"), dtype="fp32")
    ref = convert_hf(src, str(tmp_path / "ref"), dtype="bf16", progress=False, reference=True)
    with Checkpoint(ref) as ck:
        in_place = {n for n, t in ck.tensors.items() if all(p.file.startswith(SOURCE) for p in t.parts)}
        # what the reference keeps in fp32 under --dtype bf16 (routers, the correction bias): read in place
        assert in_place == {n for n, t in ck.tensors.items() if t.dtype == torch.float32}
        assert any(n.endswith("e_score_correction_bias") for n in in_place)
        assert all(ck.read(n).dtype == torch.bfloat16 for n in ck.tensors if n not in in_place)
