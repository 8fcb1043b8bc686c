"""What a weight format is to eprt: the one object every other module asks about it.

A format (one module of this package, registered in `eprt.quant.formats.WEIGHT_FORMATS` under its
recipe name) owns
- its numerics: the per-tensor scale from an amax (`scale`), the per-tensor weight scale under `mse`
  (`mse_weight_scale`), the export tensors of a weight (`quantize`, keyed by ModelOpt leaf), their
  decoding (`dequantize`), the values an engine computes with (`fake_quantize_weight`,
  `fake_quantize_input`) and GPTQ's column quantizer (`columns`);
- its export tensors: leaf names, dtypes and shapes from the weight's [out, in] in the ModelOpt
  layout (`modelopt_tensors`) and in compressed-tensors' (`compressed_tensors_tensors`, with
  `to_compressed_tensors` mapping one onto the other);
- its layout descriptions: ModelOpt's `quant_algo`, config-group arguments and per-module
  config (`modelopt_group`, `modelopt_layer`), compressed-tensors' preset scheme and `format`;
- what the checks need: the leaves holding the per-tensor scales, the block-scale grid, the largest
  code and input a scale stands for.

`mse` (a rule's `algorithm: mse`, docs/export.md, 'Weight scales') asks the format for the scales
of least squared error: each format decides which of its scales are searched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eprt.quant.formats.block_columns import BlockColumns
from eprt.quant.formats.block_mse import MSE_BYTES_PER_CHUNK_ELEMENT, chunk_rows, mse_grid
from eprt.storage.safetensors_io import dtype_name

# leaf -> (dtype, shape) of one quantized Linear's tensors in an export layout
Tensors = dict[str, tuple[torch.dtype, tuple[int, ...]]]
CT_SCALAR = (1,)  # compressed-tensors stores a per-tensor scale as [1], ModelOpt as []


class WeightFormat:
    """One weight format; subclasses set the attributes and implement the methods below."""

    name: str  # the recipe's `format:`
    quant_algo: str  # ModelOpt's quant_algo, also how messages name the format
    num_bits: int  # of a code, as the layouts' config groups declare it
    group_size: int | None = None  # elements sharing a block scale along the input dim; None: per tensor
    # Linears the engines fuse (eprt.quant.fusion) share the per-tensor weight and input amax: the
    # engine keeps one per-tensor weight scale and one input scale for the fused weight
    shares_fused_scales: bool = False
    # the quotient is rounded to the weight's dtype before the format's own rounding, as ModelOpt
    # divides a bf16 weight (eprt.quant.scales.as_quantized quantizes the source's dtype then)
    rounds_in_weight_dtype: bool = False
    # GPTQ sweeps its columns by descending Hessian diagonal where a rule leaves it to the format
    # (eprt.quant.algorithms.registry.GPTQParams.actorder)
    gptq_actorder: bool = True
    # ModelOpt's per-tensor weight scale (weight_scale_2 beside NVFP4's block scales); None: none
    weight_scale_leaf: str | None
    block_scale_leaf: str | None = None  # ModelOpt's and compressed-tensors' block-scale grid
    # a row's codes depend on other rows (a block spans them): gate and up, stacked in one row of a
    # routed expert's first projection, are quantized apart, each in its own blocks, as the releases store them
    blocks_span_rows: bool = False
    algorithms: tuple[str, ...] = ("max", "mse", "gptq")  # the recipe algorithms it implements
    # its scales need calibrated statistics (a static input scale); False: weight-only or inputs the
    # engine scales at run time, whose scales come from the weights alone
    uses_activation_statistics: bool = True
    # the ModelOpt layout (`eprt-export --format modelopt`) writes it; False: compressed-tensors' only
    modelopt_layout: bool = True
    ct_preset: str  # compressed-tensors' preset scheme
    ct_format: str  # compressed-tensors' compression format
    ct_strategy: str  # its weights' strategy: tensor, tensor_group, block, channel, group
    ct_weight_type: str = "float"  # its weights' type in a config group: float or int
    ct_weight_scale_leaf: str | None  # None: the format has no per-tensor scale
    ct_input_scale_leaf: str | None  # None: no static input scale (dynamic or unquantized inputs)
    ct_reciprocal: bool = False  # compressed-tensors stores the per-tensor scales as 1/scale
    # what input_scale stands for: the largest input code times the scale; None: no input_scale
    largest_input: float | None
    # its export needs an amax of the inputs from calibration's forward passes (a static input
    # scale); False where the engine scales inputs at run time or leaves them unquantized: with
    # weight-only algorithms and no KV cache, such a recipe takes the data-free path (eprt.quant.run.datafree)
    uses_activation_statistics: bool = True
    # an input amax the format pins rather than calibrates (its input_scale is this amax's scale);
    # None: the input scale, where it has one, comes from calibration
    constant_input_amax: float | None = None
    # its inputs quantize at run time in blocks of this size under the calibrated per-tensor input
    # scale (NVFP4 W4A4): where a recipe's act_headroom sets that scale (eprt.quant.act_headroom)
    input_block: int | None = None
    # The export's memory plan (eprt.hf.export_plan): bytes a weight element being quantized holds
    # at the peak of `quantize`, besides the weight as read (its temporaries and its export
    # tensors), and bytes of chunk buffers each thread that quantizes keeps from call to call
    # (eprt.quant.numerics.chunk_buffer, bounded by a chunk whatever the weight). Each format
    # counts its own from its code; tests/test_export_plan.py measures them.
    export_working_bytes: float
    export_worker_bytes: int = 0
    # Under `mse`, what its search adds: bytes an element where it searches the whole weight at once,
    # and a thread's bytes where it searches a chunk of rows at a time (`mse_search_bytes`).
    export_mse_working_bytes: float = 0.0

    @property
    def kind(self) -> tuple:
        """What formats share to be one another in other groups (a rule's `group_size`): their class."""
        return (type(self),)

    def mse_search_bytes(self, in_dim: int) -> int:
        """Bytes a thread's mse search holds at once for a weight of `in_dim` columns, beyond
        `export_mse_working_bytes` an element."""
        return 0

    # --- numerics ---------------------------------------------------------------------------
    def scale(self, amax) -> torch.Tensor:
        """The per-tensor scale (fp32 0-dim) of an amax: a weight's (max) or an input's."""
        raise NotImplementedError

    def pinned_input_scale(self) -> torch.Tensor | None:
        """The input scale the format pins rather than calibrates (`constant_input_amax`'s), else None."""
        return self.scale(self.constant_input_amax) if self.constant_input_amax is not None else None

    def mse_weight_scale(self, w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """w's per-tensor weight scale under `mse`, from `amax` (its own, or its fused group's):
        the scale of `amax` where the format searches only other scales."""
        return self.scale(amax)

    def headroom_scale(self, amax) -> torch.Tensor | None:
        """The per-tensor weight scale of `amax` with headroom for the mse search (a recipe's
        scale_headroom), where the format has one; None where it has none."""
        return None

    def exact_weight_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """A per-tensor weight scale under which the format keeps w's values exactly, where it has one
        for w (NVFP4 for a weight stored in MXFP4: a routed expert's row of a Kimi-K3 source), else
        None; `quantize` then keeps them under it."""
        return None

    def mxfp4_blocks_kept(self, scales: torch.Tensor) -> tuple[int, int] | None:
        """(blocks, blocks kept exactly) of stacked experts a source stores in MXFP4, from their E8M0
        scales uint8 [E, rows, in/32], where the format keeps such weights (`exact_weight_scale`);
        None where it does not."""
        return None

    def quantize(self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool) -> dict[str, torch.Tensor]:
        """The ModelOpt tensors of w but input_scale, keyed by leaf, under per-tensor `w_scale`."""
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The weight an engine computes with, from `quantize`'s tensors."""
        raise NotImplementedError

    def fake_quantize_weight(
        self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool, dtype: torch.dtype
    ) -> torch.Tensor:
        """`dequantize(quantize(...))` in `dtype`."""
        return self.dequantize(self.quantize(w, w_scale, mse), dtype)

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """An input as the engine quantizes it at run time under its input_scale, in x's dtype."""
        raise NotImplementedError

    def columns(self, w: torch.Tensor, scales: torch.Tensor):
        """GPTQ's column quantizer (eprt.quant.algorithms.gptq.solve) for original weights w [L, out, in] with
        their per-tensor weight scales [L]: `round(j, col_LO)`, `encode(q)`, `decode(codes)`. A
        format whose blocks span rows (`blocks_span_rows`) also takes `pieces`: the weights a row
        of w holds end to end (a gated routed expert's first projection: gate and up), quantized apart."""
        raise NotImplementedError

    def quantize_stacked(
        self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool, pieces: int
    ) -> dict[str, torch.Tensor]:
        """`quantize` of w [out, in] whose rows hold `pieces` weights end to end (a gated routed
        expert's first projection: gate and up) under one per-tensor scale: in one call where rows quantize apart anyway
        (each piece is a slice of it, the same bytes as quantized alone), each piece in blocks of
        its own where blocks span rows (`blocks_span_rows`)."""
        if not self.blocks_span_rows or pieces == 1:
            return self.quantize(w, w_scale, mse)
        parts = [self.quantize(p, w_scale, mse) for p in w.chunk(pieces)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def dequantize_stacked(self, t: dict[str, torch.Tensor], dtype: torch.dtype, pieces: int) -> torch.Tensor:
        """`dequantize` of `quantize_stacked`'s tensors."""
        if not self.blocks_span_rows or pieces == 1:
            return self.dequantize(t, dtype)
        parts = [dict(zip(t, p)) for p in zip(*(v.chunk(pieces) for v in t.values()))]
        return torch.cat([self.dequantize(p, dtype) for p in parts])

    def unfit_input_dim(self, in_dim: int) -> bool:
        """Whether a weight with this input dim cannot be quantized (blocks must fill it)."""
        return self.group_size is not None and in_dim % self.group_size != 0

    # --- export tensors ---------------------------------------------------------------------
    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        """The ModelOpt tensors of a Linear of weight [out_dim, in_dim], the stored weight first."""
        raise NotImplementedError

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        """compressed-tensors' tensors of a Linear of weight [out_dim, in_dim], the stored weight first."""
        raise NotImplementedError

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One Linear's compressed-tensors tensors from its ModelOpt ones (the same quantized values)."""
        raise NotImplementedError

    # --- layout descriptions ----------------------------------------------------------------
    def modelopt_group(self) -> dict:
        """A config group's `weights` (and `input_activations`) arguments in config.json."""
        args = {"dynamic": False, "num_bits": self.num_bits, "type": "float"}
        return args if self.group_size is None else {**args, "group_size": self.group_size}

    def modelopt_input_group(self) -> dict | None:
        """A config group's `input_activations` in config.json; None for inputs left unquantized."""
        return self.modelopt_group()

    def modelopt_layer(self) -> dict:
        """hf_quant_config.json's quantization of one module (a MIXED_PRECISION entry)."""
        layer = {"quant_algo": self.quant_algo}
        return layer if self.group_size is None else {**layer, "group_size": self.group_size}

    # --- what the checks read ---------------------------------------------------------------
    @property
    def modelopt_leaves(self) -> tuple[str, ...]:
        return tuple(self.modelopt_tensors(1, 1))

    @property
    def modelopt_weight_dtype(self) -> str:
        """The stored weight's safetensors dtype in the ModelOpt layout."""
        return dtype_name(next(iter(self.modelopt_tensors(1, 1).values()))[0])

    @property
    def modelopt_per_tensor_scales(self) -> tuple[str | None, str | None]:
        """(weight, input) per-tensor scale leaves in the ModelOpt layout, None for one it lacks."""
        return self.weight_scale_leaf, "input_scale" if "input_scale" in self.modelopt_leaves else None

    @property
    def modelopt_scale_rank(self) -> int:
        """The rank of the ModelOpt layout's first scale (FP8's 0-dim weight_scale, a block grid's 2)."""
        return len(list(self.modelopt_tensors(1, 1).values())[1][1])

    @property
    def modelopt_scale_dtype(self) -> str:
        """The safetensors dtype of the ModelOpt layout's first scale (FP8 block's F32 grid, MXFP8's U8 one)."""
        return dtype_name(list(self.modelopt_tensors(1, 1).values())[1][0])

    @property
    def ct_leaves(self) -> dict[str, str]:
        """compressed-tensors' leaves -> their safetensors dtypes, the stored weight first."""
        return {leaf: dtype_name(dtype) for leaf, (dtype, _) in self.compressed_tensors_tensors(1, 1).items()}

    @property
    def ct_weight_leaf(self) -> str:
        return next(iter(self.ct_leaves))

    @property
    def ct_per_tensor_scales(self) -> tuple[str | None, str | None]:
        """(weight, input) per-tensor scale leaves in the compressed-tensors layout, None for one it lacks."""
        return self.ct_weight_scale_leaf, self.ct_input_scale_leaf

    def in_dim_of_stored(self, stored_in_dim: int) -> int:
        """The input dim of a weight whose stored tensor is `stored_in_dim` wide (codes packed a byte)."""
        return stored_in_dim

    def largest_code(self, largest_block: float | None) -> float:
        """The largest weight a per-tensor weight scale of 1 stands for, given the largest block
        scale where known."""
        raise NotImplementedError


class ScaledByBlocks(WeightFormat):
    """A format whose only scales are a grid of block (or row) scales stored as `weight_scale`, from
    the weights alone: nothing per tensor (so nothing for fused Linears to share and no calibrated
    statistic) (FP8 block and per channel, MXFP8, MXFP4). Under max a cell's scale is its amax's;
    under mse each cell's is searched among the format's candidates (eprt.quant.formats.block_mse).
    GPTQ rounds its columns under max's grid of the original weight
    (eprt.quant.formats.block_columns). A subclass names the functions of its scales, codes and
    their decoding, its mse candidates, and how its scales spread over a row's columns and an fp32
    quotient rounds, for GPTQ."""

    block_scale_leaf = "weight_scale"
    uses_activation_statistics = False
    weight_scale_leaf = None
    ct_weight_scale_leaf = ct_input_scale_leaf = None
    largest_input = None
    scales_of: Callable[[torch.Tensor], torch.Tensor]  # the scale grid of a weight
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # its codes under them
    decode: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]  # codes, scales -> values
    scale_width: int | None  # consecutive columns of a row under one scale of the grid; None: the row
    scale_height: int = 1  # consecutive rows under one scale of the grid (FP8 block's 128)
    # fp32 values of the codes nearest an fp32 quotient, as `encode` rounds it (saturating; a
    # negative value that rounds to zero keeps its sign where the codes do)
    round_quotient: Callable[[torch.Tensor], torch.Tensor]

    # bytes a cell of the scale grid holds in the mse search's candidate grids (`mse_candidates`) and
    # its choice: FP8's 16 fp32 scales and the chosen one
    mse_grid_bytes: int = 17 * 4

    @property
    def export_mse_working_bytes(self) -> float:
        # the candidate grids, a cell's `mse_grid_bytes`; a row's (FP8 per channel) too few to count
        return self.mse_grid_bytes / (self.scale_height * self.scale_width) if self.scale_width else 0.0

    def mse_search_bytes(self, in_dim: int) -> int:
        return MSE_BYTES_PER_CHUNK_ELEMENT * chunk_rows(in_dim, self.scale_height) * in_dim

    def row_scales(self, scales: torch.Tensor, out_dim: int) -> torch.Tensor:
        """fp32 [..., out_dim, in/scale_width]: grid `scales` of a weight of `out_dim` rows as each
        row's scales, one per `scale_width` columns (the values `decode` multiplies codes by)."""
        raise NotImplementedError

    def scale(self, amax) -> torch.Tensor:
        # no per-tensor scale is written; the export asks for one of every format, and gets amax's
        return torch.as_tensor(amax, dtype=torch.float32).reshape(())

    def mse_candidates(self, w: torch.Tensor) -> list[torch.Tensor]:
        """The grids the mse search chooses each cell's scale among, max's own (`scales_of(w)`)
        first. Raises ValueError for a weight holding NaN or infinity."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool) -> dict[str, torch.Tensor]:
        scales = mse_grid(self, w) if mse else self.scales_of(w)
        return {"weight": self.encode(w, scales), "weight_scale": scales}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.decode(t["weight"], t["weight_scale"], dtype)

    def columns(self, w: torch.Tensor, scales: torch.Tensor, pieces: int = 1) -> BlockColumns:
        return BlockColumns(self, w, pieces)  # the grid from w: no per-tensor scale enters
