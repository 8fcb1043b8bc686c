"""Routed experts of every storage a checkpoint uses convert to eprt's stacked tensors in eprt's
order and export back byte for byte: per expert, fused, fused and transposed (Llama-4), fused,
transposed and interleaved with biases (GPT-OSS), and experts that are not gated (Nemotron-H); the
model-free export reads each storage straight from the source to the same files."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import eprt.hf.convert
import eprt.hf.export
import eprt.hf.export_quantized
from eprt.families import reader_for
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.layout import ClampedSwiGLU, ExpertPieces, ExpertStorage, Layout, plain, stacked_experts
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import tiny_config
from tests.hf_utils import raw, read_hf_tensors

E, I, H = 4, 48, 64
P = "model.layers.0.mlp.experts"
RELU2 = ExpertPieces(gated=False, activation="relu2")
GPT_OSS = ExpertPieces(bias=True, activation=ClampedSwiGLU())
FUSED = ("gate_up_proj", "down_proj")

CASES = {
    "gated, per expert": (ExpertPieces(), ExpertStorage()),
    "gated, fused": (ExpertPieces(), ExpertStorage(fused=FUSED)),
    "gated, fused, transposed": (ExpertPieces(), ExpertStorage(fused=FUSED, transposed=True)),
    "biased, fused, transposed, interleaved": (GPT_OSS, ExpertStorage(fused=FUSED, transposed=True, interleaved=True)),
    "biased, per expert": (GPT_OSS, ExpertStorage()),
    "not gated, per expert": (RELU2, ExpertStorage(("up_proj", "down_proj"))),
    "not gated, fused": (RELU2, ExpertStorage(("up_proj", "down_proj"), fused=("up_proj", "down_proj"))),
}


def source_tensors(pieces: ExpertPieces, storage: ExpertStorage) -> dict[str, torch.Tensor]:
    """One MoE layer's experts as the checkpoint stores them, random bf16."""
    g = torch.Generator().manual_seed(0)
    first = ("gate_proj", "up_proj") if pieces.gated else ("up_proj",)
    if storage.fused:
        up, down = storage.fused
        shapes = {up: (E, len(first) * I, H), down: (E, H, I)}
        if storage.transposed:
            shapes = {n: (s[0], s[2], s[1]) for n, s in shapes.items()}
        if pieces.bias:
            shapes |= {f"{up}_bias": (E, len(first) * I), f"{down}_bias": (E, H)}
        return {f"{P}.{n}": torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}
    kinds = [".weight"] + ([".bias"] if pieces.bias else [])
    out = {}
    for e in range(E):
        for p in storage.names:
            for k in kinds:
                shape = (H, I) if p == "down_proj" else (I, H)
                out[f"{P}.{e}.{p}{k}"] = torch.randn(shape[: 1 if k == ".bias" else 2], generator=g).bfloat16()
    return out


@pytest.fixture
def layer_layout(monkeypatch):
    """The tiny qwen3_moe checkpoint's config, with a layout of one experts layer: the one set."""
    layouts = {}
    family = reader_for("qwen3_moe", "test")

    class OneLayer:
        def layout(self, c):
            return layouts["layout"]

    monkeypatch.setattr(eprt.hf.convert, "reader_for", lambda *a: OneLayer())
    monkeypatch.setattr(eprt.hf.export, "reader_for", lambda *a: OneLayer())
    assert family.layout  # the config below is that family's

    def use(pieces, storage):
        specs = stacked_experts(P, E, I, H, pieces=pieces, storage=storage)
        layouts["layout"] = Layout((plain("model.norm.weight", H), *specs))
        return specs

    return use


def write_source(d: str, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(tiny_config("qwen3_moe"), f)
    save_file(
        tensors | {"model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, os.path.join(d, "model.safetensors")
    )
    return d


@pytest.mark.parametrize("case", CASES)
def test_experts_convert_in_eprt_order_and_export_byte_for_byte(tmp_path, layer_layout, case):
    pieces, storage = CASES[case]
    specs = layer_layout(pieces, storage)
    source = source_tensors(pieces, storage)
    hf = write_source(str(tmp_path / "hf"), source)

    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    first, down = pieces.leaves
    want_names = {f"{P}.{first}", f"{P}.{down}"} | ({f"{P}.{first}_bias", f"{P}.{down}_bias"} if pieces.bias else set())
    with Checkpoint(ck) as c:
        assert {n for n in c.tensors if n.startswith(P)} == want_names == {s.name for s in specs}
        stacked = {n: c.read(n) for n in want_names}
    # eprt's order: each expert's row holds its gate rows, then its up rows (or up alone), [out, in]
    w_in, w_out = stacked[f"{P}.{first}"], stacked[f"{P}.{down}"]
    assert w_in.shape == (E, pieces.fan * I, H) and w_out.shape == (E, H, I)
    for e in range(E):
        if storage.fused:
            gate_up, down_e = source[f"{P}.{storage.fused[0]}"][e], source[f"{P}.{storage.fused[1]}"][e]
            if storage.transposed:
                gate_up, down_e = gate_up.T, down_e.T
            if storage.interleaved:
                gate_up = torch.cat([gate_up[0::2], gate_up[1::2]])
            want_in = gate_up
        else:
            want_in = torch.cat([source[f"{P}.{e}.{p}.weight"] for p in storage.names[:-1]])
            down_e = source[f"{P}.{e}.{storage.names[-1]}.weight"]
        assert torch.equal(w_in[e], want_in) and torch.equal(w_out[e], down_e), e
    if pieces.bias and storage.interleaved:
        b = source[f"{P}.gate_up_proj_bias"]
        assert torch.equal(stacked[f"{P}.{first}_bias"], torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))

    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "out"), progress=False))
    assert set(exported) == set(source) | {"model.norm.weight"}
    for n, t in source.items():
        assert exported[n].dtype == t.dtype and raw(exported[n]) == raw(t), n


def test_a_fused_tensor_in_the_wrong_shape_is_refused_by_name(tmp_path, layer_layout):
    pieces, storage = CASES["gated, fused, transposed"]
    layer_layout(pieces, storage)
    source = source_tensors(pieces, storage)
    source[f"{P}.gate_up_proj"] = source[f"{P}.gate_up_proj"].transpose(1, 2).contiguous()  # not transposed
    hf = write_source(str(tmp_path / "hf"), source)
    with pytest.raises(Exception, match=rf"{P}\.gate_up_proj.*shape \[{E}, {2 * I}, {H}\].*\[{E}, {H}, {2 * I}\]"):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.parametrize("case", ["biased, fused, transposed, interleaved", "biased, per expert"])
def test_a_quantized_export_of_experts_with_biases_writes_them_per_expert_unquantized(
    tmp_path, layer_layout, monkeypatch, case
):
    """Each expert's weights quantized, its biases in the source's dtype beside them under the per-expert
    names (`experts.E.gate_proj.bias`: gate and up apart where the source interleaves them)."""
    import eprt.hf.check_names

    pieces, storage = CASES[case]
    layer_layout(pieces, storage)
    for module in (eprt.hf.export_quantized, eprt.hf.check_names):  # the export and its check read the layout
        monkeypatch.setattr(module, "reader_for", eprt.hf.convert.reader_for)
    source = source_tensors(pieces, storage)
    hf = write_source(str(tmp_path / "hf"), source)
    # the experts' dims in config.json too: the export's shape check builds each expert from it
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(tiny_config("qwen3_moe", num_experts=E, moe_intermediate_size=I, hidden_size=H), f)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "out"), recipe="fp8_block", progress=False))
    names = ("gate_proj", "up_proj", "down_proj")
    quantized = {f"{P}.{e}.{p}.{leaf}" for e in range(E) for p in names for leaf in ("weight", "weight_scale")}
    biases = {f"{P}.{e}.{p}.bias" for e in range(E) for p in names}
    assert set(exported) == quantized | biases | {"model.norm.weight"}
    for e in range(E):
        if storage.fused:
            gate_up, down = source[f"{P}.gate_up_proj_bias"][e], source[f"{P}.down_proj_bias"][e]
            want = {"gate_proj": gate_up[0::2], "up_proj": gate_up[1::2], "down_proj": down}
        else:
            want = {p: source[f"{P}.{e}.{p}.bias"] for p in names}
        for p, t in want.items():
            got = exported[f"{P}.{e}.{p}.bias"]
            assert got.dtype == t.dtype and raw(got) == raw(t.contiguous()), (e, p)
        assert exported[f"{P}.{e}.down_proj.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("case", CASES)
def test_the_model_free_export_reads_each_storage_as_the_modeled_export(tmp_path, layer_layout, monkeypatch, case):
    """Each expert read from its own entry of a fused stack, transposed back and its pieces apart
    where the layout says so: the files of the export of the converted checkpoint."""
    import eprt.hf.check_names
    from eprt.hf.streaming import run
    from eprt.hf.streaming.run import stream_export
    from tests.test_model_free import same_files

    pieces, storage = CASES[case]
    layer_layout(pieces, storage)
    for module in (eprt.hf.export_quantized, eprt.hf.check_names, run):  # what reads the layout
        monkeypatch.setattr(module, "reader_for", eprt.hf.convert.reader_for)
    hf = write_source(str(tmp_path / "hf"), source_tensors(pieces, storage))
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(tiny_config("qwen3_moe", num_experts=E, moe_intermediate_size=I, hidden_size=H), f)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    modeled = export_hf(ck, str(tmp_path / "modeled"), recipe="nvfp4_a16", progress=False)
    assert same_files(modeled, stream_export(hf, str(tmp_path / "out"), "nvfp4_a16", progress=False))


@pytest.mark.parametrize("case", CASES)
def test_the_shape_check_knows_each_storage(layer_layout, monkeypatch, case):
    """eprt-check's shape rule: every tensor of the source in its stored shape passes, and a fused
    tensor in eprt's order where the source transposes it is named."""
    from eprt.hf import check_shapes

    pieces, storage = CASES[case]
    layer_layout(pieces, storage)
    monkeypatch.setattr(check_shapes, "reader_for", eprt.hf.convert.reader_for)
    specs = check_shapes.source_specs(tiny_config("qwen3_moe"))
    source = source_tensors(pieces, storage)
    problems = []
    check_shapes.check_shapes(source, {}, specs, "config.json", problems)
    assert problems == [] and set(source) <= set(specs)
    if storage.transposed:
        name = f"{P}.{storage.fused[0]}"
        check_shapes.check_shapes({name: source[name].transpose(1, 2)}, {}, specs, "config.json", problems)
        assert problems == [
            f"{name}: has shape [{E}, {pieces.fan * I}, {H}] but config.json implies [{E}, {H}, {pieces.fan * I}]"
        ]
