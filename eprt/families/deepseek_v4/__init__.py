"""DeepSeek-V4 (`deepseek_v4`: Flash 284B, Pro 1.6T): hyper-connected residual streams, MQA over a
sliding window and compressed entries (CSA, HCA), hash-routed then sqrt(softplus)-routed experts
clamped at swiglu_limit, one shared expert; MTP layers. Config in config.py, tensors in
layout.py, the model in model.py."""

from eprt.families.deepseek_v4 import config, layout, model
from eprt.families.family import COMMON_UNQUANTIZED, Family

FAMILY = Family(
    "deepseek_v4",
    ("deepseek_v4",),
    config.parse,
    layout.layout,
    model.DeepseekV4ForCausalLM,
    # what DeepSeek's release stores in fp32 and its reference computes with in fp32: the
    # hyper-connections, the sinks, the compressors' position biases and the router's bias. (Its
    # norms and router weight are stored in the model dtype and computed with in fp32: the model
    # upcasts them itself, and keeping them in the model dtype keeps AWQ's folds into them exact.)
    fp32=(
        r".*\.hc_(attn|ffn)_(fn|base|scale)",
        r"(model\.hc_head\.hc_|hc_head_)(fn|base|scale)",
        r".*\.attn_sink",
        r".*\.ape",
        r".*\.ffn\.gate\.bias",
    ),
    # The head (`head`, not `lm_head`) and the router, as in every family; DeepSeek's release and
    # reference keep in bf16 the grouped output projection's first half (wo_a, an einsum over its
    # groups, not a Linear), the compressors' projections (computed in fp32) and the indexer's
    # head weights: no recipe quantizes them.
    unquantized=(
        *COMMON_UNQUANTIZED,
        r"head",
        r".*\.ffn\.gate",
        r".*\.attn\.wo_a",
        r".*\.compressor\.(wkv|wgate)",
        r".*\.indexer\.weights_proj",
    ),
    # its MTP layers (the release's `mtp.K.`) run on the model's own embedding (their `decoder_parts`)
    mtp_model=model.DeepseekV4MTP,
    mtp_prefix=layout.mtp_prefix,
    # Its attention is `attn`: the Linears vLLM's DeepSeek-V4 builds quantizable (wq_a and wkv fused,
    # wq_b, wo_b, the indexer's wq_b) answer to the shipped recipes' `*.self_attn.*` too.
    recipe_aliases=((r"(.*\.)attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)", r"\1self_attn.\2"),),
)
