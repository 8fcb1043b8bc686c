"""Every shipped recipe on DeepSeek-V4 as released (its wide tiny model: every quantized Linear's input
a whole number of each format's blocks, INT4's groups of 128 included): it calibrates, exports in the
layout that holds it, the export passes eprt-check against the source, what the engines keep
unquantized travels as the source holds it, and every module a compressed-tensors export quantizes
decompresses with the compressed-tensors library to its source weight within the format's rounding."""

import json
from pathlib import Path

import pytest
import torch

from bench.export_digests import wide
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import available
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors

# what no recipe quantizes: the embedding, head, routers, wo_a, a compressor's and the indexer's weights
KEPT = ("embed.weight", "head.weight", "layers.1.ffn.gate.weight", "layers.3.attn.wo_a.weight")
KEPT += ("layers.1.attn.compressor.wkv.weight", "layers.3.attn.indexer.weights_proj.weight", "mtp.0.ffn.gate.weight")
# the library's decompression against the source weight (relative Frobenius error): 4-bit formats
# round to one of 15 or 16 levels a group, 8-bit ones to 255
BOUND = {4: 0.2, 8: 0.05}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v4_recipes")
    hf = make_tiny("deepseek_v4", str(d / "hf"), **wide("deepseek_v4"))
    return hf, convert_hf(hf, str(d / "ck"), progress=False), read_hf_tensors(hf)


@pytest.mark.parametrize("recipe", available())
def test_every_shipped_recipe_exports_passes_the_check_and_decodes(source, recipe, tmp_path):
    hf, ck, tensors = source
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, str(tmp_path / "q"), calib_size=2, seq_len=16, progress=False))
    held = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)  # the layout that holds it
    ct = held if quant_config(held).get("quant_method") == "compressed-tensors" else None
    ct = ct or export_hf(str(tmp_path / "q"), str(tmp_path / "ct"), progress=False, fmt="compressed-tensors")
    for out in dict.fromkeys((held, ct)):  # the compressed-tensors export last
        assert check_export(out, hf) == []
        exported = read_hf_tensors(out)
        for n in KEPT:
            assert raw(exported[n]) == raw(tensors[n]) and exported[n].dtype == tensors[n].dtype, n
    quantized = sorted(n.removesuffix(".weight_scale") for n in exported if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in quantized)  # something is quantized, the routed experts at least
    config = quant_config(ct)
    for module in quantized:
        err, bits = library_error(config, exported, module, tensors[f"{module}.weight"])
        assert err <= BOUND[bits], (recipe, module, err)


def quant_config(out: str) -> dict:
    return json.loads(Path(out, "config.json").read_text()).get("quantization_config", {})


def library_error(config: dict, exported: dict, module: str, weight: torch.Tensor) -> tuple[float, int]:
    """(the relative error of the compressed-tensors library's decompression of `module` against its
    source `weight`, the bits of its scheme): the scheme is the first config group whose targets match."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    qc = QuantizationConfig.model_validate(config)
    scheme = next(
        g for g in qc.config_groups.values() if any(t == "Linear" or match_name(module, t) for t in g.targets)
    )
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    leaves = [leaf for leaf in compressor.compression_param_names(scheme) if f"{module}.{leaf}" in exported]
    decoded = compressor.decompress({leaf: exported[f"{module}.{leaf}"] for leaf in leaves}, scheme)["weight"]
    w = weight.float()
    return ((decoded.float() - w).norm() / w.norm()).item(), scheme.weights.num_bits
