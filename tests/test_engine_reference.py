"""The engine check's reference (bench/engine_reference.py), which dequantizes an export from the
numerics docs/export.md states, against the compressed-tensors library's own decompression of every
quantized weight, for each format the engine check reads; the ModelOpt layout of a format read to
the same weights as its compressed-tensors layout. vLLM is not needed (docs/engine-check.md)."""

from __future__ import annotations

import pytest
import torch

from bench.engine_reference import read_export
from eprt.hf.export import export_hf
from tests.formats_helpers import ct_scheme, decompressed, tiny_checkpoint
from tests.hf_utils import read_hf_tensors

# every quantized Linear's input a multiple of 128 (INT4's and W4A8's groups)
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)
# recipe: (the reference's format name, the input quantization its W8A8 kernels get, ModelOpt layout)
FORMATS = {
    "fp8_block": ("FP8 block", ("fp8-dynamic", 128), True),
    "fp8_channel": ("FP8 channel", ("fp8-dynamic", 0), True),
    "nvfp4_a16": ("NVFP4", None, True),
    "int4": ("INT4", ("fp8-dynamic", 0), False),
    "int4_g32": ("INT4", ("fp8-dynamic", 0), False),
    "w4a8": ("INT4", ("fp8-dynamic", 0), False),
    "mxfp8": ("MXFP8", ("mxfp8", 0), True),
    "mxfp4": ("MXFP4", None, False),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(eprt checkpoint of the wide tiny Qwen3-MoE, its unquantized export's tensor names, a directory)."""
    d = tmp_path_factory.mktemp("engine_reference")
    _, ck = tiny_checkpoint(d, **WIDE)
    return ck, set(read_hf_tensors(export_hf(ck, str(d / "source"), progress=False))), d


@pytest.mark.parametrize("recipe", sorted(FORMATS))
def test_reference_dequantizes_as_compressed_tensors(model, recipe):
    ck, source_names, d = model
    fmt, inputs, has_modelopt = FORMATS[recipe]
    ct = export_hf(ck, str(d / f"{recipe}-ct"), progress=False, fmt="compressed-tensors", recipe=recipe)
    weights, modules = read_export(ct)
    # a plain checkpoint: the source's tensors, each quantized weight in bf16, no scale left
    assert set(weights) == source_names
    tensors = read_hf_tensors(ct)
    quantized = {n.rpartition(".")[0] for n in tensors if n.endswith((".weight_packed", ".weight_scale"))}
    assert set(modules) == quantized and any(".experts." in m for m in quantized)
    scheme, compressor = ct_scheme(ct)
    for name, m in modules.items():
        assert m.fmt == fmt, name
        assert (m.inputs and (m.inputs.kind, m.inputs.group)) == inputs, name
        library = decompressed(tensors, name, scheme, compressor).to(torch.bfloat16)
        assert torch.equal(weights[f"{name}.weight"], library), name
    if has_modelopt:
        modelopt_weights, modelopt_modules = read_export(
            export_hf(ck, str(d / f"{recipe}-modelopt"), progress=False, recipe=recipe)
        )
        assert set(modelopt_weights) == source_names and set(modelopt_modules) == quantized
        for name, t in weights.items():
            assert torch.equal(modelopt_weights[name], t), name
