"""Model-free quantization: a Hugging Face checkpoint of any `model_type` quantized shard by shard
under a data-free recipe (eprt.quant.run.datafree), with no model definition and no converted
checkpoint between (`eprt-export HF_DIR OUT --recipe R`; `stream_export`).

- `source`: the checkpoint's tensors by name, each encoded weight decoded as it is read;
- `selection`: which tensors are quantized, by name pattern (or, for a family eprt models, its table);
- `plan`: every output tensor in order, the quantized Linears and their scale groups, the shards;
- `produce`: each output tensor made when it is written;
- `memory`: what a process holds at its peak (the dry run prints it);
- `run`: the shards spread over processes, resumable shard by shard, published atomically.
"""

from eprt.hf.streaming.run import stream_export

__all__ = ["stream_export"]
