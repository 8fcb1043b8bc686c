"""NVFP4 W4A4 whose input scale is a constant 1.0, not calibrated: NVFP4's weights byte for byte
(eprt.quant.formats.nvfp4) and an input_scale of 1.0, what ModelOpt writes for its
`nvfp4_experts_only_input_scale1` recipe (its input quantizer's `constant_amax` pinned to 2688 =
6 * 448, so amax / (6 * 448) = 1). No forward pass and no data enter it: the export is data-free
(eprt.quant.datafree), and the engine quantizes each input's 16-element blocks under their own
E4M3 scales, which an input scale of 1 leaves room for up to amax 2688. Its inputs' scales stand
for no statistic of them: an input whose blocks exceed that range saturates, and a block whose amax
is below 6 x 2^-6 = 0.094 gets a subnormal E4M3 block scale, coarsely rounded;
calibrated NVFP4 (`nvfp4`) scales either into range (on eprt's tiny random Qwen3-MoE, whose
activations are small, the quality report measures the experts' relative error at about 0.25).
"""

from __future__ import annotations

from eprt.quant.formats.nvfp4 import Nvfp4

# the input amax ModelOpt's constant_amax pins: input_scale = amax / (E2M1_MAX * FP8_E4M3_MAX) = 1
INPUT_AMAX_OF_SCALE_1 = 6.0 * 448.0


class Nvfp4InputScale1(Nvfp4):
    """NVFP4 weights and inputs, the input scale pinned to 1.0 rather than calibrated."""

    name = "nvfp4_input_scale1"
    uses_activation_statistics = False
    input_block = None
    constant_input_amax = INPUT_AMAX_OF_SCALE_1


NVFP4_INPUT_SCALE1 = Nvfp4InputScale1()
