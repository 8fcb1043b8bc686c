"""A source encoding a family registers (eprt.storage.source_decoders) is what reading a source
uses: a checkpoint whose config announces it by its quant_method, with weights stored as its
components (a 2-D Linear's and a stack of experts'), exports model-free to the very tensors and
configs of the same checkpoint stored decoded, and a stacked weight is decoded one expert at a
time from that expert's rows alone. Without the entry, the quant_method is refused by name. The
encodings eprt reads of itself (block and per-tensor FP8, MXFP8, DeepSeek-V4's, GPT-OSS's MXFP4,
compressed-tensors') are entries too: reading finds them through the registry, and nothing reads a
checkpoint stored in one whose entry is gone."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eprt.errors import CheckpointError, ConfigError
from eprt.families import read_hf_config
from eprt.hf.convert import convert_hf
from eprt.hf.source import HFSource
from eprt.hf.source_encoded import encoded_modules
from eprt.hf.streaming import stream_export
from eprt.storage import encodings, source_decoders
from eprt.storage.encodings import source_quantization
from eprt.testing.tiny import SOURCE_FORMATS, make_tiny, released
from tests.hf_utils import raw, read_hf_tensors

METHOD = "int8-rows"
HIDDEN, INTER, EXPERTS = 128, 96, 4  # gate_up_proj [4, 192, 128]: its shape tells its order


class RowScaledInt8:
    """int8 codes times a per-row fp32 scale, in bf16; stacks decode alike."""

    components = ("codes", "scales")
    batched = True
    decoded: list[tuple[int, ...]] = []  # the shape of every codes tensor decoded

    def __init__(self, config: dict):
        assert config["quant_method"] == METHOD

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        RowScaledInt8.decoded.append(tuple(c["codes"].shape))
        return (c["codes"].float() * c["scales"][..., None]).to(torch.bfloat16)


ENTRY = source_decoders.SourceDecoder(
    "int8-rows",
    (METHOD,),
    source_decoders.suffix_finder(codes="_codes", scales="_rowscale"),
    lambda scheme, where: RowScaledInt8(scheme),
)


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, the weight they decode to)."""
    scales = w.float().abs().amax(-1) / 127
    codes = (w.float() / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales, (codes.float() * scales[..., None]).to(torch.bfloat16)


def make_pair(root) -> tuple[str, str]:
    """The same model twice: its expert weights encoded (with the quant_method), and decoded."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    plain = {"model.embed_tokens.weight": w(256, HIDDEN), "lm_head.weight": w(256, HIDDEN)}
    plain["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    encoded = dict(plain)
    decoded = dict(plain)
    p = "model.layers.0"
    for proj in ("q_proj", "o_proj"):
        encoded[f"{p}.self_attn.{proj}.weight"] = decoded[f"{p}.self_attn.{proj}.weight"] = w(HIDDEN, HIDDEN)
    stacked = f"{p}.mlp.experts.gate_up_proj"  # every expert's, stacked
    codes, scales, decoded[stacked] = encode(w(EXPERTS, 2 * INTER, HIDDEN))
    encoded[f"{stacked}_codes"], encoded[f"{stacked}_rowscale"] = codes, scales
    for e in range(EXPERTS):  # one Linear's each
        down = f"{p}.mlp.experts.{e}.down_proj.weight"
        codes, scales, decoded[down] = encode(w(HIDDEN, INTER))
        encoded[f"{down}_codes"], encoded[f"{down}_rowscale"] = codes, scales
    config = {"model_type": "toy_moe", "hidden_size": HIDDEN, "num_hidden_layers": 1, "vocab_size": 256}
    dirs = []
    for name, tensors, extra in (
        ("encoded", encoded, {"quantization_config": {"quant_method": METHOD}}),
        ("decoded", decoded, {}),
    ):
        d = os.path.join(root, name, "toy")
        os.makedirs(d)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
        dirs.append(d)
    return dirs[0], dirs[1]


def test_a_registered_decoder_decodes_the_source_it_announces(tmp_path, monkeypatch):
    monkeypatch.setitem(source_decoders._REGISTRY, ENTRY.encoding, ENTRY)
    monkeypatch.setattr(RowScaledInt8, "decoded", [])
    encoded, decoded = make_pair(str(tmp_path))
    ours = stream_export(encoded, str(tmp_path / "out-encoded"), "fp8_block", progress=False)
    want = stream_export(decoded, str(tmp_path / "out-decoded"), "fp8_block", progress=False)
    got, expected = read_hf_tensors(ours), read_hf_tensors(want)
    assert set(got) == set(expected)
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale" in got  # the stack, quantized expert by expert
    for name, t in expected.items():
        assert raw(got[name]) == raw(t), name
    for f in ("config.json", "hf_quant_config.json"):
        with open(os.path.join(ours, f)) as a, open(os.path.join(want, f)) as b:
            assert json.load(a) == json.load(b), f
    # the stack decoded expert by expert, from each one's rows (one probe of each stored shape aside)
    assert RowScaledInt8.decoded.count((1, 2 * INTER, HIDDEN)) == 2 * EXPERTS  # gate and up, each read once
    assert (EXPERTS, 2 * INTER, HIDDEN) not in RowScaledInt8.decoded[2:]


def test_without_the_entry_the_quant_method_is_refused(tmp_path):
    encoded, _ = make_pair(str(tmp_path))
    with pytest.raises(ConfigError, match=f"quant_method '{METHOD}' is not read by eprt"):
        stream_export(encoded, str(tmp_path / "out"), "fp8_block", progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_weight_missing_a_component_or_claimed_twice_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setitem(source_decoders._REGISTRY, ENTRY.encoding, ENTRY)
    encoded, _ = make_pair(str(tmp_path))
    tensors = read_hf_tensors(encoded)
    del tensors["model.layers.0.mlp.experts.2.down_proj.weight_rowscale"]
    save_file(tensors, os.path.join(encoded, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.2.down_proj.weight_codes' is encoded, but its .*_rowscale"):
        stream_export(encoded, str(tmp_path / "out"), "fp8_block", progress=False)
    # a second entry that finds the same tensors under another encoding
    twin = source_decoders.SourceDecoder("int8-rows-twin", (METHOD,), ENTRY.find, ENTRY.decoder)
    monkeypatch.setitem(source_decoders._REGISTRY, twin.encoding, twin)
    with pytest.raises(CheckpointError, match="is a component of both"):
        stream_export(make_pair(str(tmp_path / "again"))[0], str(tmp_path / "out"), "fp8_block", progress=False)
    with pytest.raises(ValueError, match="registered twice"):
        source_decoders.register(source_decoders.SourceDecoder(ENTRY.encoding, ("other",), ENTRY.find, ENTRY.decoder))


# Each encoding eprt reads of itself, a tiny checkpoint stored in it, and what its encoded weights are
# found as (encoding, scheme): the built-in encodings are registry entries like any family's.
BUILT_IN = {
    "fp8-block": ("qwen3_moe", {"source_format": "fp8-block"}, {("fp8-block", "fp8")}),
    "fp8-tensor": ("mistral4", released("mistral4"), {("fp8-tensor", "fp8")}),
    "mxfp8": ("qwen3_moe", {"source_format": "mxfp8"}, {("fp8-block", "fp8")}),
    "deepseek-v4": ("deepseek_v4", released("deepseek_v4"), {("deepseek-fp8", "fp8"), ("deepseek-fp4", "fp8")}),
    "mxfp4-blocks": ("gpt_oss", released("gpt_oss"), {("mxfp4", "mxfp4")}),
    "ct-int4": ("qwen3_moe", {"source_format": "int4"}, {("compressed-tensors/pack-quantized", "group_0")}),
    "ct-mxfp4": ("qwen3_moe", {"source_format": "mxfp4"}, {("compressed-tensors/mxfp4-pack-quantized", "group_0")}),
}


@pytest.mark.parametrize("case", sorted(BUILT_IN))
def test_each_built_in_encoding_is_a_registry_entry_that_reading_consults(case, tmp_path, monkeypatch):
    family, options, want = BUILT_IN[case]
    hf = make_tiny(family, str(tmp_path / "hf"), **options)
    quant = source_quantization(read_hf_config(hf), os.path.join(hf, "config.json"))
    src = HFSource(hf)
    try:
        found = encoded_modules(src, quant).values()
    finally:
        src.close()
    assert {(e.encoding, e.scheme) for e in found} == want
    for encoding, _ in want:
        assert encodings.is_known(encoding) and source_decoders.registered(encoding).encoding == encoding
    # without its entries, neither convert nor the model-free export reads the checkpoint
    for encoding, _ in want:
        monkeypatch.delitem(source_decoders._REGISTRY, encoding)
    with pytest.raises((CheckpointError, ConfigError)):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    with pytest.raises((CheckpointError, ConfigError)):
        stream_export(hf, str(tmp_path / "out"), "fp8_block", progress=False)
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "out")


def test_an_mxfp4_config_with_no_mxfp4_tensor_is_refused_as_an_fp8_one_is(tmp_path):
    """Every announced encoding alike: a config announcing weights no tensor holds would be passed on."""
    for name, options in (("fp8", {"source_format": "fp8-block"}), ("mxfp4", released("gpt_oss"))):
        hf = make_tiny("gpt_oss", str(tmp_path / name))
        with open(os.path.join(hf, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = SOURCE_FORMATS[options["source_format"]]
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(config, f)
        with pytest.raises(CheckpointError, match=f"declares {config['quantization_config']['quant_method']} quantiz"):
            convert_hf(hf, str(tmp_path / f"{name}-ck"), progress=False)
