"""Each refusal of a compressed or FP8 source names the culprit and the way out, before anything is
written or loaded; convert leaves no output behind and the input as it was."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

compressed_tensors = pytest.importorskip("compressed_tensors")

import eprt  # noqa: E402
from eprt.errors import EprtError  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import SOURCE_FORMATS, compress_weight, encode_source, make_tiny, tiny_config  # noqa: E402
from tests.hf_utils import tree_digest  # noqa: E402

KIMI_K2 = dict(model_type="kimi_k2", num_nextn_predict_layers=0)
SHARD = "model.safetensors"
INSTALL = r"pip install 'compressed-tensors>=0\.20'"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    int4 = make_tiny("deepseek_v3", str(root / "int4"), source_format="int4", **KIMI_K2)
    fp8 = make_tiny("deepseek_v3", str(root / "fp8"), source_format="fp8-block", hidden_size=192)
    plain = make_tiny("deepseek_v3", str(root / "plain"), hidden_size=192)
    return {
        "int4": int4,
        "fp8": fp8,
        "plain": plain,
        "int4-ck": convert_hf(int4, str(root / "int4-ck"), progress=False),
    }


def edit_config(src, fn):
    path = os.path.join(src, "config.json")
    cfg = json.load(open(path))
    fn(cfg["quantization_config"], cfg)
    json.dump(cfg, open(path, "w"))


def edit_tensors(src, fn):
    path = os.path.join(src, SHARD)
    tensors = load_file(path)
    fn(tensors, json.load(open(os.path.join(src, "config.json")))["quantization_config"])
    save_file(tensors, path, metadata={"format": "pt"})


def other_method(src):
    edit_config(src, lambda qc, _: qc.update(quant_method="gptq"))


def format_without_compressor(src):
    edit_config(src, lambda qc, _: qc.update(format="marlin-24"))


def no_quantization_config(src):
    edit_config(src, lambda qc, cfg: cfg.pop("quantization_config"))


def compress(tensors, qc, module, group="group_0"):
    tensors.update({f"{module}.{c}": v for c, v in compress_weight(tensors.pop(f"{module}.weight"), qc, group).items()})


def decompress_module(tensors, qc, module):
    """`module`'s compressed tensors replaced by its weight, as the library decompresses it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    local = {k[len(module) + 1 :]: tensors.pop(k) for k in [k for k in tensors if k.startswith(module + ".")]}
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    tensors[f"{module}.weight"] = BaseCompressor.get_value_from_registry(qc["format"]).decompress(local, scheme)[
        "weight"
    ]


def claimed(source_format: str):
    """A breaker: config.json of a plain bf16 checkpoint claims the quantization of `source_format`."""

    def claim(src):
        path = os.path.join(src, "config.json")
        cfg = json.load(open(path))
        json.dump({**cfg, "quantization_config": SOURCE_FORMATS[source_format]}, open(path, "w"))

    claim.__name__ = f"{source_format}_claimed_over_bf16"
    return claim


def one_expert_claimed(src):
    """A plain bf16 checkpoint whose config claims MXFP4 for the routed experts, one expert's weights
    compressed to back it and the others left plain."""
    claimed("mxfp4")(src)
    qc = json.load(open(os.path.join(src, "config.json")))["quantization_config"]

    def compress_expert_0(tensors, _):
        tensors.update(encode_source({k: tensors.pop(k) for k in [k for k in tensors if ".experts.0." in k]}, qc))

    edit_tensors(src, compress_expert_0)


def compressed_where_ignored(src):
    edit_tensors(src, lambda t, qc: compress(t, qc, "model.layers.1.self_attn.o_proj"))


def expert_with_another_scheme(src):
    """Expert 5 of layer 1 compressed in groups of 16, by a second config group that names it."""
    group = json.load(open(os.path.join(src, "config.json")))["quantization_config"]["config_groups"]["group_0"]
    group = {
        **group,
        "targets": [r"re:model\.layers\.1\.mlp\.experts\.5\..*"],
        "weights": {**group["weights"], "group_size": 16},
    }
    edit_config(src, lambda qc, _: qc["config_groups"].update(group_1=group))

    def recompress(tensors, qc):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            decompress_module(tensors, qc, f"model.layers.1.mlp.experts.5.{proj}")
            compress(tensors, qc, f"model.layers.1.mlp.experts.5.{proj}", "group_1")

    edit_tensors(src, recompress)


def one_expert_uncompressed(src):
    edit_tensors(src, lambda t, qc: decompress_module(t, qc, "model.layers.2.mlp.experts.6.up_proj"))


def missing_component(src):
    edit_tensors(src, lambda t, qc: t.pop("model.layers.2.mlp.experts.2.up_proj.weight_scale"))


def unscaled_fp8(src):
    edit_tensors(src, lambda t, qc: t.pop("model.layers.0.mlp.down_proj.weight_scale_inv"))


PLUGIN = "/tmp/x/plugin.py:x"  # a format the library's registry would import as a plugin


def top_level_format_not_decoded(src):
    """Every group names its format, so the top-level one decodes nothing here, but a consumer of the
    config (the library's registry imports a `path/file.py:name` format as a plugin) reads it."""

    def edit(qc, _):
        for group in qc["config_groups"].values():
            group["format"] = qc["format"]
        qc["format"] = PLUGIN

    edit_config(src, edit)


CASES = [
    *(
        (
            "plain",
            claimed(f),
            r"config\.json \(quantization_config\): declares .* quantization, but no tensor of .* is "
            r"stored quantized; remove quantization_config from config\.json if the weights are plain",
        )
        for f in ("mxfp4", "int4", "fp8-block")
    ),
    (
        "plain",
        one_expert_claimed,
        r"model\.layers\.\d+\.mlp\.experts\.[1-9]\d*\.\w+\.weight is stored plain \(torch\.bfloat16\), but .* says "
        r"model\.layers\.\d+\.mlp\.experts\.[1-9]\d*\.\w+ is mxfp4-pack-quantized",
    ),
    ("int4", other_method, r"quant_method 'gptq' is not read by eprt"),
    (
        "int4",
        format_without_compressor,
        r"compressed-tensors format 'marlin-24' is not one eprt decodes "
        r"\(pack-quantized, .*\); dequantize the checkpoint to bf16 first",
    ),
    (
        "int4",
        compressed_where_ignored,
        r"tensor 'model\.layers\.1\.self_attn\.o_proj\.weight_packed' is compressed, "
        r"but the quantization_config's ignore entry 're:\.\*self_attn\.\*' says "
        r"model\.layers\.1\.self_attn\.o_proj is not",
    ),
    (
        "int4",
        expert_with_another_scheme,
        r"the weights stacked into 'model\.layers\.1\.mlp\.experts\.w13' disagree: "
        r"'model\.layers\.1\.mlp\.experts\.5\.gate_proj\.weight' is "
        r"compressed-tensors/pack-quantized \(scheme group_1\) but "
        r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' is .*\(scheme group_0\)",
    ),
    (
        "int4",
        one_expert_uncompressed,
        r"model\.layers\.2\.mlp\.experts\.6\.up_proj\.weight is stored plain \(torch\.bfloat16\), but .*config\.json "
        r"\(quantization_config\) says model\.layers\.2\.mlp\.experts\.6\.up_proj is pack-quantized \(group_0\)",
    ),
    (
        "int4",
        missing_component,
        r"model\.layers\.2\.mlp\.experts\.2\.up_proj is compressed \(pack-quantized, "
        r"group_0\) but tensor 'model\.layers\.2\.mlp\.experts\.2\.up_proj\.weight_scale' is missing",
    ),
    (
        "fp8",
        unscaled_fp8,
        r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' is torch\.float8_e4m3fn without a "
        r"scale \(weight_scale_inv\)",
    ),
    (
        "fp8",
        no_quantization_config,
        r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' is an FP8 "
        r"scale, but config\.json declares no FP8 quantization_config",
    ),
    (
        "int4",
        top_level_format_not_decoded,
        r"config\.json \(quantization_config\) format: compressed-tensors format '/tmp/x/plugin\.py:x' is not "
        r"one eprt decodes \(pack-quantized, .*\); dequantize the checkpoint to bf16 first",
    ),
]


@pytest.mark.parametrize("kind,breaker,message", CASES, ids=[c[1].__name__ for c in CASES])
def test_convert_refusal(made, tmp_path, kind, breaker, message):
    src = shutil.copytree(made[kind], tmp_path / "hf")
    breaker(str(src))
    before = tree_digest(str(src))
    with pytest.raises(EprtError, match=message):
        convert_hf(str(src), str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no temp directory
    assert tree_digest(str(src)) == before


def test_an_old_compressed_tensors_is_refused(made, tmp_path, monkeypatch):
    monkeypatch.setattr(compressed_tensors, "__version__", "0.19.1")
    with pytest.raises(EprtError, match=r"compressed-tensors 0\.19\.1 is older than 0\.20.*pip install -U"):
        convert_hf(made["int4"], str(tmp_path / "out"), progress=False)
    with pytest.raises(EprtError, match=r"compressed-tensors 0\.19\.1 is older than 0\.20"):
        eprt.load_model(made["int4-ck"])
    assert os.listdir(tmp_path) == []


def test_a_missing_compressed_tensors_is_refused_naming_the_install(made, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import compressed_tensors now fails
    before = tree_digest(made["int4-ck"])
    with pytest.raises(EprtError, match=rf"holds compressed-tensors weights.*not installed: {INSTALL}"):
        convert_hf(made["int4"], str(tmp_path / "out"), progress=False)
    with pytest.raises(EprtError, match=rf"model\.layers\.1\.mlp\.experts\.w13\).*not installed: {INSTALL}"):
        eprt.load_model(made["int4-ck"])
    with pytest.raises(EprtError, match=INSTALL):
        export_hf(made["int4-ck"], str(tmp_path / "dequantized"), dequantize=True, progress=False)
    assert os.listdir(tmp_path) == []
    # writing the source back copies its bytes: no decompression, no library needed
    export_hf(made["int4-ck"], str(tmp_path / "as-stored"), progress=False)
    assert tree_digest(made["int4-ck"]) == before


def test_a_load_dtype_that_rounds_the_decompressed_weights_is_refused(made):
    with pytest.raises(
        EprtError,
        match=r"model\.layers\.1\.mlp\.experts\.w13 is stored compressed-tensors/pack-quantized "
        r"and decompresses to torch\.bfloat16; loading it as torch\.float16 would round "
        r"every weight again: load with dtype=torch\.bfloat16 or torch\.float32",
    ):
        eprt.load_model(made["int4-ck"], dtype=torch.float16)


def test_compressed_tensors_is_imported_only_for_compressed_checkpoints(made, tmp_path):
    """Plain checkpoints never import it (nor transformers, which it imports); writing a compressed
    source back as stored does not either."""
    script = f"""
import sys, torch
import eprt
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.testing.tiny import make_tiny
ck = convert_hf(make_tiny("qwen3_moe", {str(tmp_path / "hf")!r}), {str(tmp_path / "ck")!r}, progress=False)
eprt.load_model(ck)(torch.zeros(1, 3, dtype=torch.long))
export_hf(ck, {str(tmp_path / "out")!r}, progress=False)
export_hf({made["int4-ck"]!r}, {str(tmp_path / "int4-out")!r}, progress=False)
print(sorted(m for m in ("compressed_tensors", "transformers") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4_experts_only"])
def test_a_quantized_export_writes_no_string_of_the_source_quantization_config(tmp_path, recipe):
    """Kimi-K2.5 keeps its quantization_config in text_config; a field compressed-tensors ignores
    passes every check, and the export's configs replace the source's instead of carrying it."""
    text = {**tiny_config("kimi_k25")["text_config"], "moe_intermediate_size": 32}  # INT4 groups of 32
    src = make_tiny("kimi_k25", str(tmp_path / "hf"), source_format="int4", text_config=text)
    path = os.path.join(src, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"]["quantization_config"] = {**cfg.pop("quantization_config"), "plugin": PLUGIN}
    json.dump(cfg, open(path, "w"))
    ck = convert_hf(src, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, q, calib_size=2, seq_len=16, progress=False))
    for fmt in ("modelopt", "compressed-tensors"):
        out = export_hf(q, str(tmp_path / fmt), progress=False, fmt=fmt)
        configs = {f: open(os.path.join(out, f)).read() for f in os.listdir(out) if f.endswith(".json")}
        assert [f for f, text in configs.items() if PLUGIN in text] == []
        assert "quantization_config" not in json.loads(configs["config.json"])["text_config"]
