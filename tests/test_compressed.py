"""Compressed and block-FP8 sources stay encoded on disk; every rank decodes only its own experts,
exactly as the compressed-tensors library decompresses them (block FP8: as the reference below);
the model runs as if decompressed ahead of time, and export writes the source back byte for byte.

The tiny checkpoints are compressed by the compressed-tensors library itself (eprt.testing.tiny): a
Kimi-K2 (deepseek_v3 architecture) with Kimi-K2-Thinking's INT4 experts and quantization_config,
the same with Kimi-K3's MXFP4 experts, and a block-FP8 DeepSeek-V3 whose dimensions are not
multiples of 128.
"""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

import eprt  # noqa: E402
from eprt.hf.check_export import check_export  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.storage.encodings import dequantize_block_fp8  # noqa: E402
from eprt.storage.safetensors_io import SafetensorsFile  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.multiproc import run_world  # noqa: E402
from tests.test_roundtrip import assert_same_checkpoint  # noqa: E402

E = 8
KIMI_K2 = dict(model_type="kimi_k2", num_nextn_predict_layers=0)
# Block FP8 with partial last blocks in both dimensions, several blocks in each where the weight is
# large enough (dense MLP 304x192, experts 144x192 and 192x144, MTP eh_proj 192x384); in dims stay
# multiples of 16 so that NVFP4 can quantize the result.
FP8_DEEPSEEK = dict(hidden_size=192, intermediate_size=304, moe_intermediate_size=144)
MOE = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
COMPRESSED = ["int4", "mxfp4"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{format: (Hugging Face source, its eprt checkpoint)}."""
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for fmt in COMPRESSED:
        hf = make_tiny("deepseek_v3", str(root / f"{fmt}-hf"), shards=2, source_format=fmt, **KIMI_K2)
        out[fmt] = hf, convert_hf(hf, str(root / fmt), progress=False)
    hf = make_tiny("deepseek_v3", str(root / "fp8-hf"), shards=2, source_format="fp8-block", **FP8_DEEPSEEK)
    out["fp8"] = hf, convert_hf(hf, str(root / "fp8"), progress=False)
    return out


def library_decompressed(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every compressed weight of a Hugging Face directory as compressed-tensors decompresses it,
    by `M.weight`: the oracle."""
    qc = json.load(open(os.path.join(hf_dir, "config.json")))["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format or parsed.format)
    tensors = read_hf_tensors(hf_dir)
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            local = {k[len(module) + 1 :]: v for k, v in tensors.items() if k.startswith(module + ".")}
            out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"]
    return out


def reference_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """docs/sources.md, 'Block FP8': w = fp8 * weight_scale_inv[i // 128, j // 128], rounded to bf16 as DeepSeek's
    own dequantization does; block by block."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            out[i : i + 128, j : j + 128] = w[i : i + 128, j : j + 128].float() * scale_inv[i // 128, j // 128]
    return out.to(torch.bfloat16)


def fp8_reference(hf_dir: str) -> dict[str, torch.Tensor]:
    tensors = read_hf_tensors(hf_dir)
    return {
        n[: -len("_scale_inv")]: reference_block_fp8(tensors[n[: -len("_scale_inv")]], t)
        for n, t in tensors.items()
        if n.endswith(".weight_scale_inv")
    }


def decoded(hf_dir: str) -> dict[str, torch.Tensor]:
    return fp8_reference(hf_dir) if "fp8" in os.path.basename(hf_dir) else library_decompressed(hf_dir)


def decompressed_copy(hf_dir: str, out: str, dtype: torch.dtype) -> str:
    """The same model as a plain checkpoint: its compressed weights decompressed ahead of time by the
    library (in `dtype`), no quantization_config."""
    weights = decoded(hf_dir)
    tensors = {n: t for n, t in read_hf_tensors(hf_dir).items() if n.rpartition(".")[0] + ".weight" not in weights}
    tensors.update({n: w.to(dtype) for n, w in weights.items()})
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    return out


def assert_block_fp8_source_runs_decoded_and_exports_back(hf: str, root) -> str:
    """The block-FP8 source `hf` converts (under `root`) keeping its encoding, gives the logits (fp32)
    of its copy decoded ahead of time, and exports back byte for byte. Returns its eprt checkpoint."""
    ck = convert_hf(hf, str(root / "ck"), progress=False)
    plain = convert_hf(
        decompressed_copy(hf, str(root / "plain-hf"), torch.float32), str(root / "plain"), progress=False
    )
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(
            eprt.load_model(ck, dtype=torch.float32)(ids), eprt.load_model(plain, dtype=torch.float32)(ids)
        )
    assert_same_checkpoint(hf, export_hf(ck, str(root / "out"), progress=False))
    return ck


def expert_rows(want: dict[str, torch.Tensor], moe: str, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [a, b) of one MoE layer stacked as eprt stacks them, from per-expert weights."""
    w13 = torch.stack(
        [torch.cat([want[f"{moe}.{e}.gate_proj.weight"], want[f"{moe}.{e}.up_proj.weight"]]) for e in range(a, b)]
    )
    return w13, torch.stack([want[f"{moe}.{e}.down_proj.weight"] for e in range(a, b)])


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_kept_compressed_on_disk_with_its_scheme(sources, fmt):
    hf, ck_dir = sources[fmt]
    ck = Checkpoint(ck_dir)
    qc = json.load(open(os.path.join(hf, "config.json")))["quantization_config"]
    w13 = ck.meta(f"{MOE[0]}.w13")
    assert w13.encoding == f"compressed-tensors/{qc['format']}" and w13.scheme == "group_0" and w13.per_row == 2
    assert w13.shape == (E, 64, 64) and w13.dtype == torch.bfloat16
    group = qc["config_groups"]["group_0"]
    assert ck.schemes == {"group_0": {**group, "format": group.get("format") or qc["format"]}}
    packed = w13.components["weight_packed"]
    assert packed.shape[:2] == (E, 64) and packed.dtype in (torch.int32, torch.uint8)
    # only the routed experts are compressed (Kimi's ignore list); nothing is decompressed on disk
    assert {n for n in ck.names(role=None) if ck.meta(n).encoded} == {f"{m}.{k}" for m in MOE for k in ("w13", "w2")}
    src_bytes = sum(
        info.nbytes
        for f in os.listdir(hf)
        if f.endswith(".safetensors")
        for info in SafetensorsFile(os.path.join(hf, f)).tensors.values()
    )
    ck_bytes = sum(
        info.nbytes
        for f in os.listdir(ck_dir)
        if f.endswith(".safetensors")
        for info in SafetensorsFile(os.path.join(ck_dir, f)).tensors.values()
    )
    assert ck_bytes == src_bytes


@pytest.mark.parametrize("fmt", COMPRESSED)
@pytest.mark.parametrize("ep", [2, 4])
def test_each_ranks_experts_decompress_as_the_library_does(sources, fmt, ep):
    hf, ck_dir = sources[fmt]
    want = library_decompressed(hf)
    ck = Checkpoint(ck_dir)
    for rank in range(ep):
        a, b = rank * E // ep, (rank + 1) * E // ep
        for moe in MOE:
            w13, w2 = expert_rows(want, moe, a, b)
            assert torch.equal(ck.read(f"{moe}.w13", rows=(a, b)), w13), (fmt, ep, rank, moe)
            assert torch.equal(ck.read(f"{moe}.w2", rows=(a, b)), w2), (fmt, ep, rank, moe)


def test_a_rank_reads_only_its_experts_stored_bytes(sources):
    _, ck_dir = sources["int4"]
    ck = Checkpoint(ck_dir)
    name = f"{MOE[1]}.w13"
    ck.read(name, rows=(2, 2))  # opens the layer file: its header
    before = ck.bytes_read
    ck.read(name, rows=(2, 4))
    stored = sum(2 * c.dtype.itemsize * math.prod(c.shape[1:]) for c in ck.meta(name).components.values())
    assert ck.bytes_read - before == stored  # two experts' packed values, scales and shapes


def test_formats_md_nibble_and_e2m1_layouts(sources):
    """The INT4 and MXFP4 layouts of docs/sources.md, pinned against the library's decompression."""
    for fmt in COMPRESSED:
        hf, _ = sources[fmt]
        t, want = read_hf_tensors(hf), library_decompressed(hf)
        m = f"{MOE[0]}.3.up_proj"
        packed, scale = t[f"{m}.weight_packed"], t[f"{m}.weight_scale"]
        j = torch.arange(packed.shape[1] * (8 if fmt == "int4" else 2))
        if fmt == "int4":  # nibble j of a row is bits 4*(j%8) of word j//8, value = nibble - 8
            q = ((packed[:, j // 8] >> (4 * (j % 8))) & 0xF) - 8
            w = q.to(torch.bfloat16) * scale[:, j // 32]
        else:  # low nibble = even column; E2M1 code: bit 3 sign, bits 0-2 index; scale 2^(e - 127)
            code = (packed[:, j // 2].int() >> (4 * (j % 2))) & 0xF
            mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[code & 7] * torch.where(code >= 8, -1.0, 1.0)
            w = mag.to(torch.bfloat16) * torch.pow(2.0, scale[:, j // 32].float() - 127).to(torch.bfloat16)
        assert torch.equal(w, want[f"{m}.weight"]), fmt


def test_block_fp8_dequantizes_as_the_reference(sources):
    hf, ck_dir = sources["fp8"]
    want = fp8_reference(hf)
    ck = Checkpoint(ck_dir)
    partial_both = [
        n for n, w in want.items() if w.shape[0] > 128 and w.shape[1] > 128 and w.shape[0] % 128 and w.shape[1] % 128
    ]
    assert "model.layers.0.mlp.gate_proj.weight" in partial_both and f"{MOE[0]}.0.up_proj.weight" in partial_both
    for name in (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_b_proj.weight",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
    ):
        assert ck.meta(name).encoding == "fp8-block"
        assert torch.equal(ck.read(name), want[name]), name
    for moe in MOE:
        for a, b in ((0, 8), (3, 5)):
            w13, w2 = expert_rows(want, moe, a, b)
            assert torch.equal(ck.read(f"{moe}.w13", rows=(a, b)), w13) and torch.equal(
                ck.read(f"{moe}.w2", rows=(a, b)), w2
            )
    # the MTP layer is carried as it is, block FP8, and decodes the same way
    mtp = ck.meta("model.layers.3.eh_proj.weight")
    assert mtp.role == "passthrough" and mtp.encoding == "fp8-block" and mtp.shape == (192, 384)
    assert torch.equal(ck.read("model.layers.3.eh_proj.weight"), want["model.layers.3.eh_proj.weight"])
    # router, norms, embeddings and head are not FP8 in DeepSeek-V3 and stay raw
    assert not ck.meta("model.layers.1.mlp.gate.weight").encoded and not ck.meta("lm_head.weight").encoded


@pytest.mark.parametrize("rows,cols", [(256, 384), (200, 300)], ids=["whole blocks", "partial blocks"])
def test_block_fp8_decodes_stacked_weights_as_the_reference(rows, cols):
    """Weights stacked along a leading dim decode each with its own blocks; where the blocks tile the
    weight the scales multiply a blocked view in place, with the reference's bits."""
    torch.manual_seed(0)
    w = (torch.randn(3, rows, cols) * 4).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, math.ceil(rows / 128), math.ceil(cols / 128)) + 1e-3
    want = torch.stack([reference_block_fp8(w[i], scale_inv[i]) for i in range(3)])
    assert torch.equal(dequantize_block_fp8(w, scale_inv).view(torch.int16), want.view(torch.int16))


def test_block_fp8_decoded_on_a_device_reads_the_same(sources):
    """`read(..., device=)` decodes block FP8 where it is asked (the GPU's copy carries the stored bytes)."""
    _, ck_dir = sources["fp8"]
    with Checkpoint(ck_dir) as ck:
        for name, rows in ((f"{MOE[0]}.w13", (3, 5)), ("model.layers.0.mlp.gate_proj.weight", None)):
            assert torch.equal(ck.read(name, rows, device="cpu"), ck.read(name, rows))


def rank_experts(dirs: dict[str, tuple[str, str]], ep: int) -> dict:
    """On one rank: its experts' range and whether the weights its model holds are the library's."""
    with ParallelState.from_env(ep=ep) as state:
        out = {}
        for fmt, (hf, ck_dir) in dirs.items():
            weights = eprt.load_model(ck_dir, dtype=torch.bfloat16, parallel=state).state_dict()
            first, count = state.placement(E).range
            want = library_decompressed(hf)
            out[fmt] = (
                (first, count),
                [
                    torch.equal(weights[f"{moe}.w{k}"], w)
                    for moe in MOE
                    for k, w in zip((13, 2), expert_rows(want, moe, first, first + count))
                ],
            )
    return out


def test_expert_parallel_load_decompresses_each_ranks_own_experts(sources):
    results = run_world(rank_experts, 2, {fmt: sources[fmt] for fmt in COMPRESSED}, 2, timeout=150)
    for rank, out in enumerate(results):
        for fmt in COMPRESSED:
            assert out[fmt] == ((rank * 4, 4), [True] * 4), (fmt, rank)


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_logits_equal_the_model_decompressed_ahead_of_time(sources, tmp_path, fmt):
    hf, ck_dir = sources[fmt]
    plain = convert_hf(decompressed_copy(hf, str(tmp_path / "hf"), torch.float32), str(tmp_path / "ck"), progress=False)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = eprt.load_model(ck_dir, dtype=torch.float32)(ids)
        want = eprt.load_model(plain, dtype=torch.float32)(ids)
    assert torch.equal(got, want)


def test_kimi_k3_with_mxfp4_experts_runs_as_if_decompressed_ahead_of_time(tmp_path):
    hf = make_tiny("kimi_k3", str(tmp_path / "k3-hf"), source_format="mxfp4")
    packed = [n for n in read_hf_tensors(hf) if n.endswith(".weight_packed")]
    assert packed and all(".block_sparse_moe.experts." in n for n in packed)  # as K3 ships: experts only
    ck_dir = convert_hf(hf, str(tmp_path / "k3"), progress=False)
    plain = convert_hf(decompressed_copy(hf, str(tmp_path / "hf"), torch.float32), str(tmp_path / "ck"), progress=False)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(
            eprt.load_model(ck_dir, dtype=torch.float32)(ids), eprt.load_model(plain, dtype=torch.float32)(ids)
        )
    export_hf(ck_dir, str(tmp_path / "out"), progress=False)
    assert_same_checkpoint(hf, str(tmp_path / "out"))


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "fp8"])
def test_export_writes_the_source_back_byte_for_byte(sources, tmp_path, fmt):
    hf, ck_dir = sources[fmt]
    export_hf(ck_dir, str(tmp_path / "out"), max_shard_bytes=100_000, progress=False)
    assert_same_checkpoint(hf, str(tmp_path / "out"))  # config.json included


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_dequantized_export_writes_bf16_without_the_quantization_config(sources, tmp_path, fmt):
    hf, ck_dir = sources[fmt]
    out = export_hf(ck_dir, str(tmp_path / "out"), dequantize=True, progress=False)
    got = read_hf_tensors(out)
    for name, w in decoded(hf).items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], w), name
    assert not any(n.endswith(("_packed", "_scale", "_shape", "_scale_inv")) for n in got)
    config = json.load(open(os.path.join(hf, "config.json")))
    del config["quantization_config"]
    assert json.load(open(os.path.join(out, "config.json"))) == config
    assert sorted(got) == sorted(read_hf_tensors(decompressed_copy(hf, str(tmp_path / "plain"), torch.bfloat16)))


def test_quantized_export_starts_from_the_decompressed_weights(sources, tmp_path):
    """NVFP4 of the INT4 Kimi-K2 gives the bytes NVFP4 of its ahead-of-time decompressed copy gives."""
    hf, ck_dir = sources["int4"]
    plain = convert_hf(
        decompressed_copy(hf, str(tmp_path / "hf"), torch.bfloat16), str(tmp_path / "ck"), progress=False
    )
    outs = []
    for name, ck in (("int4", ck_dir), ("plain", plain)):
        run_ptq(
            ParallelState.single(),
            PTQArgs(
                ck,
                "nvfp4",
                str(tmp_path / f"q-{name}"),
                calib_size=4,
                seq_len=16,
                batch_size=2,
                dtype="bf16",
                progress=False,
            ),
        )
        outs.append(export_hf(str(tmp_path / f"q-{name}"), str(tmp_path / f"x-{name}"), progress=False))
    assert check_export(outs[0]) == []
    a, b = read_hf_tensors(outs[0]), read_hf_tensors(outs[1])
    assert sorted(a) == sorted(b)
    assert all(a[n].dtype == b[n].dtype and raw(a[n]) == raw(b[n]) for n in a)
    assert a[f"{MOE[0]}.5.gate_proj.weight"].dtype == torch.uint8  # NVFP4 experts, not INT4


def test_quantized_export_writes_the_block_fp8_mtp_layer_in_bf16(sources, tmp_path):
    hf, ck_dir = sources["fp8"]
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck_dir, "nvfp4", str(tmp_path / "q"), calib_size=4, seq_len=16, batch_size=2, dtype="bf16", progress=False
        ),
    )
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "x"), progress=False)
    assert check_export(out) == []
    got, want = read_hf_tensors(out), fp8_reference(hf)
    assert not any(n.endswith("weight_scale_inv") for n in got)
    mtp = [n for n in want if n.startswith("model.layers.3.")]
    assert "model.layers.3.eh_proj.weight" in mtp
    for name in mtp:
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name
    assert got["model.layers.1.self_attn.o_proj.weight"].dtype == torch.uint8  # quantized from the decoded weight
