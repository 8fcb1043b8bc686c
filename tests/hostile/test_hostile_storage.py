"""Hostile or careless checkpoints and outputs: nothing runs code, no path escapes its directory,
no data is destroyed, stale calibration is not applied, corrupt safetensors are not read. Each
refusal is one line naming the culprit, and leaves the inputs as they were."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors import SafetensorError, safe_open

from eprt.errors import CheckpointError, EprtError, OutputExistsError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.atomic import atomic_output_dir
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.storage.safetensors_io import SafetensorsFile
from eprt.testing.tiny import TINY_DIR, make_tiny
from tests.hf_utils import tree_digest

INDEX = "model.safetensors.index.json"
SHARD = "model.safetensors"
KIMI_K2 = dict(model_type="kimi_k2", num_nextn_predict_layers=0)
PLUGIN = "plugin.py:payload"  # compressed-tensors' registry imports and runs plugin.py for this name


def calibrate(ck: str, out: str, **kw) -> str:
    run_ptq(ParallelState.single("cpu"), PTQArgs(ck, "fp8", out, calib_size=2, seq_len=8, progress=False, **kw))
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    hf = make_tiny("qwen3_moe", str(root / "hf"), shards=2)
    ck = convert_hf(hf, str(root / "ck"), progress=False)
    return {"root": str(root), "hf": hf, "ck": ck, "cal": calibrate(ck, str(root / "cal"))}


def copy_tree(src: str, dst) -> str:
    """A copy that keeps links as links and files' times, as `cp -a` does."""
    shutil.copytree(src, str(dst), symlinks=True)
    return str(dst)


def copy_calibrated(made, dst) -> tuple[str, str]:
    """The base and its calibrated checkpoint, side by side under `dst`."""
    return copy_tree(made["ck"], dst / "ck"), copy_tree(made["cal"], dst / "cal")


def edit_json(path: str, fn) -> None:
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


# --- 1. no checkpoint value makes eprt import and run a file ---------------------------------


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """plugin.py in the working directory, which leaves a mark when it is run."""
    pytest.importorskip("compressed_tensors")
    mark = tmp_path / "plugin-ran"
    (tmp_path / "plugin.py").write_text(f"open({str(mark)!r}, 'w').close()\npayload = object\n")
    monkeypatch.chdir(tmp_path)
    return mark


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("int4")
    hf = make_tiny("deepseek_v3", str(root / "hf"), source_format="int4", **KIMI_K2)
    return hf, convert_hf(hf, str(root / "ck"), progress=False)


def test_a_quantization_config_format_naming_a_python_file_is_refused_at_convert(int4, plugin, tmp_path):
    hf = copy_tree(int4[0], tmp_path / "hf")

    def plant(cfg):  # a group without a format of its own takes the top level's, which the library does not check
        qc = cfg["quantization_config"]
        qc["format"] = PLUGIN
        for g in qc["config_groups"].values():
            g.pop("format", None)

    edit_json(os.path.join(hf, "config.json"), plant)
    with pytest.raises(
        EprtError,
        match=r"config\.json \(quantization_config\) format: "
        r"compressed-tensors format 'plugin\.py:payload' is not one eprt decodes",
    ) as e:
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    one_line(e)
    assert not plugin.exists()
    assert not (tmp_path / "ck").exists()


def test_a_manifest_encoding_naming_a_python_file_is_refused_on_open(int4, plugin, tmp_path):
    ck = copy_tree(int4[1], tmp_path / "ck")

    def plant(m):
        for t in m["tensors"].values():
            if t["encoding"].startswith("compressed-tensors/"):
                t["encoding"] = "compressed-tensors/" + PLUGIN

    edit_json(os.path.join(ck, MANIFEST), plant)
    with pytest.raises(
        CheckpointError,
        match=r"eprt\.json: .* has encoding 'compressed-tensors/plugin\.py:payload', "
        r"which this eprt does not read",
    ) as e:
        with Checkpoint(ck) as c:
            c.check_decode()
    one_line(e)
    assert not plugin.exists()


# --- 2. every path a checkpoint names stays inside its directory -----------------------------


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(made, tmp_path, where):
    hf = copy_tree(made["hf"], tmp_path / "hf")
    shard = "model-00002-of-00002.safetensors"
    os.rename(os.path.join(hf, shard), tmp_path / "outside.safetensors")
    named = "../outside.safetensors" if where == "parent" else str(tmp_path / "outside.safetensors")
    edit_json(
        os.path.join(hf, INDEX),
        lambda d: d["weight_map"].update({n: named for n, f in d["weight_map"].items() if f == shard}),
    )
    with pytest.raises(CheckpointError, match=rf"{INDEX}: names the path '{named}', which leaves its directory") as e:
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    one_line(e)


def test_a_shard_linked_outside_the_directory_is_refused(made, tmp_path):
    hf = copy_tree(made["hf"], tmp_path / "hf")
    shard = "model-00002-of-00002.safetensors"
    os.rename(os.path.join(hf, shard), tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", os.path.join(hf, shard))
    with pytest.raises(CheckpointError, match=rf"{shard} links to .*elsewhere\.safetensors, outside {hf}"):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)


def test_a_non_weight_file_linked_outside_the_directory_is_refused_not_copied(made, tmp_path):
    hf = copy_tree(made["hf"], tmp_path / "hf")
    (tmp_path / "secret").write_text("not the model's")
    os.symlink(tmp_path / "secret", os.path.join(hf, "notes.txt"))
    with pytest.raises(CheckpointError, match=r"notes\.txt links to .*secret, outside"):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert not (tmp_path / "ck").exists()


def hf_cache_snapshot(hf: str, root) -> tuple:
    """`hf` as the Hugging Face cache stores it: (repository directory, snapshot directory)."""
    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    os.makedirs(repo / "blobs")
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(hf))):
        shutil.copyfile(os.path.join(hf, name), repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    return repo, snapshot


def test_a_hugging_face_cache_snapshot_linking_into_its_blobs_converts_as_the_files_do(made, tmp_path):
    """The cache's own layout: snapshots/REV/FILE -> ../../blobs/HASH, inside the repository's directory."""
    _, snapshot = hf_cache_snapshot(made["hf"], tmp_path)
    ck = convert_hf(str(snapshot), str(tmp_path / "ck"), progress=False)
    assert tree_digest(ck).keys() == tree_digest(made["ck"]).keys()
    for rel in tree_digest(ck):
        assert open(os.path.join(ck, rel), "rb").read() == open(os.path.join(made["ck"], rel), "rb").read(), rel


def test_carried_files_linked_outside_the_checkpoint_are_refused_not_exported(made, tmp_path):
    ck = copy_tree(made["ck"], tmp_path / "ck")
    shutil.move(os.path.join(ck, "hf"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(ck, "hf"))
    with pytest.raises(EprtError, match=rf"eprt\.json: hf links to .*elsewhere, outside {ck}") as e:
        export_hf(ck, str(tmp_path / "out"), progress=False)
    one_line(e)
    assert not (tmp_path / "out").exists()


def test_a_manifest_file_entry_leaving_the_directory_writes_nothing_outside_the_export(made, tmp_path):
    ck = copy_tree(made["ck"], tmp_path / "ck")
    (tmp_path / "ck" / "payload.sh").write_text("echo owned\n")
    edit_json(os.path.join(ck, MANIFEST), lambda m: m["files"].append("a/../../payload.sh"))
    out = tmp_path / "exports" / "out"
    os.makedirs(out.parent)
    with pytest.raises(
        EprtError,
        match=r"eprt\.json \(files\): names the path 'a/\.\./\.\./payload\.sh', "
        r"which leaves its directory",
    ):
        export_hf(ck, str(out), progress=False)
    assert os.listdir(out.parent) == []


def test_a_manifest_weight_file_leaving_the_directory_is_refused(made, tmp_path):
    ck = copy_tree(made["ck"], tmp_path / "ck")
    shutil.copyfile(os.path.join(ck, "layer-00000.safetensors"), tmp_path / "outside.safetensors")

    def plant(m):
        for t in m["tensors"].values():
            for p in t["parts"]:
                if p["file"] == "layer-00000.safetensors":
                    p["file"] = "../outside.safetensors"

    edit_json(os.path.join(ck, MANIFEST), plant)
    with pytest.raises(CheckpointError, match=r"names the path '\.\./outside\.safetensors', which leaves"):
        Checkpoint(ck)


# --- 3. no writer destroys what it reads, or what it did not create --------------------------


def test_ptq_refuses_an_output_inside_or_over_its_input(made, tmp_path):
    ck = copy_tree(made["ck"], tmp_path / "ck")
    before = tree_digest(ck)
    for out, overwrite in ((os.path.join(ck, "cal"), False), (ck, True)):
        with pytest.raises(EprtError, match=rf"output {ck}\S* overlaps the input {ck}, which this run reads"):
            calibrate(ck, out, overwrite=overwrite)
        assert tree_digest(ck) == before


def test_export_of_a_calibrated_checkpoint_refuses_its_base_as_output(made, tmp_path):
    ck, cal = copy_calibrated(made, tmp_path)
    before = tree_digest(ck)
    for out in (ck, os.path.join(ck, "export")):
        with pytest.raises(EprtError, match=rf"output {ck}\S* overlaps the input {ck}, which this run reads"):
            export_hf(cal, out, overwrite=True, progress=False)
        assert tree_digest(ck) == before


def test_convert_refuses_an_output_over_the_hugging_face_cache_blobs_it_reads(made, tmp_path):
    repo, snapshot = hf_cache_snapshot(made["hf"], tmp_path)
    before = tree_digest(str(repo))
    with pytest.raises(EprtError, match=rf"output {repo}/blobs overlaps the input {repo}/blobs, which this run reads"):
        convert_hf(str(snapshot), str(repo / "blobs"), overwrite=True, progress=False)
    assert tree_digest(str(repo)) == before


def test_make_tiny_refuses_an_output_inside_its_own_inputs():
    out = os.path.join(TINY_DIR, "hostile-out")
    try:
        with pytest.raises(EprtError, match=r"overlaps the input .*configs/tiny"):
            make_tiny("qwen3_moe", out)
        assert not os.path.exists(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_overwrite_leaves_a_users_own_old_directory_alone(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(str(out)) as tmp:
        open(os.path.join(tmp, "first"), "w").close()
    os.makedirs(tmp_path / "out.old")
    (tmp_path / "out.old" / "mine").write_text("keep")
    with atomic_output_dir(str(out), overwrite=True) as tmp:
        open(os.path.join(tmp, "second"), "w").close()
    assert os.listdir(out) == ["second"]
    assert (tmp_path / "out.old" / "mine").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["out", "out.old"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_runs_writing_one_output_at_once_do_not_share_a_temp_directory(tmp_path, overwrite):
    """The second run starts and finishes while the first writes: the first then replaces its
    output only with overwrite, and refuses by name without."""
    out = str(tmp_path / "out")

    def first():
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            with atomic_output_dir(out) as tmp2:
                open(os.path.join(tmp2, "second"), "w").close()
            open(os.path.join(tmp, "first"), "w").close()

    if overwrite:
        first()
        assert os.listdir(out) == ["first"]
    else:
        with pytest.raises(OutputExistsError, match=rf"output {out} appeared, not empty, while this run wrote it"):
            first()
        assert os.listdir(out) == ["second"]
    assert os.listdir(tmp_path) == ["out"]


# --- 4. a calibration is applied only to the weights it was made on --------------------------


def test_a_copy_of_base_and_calibration_keeping_times_exports(made, tmp_path):
    _, cal = copy_calibrated(made, tmp_path)
    export_hf(cal, str(tmp_path / "out"), progress=False)


def test_a_base_whose_weights_changed_in_place_is_refused(made, tmp_path):
    ck, cal = copy_calibrated(made, tmp_path)
    path = os.path.join(ck, "layer-00001.safetensors")
    with SafetensorsFile(path) as f:
        info = next(iter(f.tensors.values()))
    with open(path, "r+b") as fh:  # same size, same header: one weight's bytes negated
        fh.seek(info.start)
        data = fh.read(info.nbytes)
        fh.seek(info.start)
        fh.write(bytes(b ^ 0x80 for b in data))
    with pytest.raises(
        EprtError,
        match=rf"base's weight file {path} changed since calibration "
        r"\(mtime_ns, sampled_sha256 differ\).*calibrate again",
    ) as e:
        export_hf(cal, str(tmp_path / "out"), progress=False)
    one_line(e)
    assert not (tmp_path / "out").exists()


def test_a_base_converted_again_from_another_model_is_refused(made, tmp_path):
    ck, cal = copy_calibrated(made, tmp_path)
    other = make_tiny("qwen3_moe", str(tmp_path / "other-hf"), shards=2, seed=1)
    other_ck = convert_hf(other, str(tmp_path / "other-ck"), progress=False)
    assert open(os.path.join(other_ck, MANIFEST)).read() == open(os.path.join(ck, MANIFEST)).read()
    shutil.rmtree(ck)
    copy_tree(other_ck, ck)
    with pytest.raises(EprtError, match=r"changed since calibration \(.*sampled_sha256 differ\)"):
        export_hf(cal, str(tmp_path / "out"), progress=False)


# --- 5. safetensors whose tensors do not tile the data exactly -------------------------------


def rewrite_header(path: str, fn, extra: bytes = b"") -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data + extra)


def library_refuses(path: str) -> bool:
    try:
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except SafetensorError:
        return True
    return False


def test_an_up_projection_sharing_its_gate_s_bytes_is_refused(made, tmp_path):
    """Expert 0's up read from gate's bytes (its own bytes left uncovered) would convert into a
    stacked expert whose up equals its gate."""
    hf = copy_tree(made["hf"], tmp_path / "hf")
    gate, up = (f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up"))
    shard = json.load(open(os.path.join(hf, INDEX)))["weight_map"][up]
    path = os.path.join(hf, shard)
    rewrite_header(path, lambda h: h[up].update(data_offsets=h[gate]["data_offsets"]))
    assert library_refuses(path)
    with pytest.raises(CheckpointError, match=rf"{path}: tensor '{up}' overlaps tensor '{gate}'") as e:
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    one_line(e)


@pytest.mark.parametrize("where", ["trailing", "between"])
def test_bytes_no_tensor_covers_are_refused(tmp_path, where):
    path = str(tmp_path / "x.safetensors")
    from safetensors.torch import save_file

    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, path)
    if where == "trailing":
        rewrite_header(path, lambda h: None, extra=b"\0" * 16)
        message = r"the last 16 bytes of the file belong to no tensor"
    else:  # a (16 bytes) then b (8 bytes): b moved 8 bytes on, over 8 added bytes

        def move_b(h):
            h["b"]["data_offsets"] = [24, 32]

        rewrite_header(path, move_b, extra=b"\0" * 8)
        message = r"bytes \[16, 24\) of the data, before tensor 'b', belong to no tensor"
    assert library_refuses(path)
    with pytest.raises(CheckpointError, match=rf"{path}: {message}"):
        SafetensorsFile(path)
