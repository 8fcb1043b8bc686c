"""GPT-OSS exported in its release's own MXFP4 layout (`--format mxfp4`, recipe mxfp4_experts_only):
the routed experts as `gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales` (gate and up
interleaved), everything else as the source stores it, config.json with the release's
quantization_config: what vLLM's GPT-OSS class loads as it loads the release."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save

from eprt.errors import ConfigError
from eprt.hf.check_engine_quirks import engine_warnings
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel.state import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.encodings import without_quantization
from eprt.storage.mxfp4_blocks import RELEASE_QUANTIZATION_CONFIG, decode_mxfp4_blocks
from eprt.testing.tiny import make_tiny, released
from tests.formats_helpers import ct_scheme, decompressed, fake_quantized_model
from tests.hf_utils import raw, read_hf_tensors

FAMILY, LAYERS, RECIPE = "gpt_oss", 2, "mxfp4_experts_only"
EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
STACKS = [f"{m}.{p}" for m in EXPERTS for p in ("gate_up_proj", "down_proj")]


def calibrated(ck: str, q: str, algorithm: str) -> str:
    """`ck` calibrated under the recipe; GPTQ on every expert that a token reaches (the tiny run's few
    tokens are under the default minimum, below which an expert keeps max's codes)."""
    args = PTQArgs(ck, RECIPE, q, calib_size=2, seq_len=16, algorithm=algorithm, gptq_min_tokens=1, progress=False)
    run_ptq(ParallelState.single(), args)
    return q


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(release dir, its eprt checkpoint): the tiny model as GPT-OSS is released (bf16, MXFP4 experts)."""
    d = tmp_path_factory.mktemp("gpt_oss_release")
    hf = make_tiny(FAMILY, str(d / "hf"), dtype="bf16", **released(FAMILY))
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """(bf16 dir, its checkpoint, that checkpoint calibrated with gptq, its export under max)."""
    d = tmp_path_factory.mktemp("gpt_oss_bf16")
    hf = make_tiny(FAMILY, str(d / "hf"), dtype="bf16")
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    by_max = export_hf(calibrated(ck, str(d / "max"), "max"), str(d / "max-out"), fmt="mxfp4", progress=False)
    return hf, ck, calibrated(ck, str(d / "q"), "gptq"), read_hf_tensors(by_max)


def test_the_release_calibrated_with_max_is_the_release_byte_for_byte(release, tmp_path):
    """The release's expert values lie on the MXFP4 grid: max gives them back, in the release's
    bytes (each block under the release's own scale), and every other tensor and the config as the
    release has them. The export passes eprt-check against the release, with no engine warning."""
    hf, ck = release
    out = export_hf(calibrated(ck, str(tmp_path / "q"), "max"), str(tmp_path / "out"), fmt="mxfp4", progress=False)
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    assert set(ours) == set(source)
    assert {n for n in source if n.endswith(("_blocks", "_scales"))} == {
        f"{s}_{c}" for s in STACKS for c in ("blocks", "scales")
    }
    for name, t in source.items():
        assert ours[name].dtype == t.dtype and raw(ours[name]) == raw(t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == json.loads(open(f"{hf}/config.json").read())
    assert check_export(out, hf) == [] and engine_warnings(out) == []


@pytest.mark.parametrize("algorithm", ["gptq", "mse", "awq+gptq"])
def test_a_bf16_calibration_decodes_to_eprts_own_quantized_weights(bf16, tmp_path, algorithm):
    """A bf16 GPT-OSS calibrated with each algorithm: each stack of blocks decodes, by eprt's reader of
    the release and by transformers' (the outside oracle), gate and up interleaved as the release
    interleaves them, to the weights the compressed-tensors library decompresses from the
    compressed-tensors export of the same checkpoint, expert by expert (GPTQ's codes, not max's) and,
    where no algorithm chose the codes, to eprt's own fake-quantized model's; the rest is the source's,
    the config the source's with the release's quantization_config."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    hf, ck, q, by_max = bf16
    q = q if algorithm == "gptq" else calibrated(ck, str(tmp_path / "q"), algorithm)
    out = export_hf(q, str(tmp_path / "out"), fmt="mxfp4", progress=False)
    assert check_export(out, hf) == [] and engine_warnings(out) == []
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    assert set(ours) == (set(source) - set(STACKS)) | {f"{s}_{c}" for s in STACKS for c in ("blocks", "scales")}
    for name in set(source) - set(STACKS):
        assert raw(ours[name]) == raw(source[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {
        **without_quantization(json.loads(open(f"{hf}/config.json").read())),
        "quantization_config": RELEASE_QUANTIZATION_CONFIG,
    }
    if algorithm != "mse":  # the algorithm chose other codes than max's
        assert any(not torch.equal(ours[f"{s}_blocks"], by_max[f"{s}_blocks"]) for s in STACKS)
    ct = export_hf(q, str(tmp_path / "ct"), fmt="compressed-tensors", progress=False)
    scheme, compressor = ct_scheme(ct)
    ct_tensors = read_hf_tensors(ct)
    model = None
    if algorithm == "mse":
        model, _, _, undo = fake_quantized_model(ck, q, torch.float32)
        undo()
    for stack in STACKS:
        module, leaf = stack.rsplit(".", 1)
        blocks, scales = ours[f"{stack}_blocks"], ours[f"{stack}_scales"]
        decoded = decode_mxfp4_blocks(blocks, scales).float()  # [E, out, in], the release's row order
        theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
        assert torch.equal(decoded, theirs), stack
        pieces = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        for e in range(decoded.shape[0]):
            for k, piece in enumerate(pieces):  # gate at the even rows, up at the odd
                want = decompressed(ct_tensors, f"{module}.{e}.{piece}", scheme, compressor).float()
                assert torch.equal(decoded[e, k :: len(pieces)], want), (stack, e, piece)
        if model is not None:  # eprt's experts hold gate's rows, then up's
            experts = model.get_submodule(module)
            held = experts.w13 if leaf == "gate_up_proj" else experts.w2
            ordered = torch.cat([decoded[:, k :: len(pieces)] for k in range(len(pieces))], dim=1)
            assert torch.equal(ordered, held.detach().float()), stack


def test_the_engine_checks_reference_reads_the_layout(bf16, tmp_path):
    """bench/engine_check.py's reference, from the numerics docs/engine-check.md states: each stack
    of blocks as transformers' bf16 `P` [E, in, out], which its dequantization gives, and no scales left."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from bench.engine_reference import read_export

    q = bf16[2]
    out = export_hf(q, str(tmp_path / "out"), fmt="mxfp4", progress=False)
    ours = read_hf_tensors(out)
    weights, modules = read_export(out)
    assert modules == {} and set(weights) == {n.removesuffix("_blocks") for n in ours if not n.endswith("_scales")}
    for stack in STACKS:
        want = mxfp4.convert_moe_packed_tensors(ours[f"{stack}_blocks"], ours[f"{stack}_scales"], dtype=torch.bfloat16)
        assert torch.equal(weights[stack], want), stack


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4_experts_only"])
def test_anything_but_mxfp4_experts_is_refused_by_name(bf16, tmp_path, recipe):
    hf, ck, *_ = bf16
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, q, calib_size=2, seq_len=16, progress=False))
    with pytest.raises(ConfigError, match=rf"model\.layers\.0\.\S+ .* --format mxfp4 .*--recipe {RECIPE}"):
        export_hf(q, str(tmp_path / "out"), fmt="mxfp4", progress=False)
    assert not (tmp_path / "out").exists()


def test_another_family_is_refused(tmp_path):
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype="bf16")
    q = calibrated(convert_hf(hf, str(tmp_path / "ck"), progress=False), str(tmp_path / "q"), "max")
    with pytest.raises(ConfigError, match="GPT-OSS's release layout.*qwen3_moe"):
        export_hf(q, str(tmp_path / "out"), fmt="mxfp4", progress=False)


def test_the_checker_names_what_vllm_would_not_load(release, tmp_path):
    """Blocks missing their scales, a NaN scale, and the experts listed as not converted."""
    hf, ck = release
    out = export_hf(calibrated(ck, str(tmp_path / "q"), "max"), str(tmp_path / "out"), fmt="mxfp4", progress=False)
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors = read_hf_tensors(str(broken))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    tensors["model.layers.0.mlp.experts.gate_up_proj_scales"][0, 0, 0] = 255
    for f in broken.glob("*.safetensors"):
        f.unlink()
    (broken / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    (broken / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts")
    (broken / "config.json").write_text(json.dumps(config))
    problems = check_export(str(broken))
    assert any(p.startswith("model.layers.1.mlp.experts.down_proj_scales: missing") for p in problems), problems
    assert any(p.startswith("model.layers.0.mlp.experts.gate_up_proj_scales: 1 scales are 255") for p in problems)
    assert any(
        p.startswith("model.layers.0.mlp.experts: matched by quantization_config.modules_to_not_convert")
        for p in problems
    )
    assert len(problems) == 3, "\n".join(problems)


def test_one_command_from_the_release_to_its_layout(release, tmp_path):
    """`eprt-quantize HF_DIR OUT --recipe mxfp4_experts_only --format mxfp4`: the recipe takes no
    statistic, but the layout is written from the model (converted, calibrated with max), not
    streamed: the release back, byte for byte, with a card that says the layout and vLLM."""
    from eprt.commands.quantize import quantize

    hf, _ = release
    out = str(tmp_path / "out")
    args = [hf, out, "--recipe", RECIPE, "--format", "mxfp4", "--calib", "builtin", "--calib-size", "2"]
    assert quantize([*args, "--seq-len", "16", "--eval-size", "0", "--quiet"]) == 0
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    assert set(ours) == set(source) and all(raw(ours[n]) == raw(source[n]) for n in source)
    card = open(f"{out}/README.md").read()
    assert "GPT-OSS release's MXFP4 layout" in card and "vllm serve" in card
