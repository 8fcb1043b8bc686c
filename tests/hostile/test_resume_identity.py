"""A resumed or finished calibration belongs to exactly one model, recipe and data.

A --resume continues only a run of the same base weights, recipe rules, tokens (and their shape)
and options, and refuses anything else by name; a truncated work file is refused by path. A base
that changes while a run reads it is refused, not mixed into a calibration of two models; ranks
that read different checkpoints or data are refused before the first layer. Each work file is
durable before it takes its layer's name, and the previous layer is dropped only after."""

import os
import shutil
from datetime import timedelta

import numpy as np
import pytest

from eprt.errors import EprtError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hostile.test_workdir_safety import stop_after_layer
from tests.multiproc import run_world

RECIPE = "quantize:\n- pattern: '*'\n  format: {fmt}\n"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    ck = convert_hf(make_tiny("qwen3_moe", str(root / "hf")), str(root / "ck"), progress=False)
    other = convert_hf(make_tiny("qwen3_moe", str(root / "hf-other"), seed=1), str(root / "ck-other"), progress=False)
    return {"ck": ck, "other": other}


def args(ck, out, recipe, calib, **kw):
    kw = {"calib_size": 4, "seq_len": 16, **kw}
    return PTQArgs(ck, str(recipe), str(out), calib=str(calib), eval_size=0, progress=False, **kw)


def setup(made, tmp_path):
    ck = shutil.copytree(made["ck"], tmp_path / "ck", symlinks=True)  # keeps times, as cp -a
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(fmt="fp8"))
    calib = tmp_path / "ids.npy"
    np.save(calib, np.arange(64, dtype=np.int64) % 500)
    return str(ck), recipe, calib


def stopped_after_layer(a: PTQArgs, layer: int) -> None:
    """A run that stops once `layer` is saved, as a killed one does: its work directory stays."""
    stop_after_layer(lambda: run_ptq(ParallelState.single("cpu"), a), layer)
    assert os.listdir(f"{a.out}.work/rank-00000") == [f"layer-{layer:05d}.safetensors"]


def touch_later(path: str) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def edit_recipe(ck, recipe, calib):
    recipe.write_text(RECIPE.format(fmt="nvfp4"))
    return {}, "the recipe's rules"


def edit_base_weight(ck, recipe, calib):
    touch_later(os.path.join(ck, "layer-00000.safetensors"))  # written in place: its time moves
    return {}, f"the base's weight file {ck}/layer-00000.safetensors (mtime_ns)"


def reconvert_base(ck, recipe, calib):
    return "reconvert", f"the base's weight file {ck}/layer-00000.safetensors"


def reshape_data(ck, recipe, calib):  # the same 64 tokens as 8 sequences of 8
    return {"calib_size": 8, "seq_len": 8}, "the calibration data (sequences x tokens [4, 16], now [8, 8])"


def other_option(ck, recipe, calib):
    return {"dtype": "fp32"}, "--dtype (bf16, now fp32)"


@pytest.mark.parametrize("change", [edit_recipe, edit_base_weight, reconvert_base, reshape_data, other_option])
def test_a_resume_after_a_change_is_refused_naming_it(made, tmp_path, change):
    ck, recipe, calib = setup(made, tmp_path)
    out = tmp_path / "q"
    stopped_after_layer(args(ck, out, recipe, calib), 0)
    kw, named = change(ck, recipe, calib)
    if kw == "reconvert":  # the base converted again in place, from another model
        shutil.rmtree(ck)
        shutil.copytree(made["other"], ck, symlinks=True)
        kw = {}
    with pytest.raises(EprtError, match="saved by a run with other arguments or inputs") as e:
        run_ptq(ParallelState.single("cpu"), args(ck, out, recipe, calib, resume=True, **kw))
    assert named in str(e.value) and "run without --resume" in str(e.value)
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "kw, named",
    [({"seed": 3}, "--seed (None, now 3)"), ({"calib_rows": "truncate"}, "--calib-rows (pack, now truncate)")],
)
def test_a_resume_that_samples_the_documents_otherwise_is_refused_naming_the_flag(made, tmp_path, kw, named):
    ck, recipe, _ = setup(made, tmp_path)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(f'{{"text": "document {i} says {" and ".join(["more"] * (i % 7 + 3))}"}}\n' for i in range(40))
    )
    out = tmp_path / "q"
    stopped_after_layer(args(ck, out, recipe, docs), 0)
    with pytest.raises(EprtError, match="saved by a run with other arguments or inputs") as e:
        run_ptq(ParallelState.single("cpu"), args(ck, out, recipe, docs, resume=True, **kw))
    assert named in str(e.value)


def test_a_truncated_work_file_is_refused_by_path(made, tmp_path):
    ck, recipe, calib = setup(made, tmp_path)
    out = tmp_path / "q"
    stopped_after_layer(args(ck, out, recipe, calib), 1)
    saved = f"{out}.work/rank-00000/layer-00001.safetensors"
    os.truncate(saved, os.path.getsize(saved) // 2)
    with pytest.raises(EprtError, match=rf"{saved}: the saved layer is truncated or corrupt .*run without --resume"):
        run_ptq(ParallelState.single("cpu"), args(ck, out, recipe, calib, resume=True))
    assert not os.path.exists(out)


@pytest.mark.parametrize("when", ["before it is read", "after it is read"])
def test_a_base_converted_again_during_the_run_is_refused(made, tmp_path, when):
    """The base is converted again in place (from another model, with the same manifest) while
    the run is in layer 1: layer 2's file is another model's before the run reads it, or layer 0's
    after. The run refuses, naming the file, and writes nothing."""
    ck, recipe, calib = setup(made, tmp_path)
    changed = "layer-00002.safetensors" if when == "before it is read" else "layer-00000.safetensors"
    run_layer = LayerEngine.run_layer

    def reconverted_in_layer_1(self, i, ls, pb):
        if i == 1:
            os.replace(
                shutil.copy(os.path.join(made["other"], changed), os.path.join(ck, changed + ".new")),
                os.path.join(ck, changed),
            )
        return run_layer(self, i, ls, pb)

    out = tmp_path / "q"
    LayerEngine.run_layer = reconverted_in_layer_1
    try:
        with pytest.raises(EprtError, match=rf"{ck}/{changed} changed .*calibrate again"):
            run_ptq(ParallelState.single("cpu"), args(ck, out, recipe, calib))
    finally:
        LayerEngine.run_layer = run_layer
    assert not os.path.exists(out)


def test_a_finished_calibration_pins_the_base_it_read(made, tmp_path):
    ck, recipe, calib = setup(made, tmp_path)
    out = tmp_path / "q"
    run_ptq(ParallelState.single("cpu"), args(ck, out, recipe, calib))
    touch_later(os.path.join(ck, "layer-00001.safetensors"))
    with pytest.raises(EprtError, match="layer-00001.safetensors changed since calibration"):
        export_hf(str(out), str(tmp_path / "export"), progress=False)


def each_rank_its_own(cks: list[str], out: str, calibs: list[str], recipe: str):
    rank = int(os.environ["RANK"])
    with ParallelState.from_env(timeout=timedelta(seconds=60)) as state:
        run_ptq(
            state,
            PTQArgs(cks[rank], recipe, out, calib=calibs[rank], calib_size=4, seq_len=16, eval_size=0, progress=False),
        )


@pytest.mark.parametrize("stale", ["checkpoint", "data"])
def test_ranks_reading_different_inputs_are_refused_before_the_first_layer(made, tmp_path, stale):
    ck, recipe, calib = setup(made, tmp_path)
    node1 = tmp_path / "node1"
    os.makedirs(node1)
    ck1, calib1 = shutil.copytree(ck, node1 / "ck", symlinks=True), node1 / "ids.npy"
    shutil.copy2(calib, calib1)
    if stale == "checkpoint":  # node 1's copy holds another conversion's layer 1
        shutil.copy2(os.path.join(made["other"], "layer-00001.safetensors"), ck1 / "layer-00001.safetensors")
        named = "the base's weight file"
    else:
        np.save(calib1, (np.arange(64, dtype=np.int64) + 1) % 500)
        named = "the calibration data's tokens"
    out = str(tmp_path / "q")
    with pytest.raises(AssertionError, match=f"rank 1 reads other inputs than rank 0: {named}") as e:
        run_world(each_rank_its_own, 2, [ck, str(ck1)], out, [str(calib), str(calib1)], str(recipe), timeout=120)
    assert "calibrating" not in str(e.value).split("reads other inputs")[0]
    assert not os.path.exists(out) and not os.path.exists(out + ".work")


def test_a_work_file_is_durable_before_it_replaces_the_previous_layer(made, tmp_path, monkeypatch):
    """Each work file is synced before it takes its layer's name, and its directory synced
    before the previous layer's file is removed: a crash at any moment leaves a whole layer."""
    ck, recipe, calib = setup(made, tmp_path)
    events = []
    fsync, rename, remove = os.fsync, os.rename, os.remove
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))[1]
    )
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a), str(b))), rename(a, b))[1])
    monkeypatch.setattr(os, "remove", lambda p: (events.append(("remove", str(p))), remove(p))[1])
    out = tmp_path / "q"
    stopped_after_layer(args(ck, out, recipe, calib), 1)
    rank_dir = os.path.realpath(f"{out}.work/rank-00000")
    layer = lambda i: os.path.join(rank_dir, f"layer-{i:05d}.safetensors")  # noqa: E731

    def put(i):  # where the layer's file took its name, from the new file written beside it
        [(at, partial)] = [(n, e[1]) for n, e in enumerate(events) if e[0] == "rename" and e[2] == layer(i)]
        assert os.path.basename(partial).startswith(f".layer-{i:05d}.safetensors.partial-")
        assert ("fsync", partial) in events[:at], i
        return at

    put(0)
    dropped = events.index(("remove", layer(0)))
    renamed = put(1)
    assert ("fsync", rank_dir) in events[renamed:dropped]
