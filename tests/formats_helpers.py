"""What the weight-format tests (tests/test_format_*.py) share: a tiny model calibrated with one
recipe and exported in both layouts, ModelOpt's own export of the same model, the
compressed-tensors library's scheme and compressor of an export, and corrupted copies of an
export for eprt-check to refuse; eprt's own model fake-quantized as a calibrated checkpoint says,
and transformers' routed experts set to the library's decompression, for the logits oracle
(tests/oracles/test_format_logits.py). Each format's layout invariance is checked with every other
shipped recipe in tests/layouts/test_formats_ep.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.loader import load_model, load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.moe import LocalDispatcher
from eprt.parallel import ParallelState
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.feasibility import quantized_modules
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.preview import fake_quantize
from eprt.quant.recipe import parse_recipe
from eprt.quant.rotation.rotated import RotatedCheckpoint
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors

SAMPLES, SEQ_LEN = 2, 16


def ptq(state: ParallelState, ck: str, out: str, recipe: str, algorithm: str | None = None) -> None:
    settings = dict(calib_size=SAMPLES, seq_len=SEQ_LEN, batch_size=SAMPLES, algorithm=algorithm, progress=False)
    run_ptq(state, PTQArgs(ck, recipe, out, **settings))


@dataclass(frozen=True)
class FormatExports:
    hf: str  # the tiny source
    ck: str  # its eprt checkpoint
    modelopt: str | None  # the ModelOpt-layout export (None: the format has none)
    ct: str | None  # the compressed-tensors export (None: the format has none)


def tiny_checkpoint(d: Path, family: str = "qwen3_moe", **overrides) -> tuple[str, str]:
    """(source dir, eprt checkpoint) of `family`'s tiny model (make_tiny `overrides`), under d."""
    hf = make_tiny(family, str(d / "hf"), **overrides)
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def calibrated_exports(
    ck: str, q: str, recipe: str, layouts: tuple[str, ...], algorithm: str | None = None
) -> tuple[str | None, str | None]:
    """(ModelOpt-layout, compressed-tensors) exports of `ck` calibrated in one process with `recipe`
    (under `algorithm` where given) into q, each made where `layouts` names it ("modelopt", "ct")."""
    ptq(ParallelState.single(), ck, q, recipe, algorithm)
    return (
        export_hf(q, q + "-modelopt", progress=False) if "modelopt" in layouts else None,
        export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors") if "ct" in layouts else None,
    )


def export_format(
    d: Path, recipe: str, family: str = "qwen3_moe", layouts: tuple[str, ...] = ("modelopt", "ct"), **overrides
) -> FormatExports:
    """`family`'s tiny model (make_tiny `overrides`) calibrated in one process with `recipe` and
    exported in `layouts`, under directory d."""
    hf, ck = tiny_checkpoint(d, family, **overrides)
    return FormatExports(hf, ck, *calibrated_exports(ck, str(d / "q"), recipe, layouts))


def modelopt_export(hf: str, config: dict, out: Path) -> str:
    """ModelOpt's own export of the source model in `hf` quantized with its `config`, into out."""
    pytest.importorskip("modelopt")
    pytest.importorskip("transformers")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    # enough tokens that every expert is run (an expert ModelOpt's calibration never ran fails its export)
    tokens = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(torch_model, config, lambda m: m(tokens))
    export_hf_checkpoint(torch_model, export_dir=str(out))
    return str(out)


def quant_config(d: str, name: str) -> dict:
    """The export's hf_quant_config.json 'quantization' (name 'hf_quant_config.json') or its
    config.json's quantization_config (name 'config.json')."""
    config = json.loads(Path(d, name).read_text())
    return config["quantization"] if name == "hf_quant_config.json" else config["quantization_config"]


def ct_scheme(ct: str):
    """(the one quantization scheme of a compressed-tensors export's config, the library's compressor of it)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    (scheme,) = QuantizationConfig.model_validate(quant_config(ct, "config.json")).config_groups.values()
    return scheme, BaseCompressor.get_value_from_registry(scheme.format)


def decompressed(tensors: dict[str, torch.Tensor], module: str, scheme, compressor) -> torch.Tensor:
    """The library's decompression of `module`'s weight from an export's tensors."""
    leaves = (leaf for leaf in compressor.compression_param_names(scheme) if f"{module}.{leaf}" in tensors)
    return compressor.decompress({leaf: tensors[f"{module}.{leaf}"] for leaf in leaves}, scheme)["weight"]


def assert_transformers_loads(ct: str, eprt_value) -> None:
    """transformers loads the compressed-tensors export `ct` on CPU (its decompressing loader), with
    every quantized weight, the routed experts' included, equal to eprt_value(module name)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        ct, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    quantized = {n[: -len(".weight_scale")] for n in read_hf_tensors(ct) if n.endswith(".weight_scale")}
    experts = {m.rsplit(".", 2)[0] for m in quantized if ".experts." in m}
    dense = sorted(m for m in quantized if ".experts." not in m)
    assert experts and dense
    for moe in experts:
        held = loaded.get_submodule(moe)
        width = held.gate_up_proj.shape[1] // 2
        for e in range(held.gate_up_proj.shape[0]):
            assert torch.equal(held.gate_up_proj[e, :width], eprt_value(f"{moe}.{e}.gate_proj"))
            assert torch.equal(held.gate_up_proj[e, width:], eprt_value(f"{moe}.{e}.up_proj"))
            assert torch.equal(held.down_proj[e], eprt_value(f"{moe}.{e}.down_proj"))
    for module in dense:
        assert torch.equal(loaded.get_submodule(module).weight, eprt_value(module)), module


def broken_copy(src: str, dst: Path, name: str, edit) -> str:
    """A copy of export `src` in dst with tensor `name` replaced by edit(tensor)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        if name in tensors:
            tensors[name] = edit(tensors[name])
            save_file(tensors, str(f), metadata={"format": "pt"})
    return str(dst)


def set_first(value: float):
    """An edit for `broken_copy`: the tensor's first element set to value."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return edit


def fake_quantized_model(ck: str, q: str, dtype: torch.dtype):
    """eprt's own model of checkpoint `ck` (eprt.models, in dtype) fake-quantized with calibrated
    checkpoint `q` as the quality report and the preview do it (eprt.quant.preview.fake_quantize):
    every quantized weight is the export's dequantization, the input and KV hooks on. Returns
    (the model, q's recipe, the Calibrator holding q's record and targets, what removes the hooks).
    A recipe that rotates: the model of `ck` read rotated, as its export is."""
    with Checkpoint(ck) as base, Checkpoint(q) as calibrated:
        recipe = parse_recipe(calibrated.quantization["recipe"], q)
        if recipe.rotates:
            model = load_parallel(ResolvedCheckpoint.of(RotatedCheckpoint(base), dtype), ParallelState.single("cpu"))
            model.set_dispatcher(lambda _layer, _block: LocalDispatcher())  # as load_model's
        else:
            model = load_model(ck, dtype=dtype)
        targets = list(quantized_modules(ResolvedCheckpoint.of(base, dtype).layout, recipe, ck))
        record = CalibrationRecord.read(calibrated)
        cal = Calibrator(None, targets, kv=recipe.kv_cache is not None)
        cal.input_amax, cal.expert_amax, cal.expert_tokens, cal.kv_amax = (
            record.input_amax,
            record.expert_input_amax,
            record.expert_tokens,
            record.kv_amax,
        )
        undo = fake_quantize(
            model,
            targets,
            recipe,
            cal,
            ParallelState.single("cpu"),
            source_dtype=lambda name: base.meta(name).source_dtype,
        )
    return model, recipe, cal, undo


def decompress_experts_as_the_library_does(model, ct: str) -> None:
    """Set every routed expert of transformers' `model`, loaded from the compressed-tensors export
    `ct`, to compressed-tensors' own decompression of its tensors under the experts' config group
    (the group transformers picks for them): for NVFP4, whose weight_global_scale transformers 5.24's
    fused-experts decompression leaves out (it builds a module of weight_packed and weight_scale
    only), so that each expert comes out weight_global_scale times too large."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.integrations.compressed_tensors import get_experts_scheme

    scheme = get_experts_scheme(QuantizationConfig.model_validate(quant_config(ct, "config.json")))
    compressor, tensors = BaseCompressor.get_value_from_registry(scheme.format), read_hf_tensors(ct)
    with torch.no_grad():
        for name, experts in model.named_modules():
            if not hasattr(experts, "gate_up_proj"):
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                gate_up = [
                    decompressed(tensors, f"{name}.{e}.{p}", scheme, compressor) for p in ("gate_proj", "up_proj")
                ]
                experts.gate_up_proj[e] = torch.cat(gate_up)
                experts.down_proj[e] = decompressed(tensors, f"{name}.{e}.down_proj", scheme, compressor)
