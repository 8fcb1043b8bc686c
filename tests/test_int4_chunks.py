"""INT4's export numerics walk a weight a chunk of rows at a time (eprt.quant.formats.int4,
`int4_quantized`), on one thread or on workers that take whole chunks, each through buffers of its
own: chunk edges, a shorter last chunk and the workers change no byte of the scales or the packed
codes (against the weight quantized in one chunk, the path tests/test_format_int4.py checks
against compressed-tensors' quantizer), and a NaN in the last chunk is still refused."""

import pytest
import torch

from eprt.kernels.cpu_workers import cpu_workers
from eprt.quant import numerics
from eprt.quant.formats.int4 import INT4, INT4_G32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("workers", [1, 3])
def test_chunk_edges_and_workers_change_no_byte(dtype, workers, monkeypatch):
    w = torch.randn(2, 12, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[1, 3, :128] = 0  # a zero group
    w[0, 5, :128] *= 1e-38  # groups whose amax / 7 is below the least normal scale
    formats = (INT4, INT4_G32)
    whole = {(f.name, mse): f.quantize(w, f.scale(0.0), mse) for f in formats for mse in (False, True)}
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 5 * 256)  # rows 0-4, 5-9, ..., 20-23
    with cpu_workers(workers):
        for (name, mse), want in whole.items():
            fmt = INT4 if name == INT4.name else INT4_G32
            got = fmt.quantize(w, fmt.scale(0.0), mse)
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, mse, k)
        w[1, -1, -1] = float("nan")
        with pytest.raises(ValueError, match="NaN or infinite"):
            INT4.quantize(w, INT4.scale(0.0), False)
