"""Scale without the weights: Kimi-K2's, DeepSeek-V3's, Mistral-Small-4's, GLM-5's, MiniMax-M2's, MiniMax-M3's,
Llama-4 Maverick's, Nemotron-3 Ultra's, GPT-OSS-120B's and DeepSeek-V4-Pro's real tensor counts and real
dims, on any machine.

    python bench/scale.py [--model kimi_k2 --model deepseek_v3 --model mistral4 --model glm_moe_dsa
                           --model minimax_m2 --model minimax_m3 --model llama4_maverick
                           --model nemotron3_ultra --model gpt_oss_120b --model deepseek_v4_pro]
                          [--worlds 8 16] [--seq-len 2048] [--calib-size 64]

Two checkpoints per model, neither holding weight bytes worth the name:
- real counts: the model's layers, experts and MTP layers at tiny dims, encoded as released (Kimi-K2 and
  DeepSeek-V3 in block FP8, Kimi-K2: 139,583 tensors in 62 shards; Mistral-Small-4 in per-tensor FP8, its
  experts fused; MiniMax-M2 in block FP8; MiniMax-M3 in MXFP8; Maverick in bf16, each layer's experts fused;
  GPT-OSS-120B's experts in OpenAI's MXFP4, fused; DeepSeek-V4-Pro in FP8 with its FP4 experts, every
  scale E8M0: 145,047 tensors in 64 shards).
  Make, convert, the dry run at each world and the export (as it came) are
  timed: every step must grow about linearly in the tensor count.
- real dims: the converted checkpoint's manifest and safetensors headers rewritten to the real shapes, the
  data left as file holes (a file of 1 TB apparent size taking a few MB of disk). Nothing reads its weights;
  the dry run plans each rank's peak memory from it, for max calibration and for GPTQ.
Prints one table. The step's own progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from eprt.families import parse_hf_config, reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.storage.checkpoint import MANIFEST  # noqa: E402
from eprt.storage.safetensors_io import SAFETENSORS_DTYPES  # noqa: E402
from eprt.testing.tiny import (  # noqa: E402
    make_tiny,
    mtp_specs,
    released,
    tiny_config,
)

# MiniMax-M3 (428B-A23B): its first 3 layers dense, the other 57 sparse attention and MoE
M3_SPARSE = [0] * 3 + [1] * 57
# The released config.json values that set tensor counts and sizes (the rest comes from eprt's tiny
# config of the model's family: rope, scoring, norms); a VLM's are its text_config's.
REAL = {
    "kimi_k2": dict(
        model_type="kimi_k2",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=61,
        num_nextn_predict_layers=0,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=131072,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_nextn_predict_layers=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        max_position_embeddings=163840,
    ),
    "mistral4": dict(
        model_type="mistral4",
        vocab_size=131072,
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=32,
        q_lora_rank=1024,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        max_position_embeddings=1048576,
    ),
    "minimax_m2": dict(
        vocab_size=200064,
        hidden_size=3072,
        num_hidden_layers=62,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        rotary_dim=64,
        intermediate_size=1536,
        num_local_experts=256,
        num_experts_per_tok=8,
        attn_type_list=[1] * 62,
        max_position_embeddings=196608,
    ),
    "minimax_m3": dict(
        vocab_size=200064,
        hidden_size=6144,
        num_hidden_layers=60,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=3072,
        dense_intermediate_size=12288,
        shared_intermediate_size=3072,
        num_local_experts=128,
        num_experts_per_tok=4,
        moe_layer_freq=M3_SPARSE,
        sparse_attention_config={
            "sparse_attention_freq": M3_SPARSE,
            "sparse_disable_index_value": M3_SPARSE,
            "sparse_num_index_heads": 4,
            "sparse_index_dim": 128,
            "sparse_block_size": 128,
            "sparse_topk_blocks": 16,
            "sparse_local_block": 1,
        },
        max_position_embeddings=524288,
    ),
    # GLM-5 (744B); every layer runs its indexer (GLM-5.1 on may mark some "shared": fewer indexer tensors)
    "glm_moe_dsa": dict(
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        num_hidden_layers=78,
        num_nextn_predict_layers=1,
        num_attention_heads=64,
        num_key_value_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        index_topk_freq=1,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
        max_position_embeddings=202752,
    ),
    # Llama-4 Maverick's language model (the VLM's text_config): MoE and dense layers interleaved
    "llama4_maverick": dict(
        model_type="llama4_text",
        vocab_size=202048,
        hidden_size=5120,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=128,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        moe_layers=None,
        no_rope_layers=None,
        use_qk_norm=False,
        attention_chunk_size=8192,
        floor_scale=8192,
        rope_scaling=None,
        max_position_embeddings=1048576,
    ),
    # Nemotron-3 Ultra (550B-A55B), an estimate: NVIDIA states the hidden size (8192), the latent (2048), 512
    # experts with 22 active, LatentMoE and one MTP layer; the layer pattern, Mamba-2 and attention sizes
    # are Nemotron-3 Nano's and Super's scaled to that width, the experts' widths set to give 550B-A55B
    "nemotron3_ultra": dict(
        model_type="nemotron_h",
        vocab_size=131072,
        hidden_size=8192,
        hybrid_override_pattern="MEMEM*EMEMEM*E" * 6 + "MEME",
        num_attention_heads=64,
        num_key_value_heads=2,
        head_dim=128,
        mamba_num_heads=256,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        chunk_size=128,
        n_routed_experts=512,
        num_experts_per_tok=22,
        moe_intermediate_size=6400,
        moe_shared_expert_intermediate_size=12288,
        moe_latent_size=2048,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="*E",
        max_position_embeddings=1048576,
    ),
    # GPT-OSS-120B: every layer MoE, sliding-window and full attention alternating
    "gpt_oss_120b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=128,
        num_experts_per_tok=4,
        experts_per_token=4,
        layer_types=["sliding_attention", "full_attention"] * 18,
        sliding_window=128,
        max_position_embeddings=131072,
    ),
    # DeepSeek-V4-Pro (1.6T): 61 layers, two heavily compressed ones then CSA and HCA in turn (the
    # MTP layer's ratio last), the first 3 hash-routed; 4 residual streams
    "deepseek_v4_pro": dict(
        model_type="deepseek_v4",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_nextn_predict_layers=1,
        num_attention_heads=128,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        compress_ratios=[128, 128] + [4 if i % 2 else 128 for i in range(59)] + [0],
        compress_rate_hca=128,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=1024,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        moe_intermediate_size=3072,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=6,
        num_hash_layers=3,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=1048576,
    ),
}
# each model's release: (the eprt family of its tiny config, how make_tiny stores it as released, its
# shards: about 5 GB each where the count is not the release's own)
RELEASE = {
    "kimi_k2": ("deepseek_v3", {"source_format": "fp8-block"}, 62),
    "deepseek_v3": ("deepseek_v3", {"source_format": "fp8-block"}, 163),
    "mistral4": ("mistral4", released("mistral4"), 24),
    "glm_moe_dsa": ("glm_moe_dsa", {"source_format": "fp8-block"}, 150),  # a round number: steps grow with tensors
    "minimax_m2": ("minimax_m2", {"source_format": "fp8-block"}, 130),
    "minimax_m3": ("minimax_m3_vl", {"source_format": "mxfp8"}, 86),
    "llama4_maverick": ("llama4_text", released("llama4_text"), 55),  # bf16, its experts fused
    "nemotron3_ultra": ("nemotron_h", released("nemotron_h"), 110),  # bf16 (its NVFP4 release is ModelOpt's own export)
    "gpt_oss_120b": ("gpt_oss", released("gpt_oss"), 15),
    "deepseek_v4_pro": ("deepseek_v4", released("deepseek_v4"), 64),  # FP8 and FP4 experts, E8M0 scales
}
# Tiny dims with the real counts: every width small, every count (layers, experts, MTP) as released.
SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
SMALL_GQA = dict(SMALL, num_key_value_heads=2, head_dim=16)  # two query heads share a key/value head
DEEPSEEK_TINY_DIMS = dict(
    SMALL,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
)
TINY_DIMS = {
    "deepseek_v3": DEEPSEEK_TINY_DIMS,
    "mistral4": DEEPSEEK_TINY_DIMS,
    "glm_moe_dsa": DEEPSEEK_TINY_DIMS,
    "minimax_m2": dict(SMALL_GQA, rotary_dim=8, intermediate_size=32),
    "minimax_m3_vl": dict(
        SMALL,
        head_dim=16,
        intermediate_size=32,
        dense_intermediate_size=48,
        shared_intermediate_size=16,
        sparse_attention_config={"sparse_index_dim": 16},
    ),
    "nemotron_h": dict(
        SMALL_GQA,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_latent_size=32,
    ),
    "deepseek_v4": dict(
        SMALL,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        moe_intermediate_size=32,
    ),
    "llama4_text": dict(SMALL_GQA, intermediate_size=32, intermediate_size_mlp=128),
    "gpt_oss": dict(SMALL_GQA, intermediate_size=32),
}
DRY_RUNS = (("max", []), ("gptq", ["--recipe", "nvfp4", "--algorithm", "gptq"]))
# where eprt runs the model's MTP layers: a recipe that quantizes them, whose plan holds them
MTP_RUN = ("max, MTP layers run", ["--recipe", "nvfp4_experts_fp8_attention_mtp"])
GPU = ["--device", "cuda"]  # planned for GPU ranks from this host, whatever it has


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn, *args, **kw) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


def real_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape, for every tensor the family's layout gives the real config. The MTP layers are
    stored as convert carries them: under their Hugging Face names, each routed expert's weights apart
    (those eprt does not run, DeepSeek-V3.2's and GLM-5's, only carried: their shapes as the release's)."""
    cfg = parse_hf_config(hf, "the real config")
    layout = reader_for(cfg.model_type, "the real config").layout(cfg)
    shapes = {s.name: s.shape for s in layout.specs}
    for spec in layout.mtp or mtp_specs(hf, cfg):
        shapes.update(
            {source: spec.source_shape() for source in spec.sources} if spec.stacked else {spec.name: spec.shape}
        )
    return shapes


def inflate(ck: str, hf: dict, out: str) -> int:
    """Write `ck` (converted at tiny dims) again at the real dims of `hf` into `out`, every tensor's data a file
    hole; returns the apparent bytes of the weight files."""
    with open(os.path.join(ck, MANIFEST)) as f:
        m = json.load(f)
    shapes = real_shapes(hf)
    cfg = parse_hf_config(hf, "the real config")
    m["config"], m["source_config"] = cfg.to_json(), hf
    by_file: dict[str, list[tuple[str, str, list[int]]]] = {}
    for name, t in m["tensors"].items():
        if name not in shapes and t["role"] != "passthrough":  # a VLM's vision tower keeps its tiny shape
            raise SystemExit(f"{name}: not in the real layout; the tiny and the real configs disagree")
        t["shape"] = list(shapes.get(name, t["shape"]))
        for part in t["parts"]:  # converted checkpoints write one whole part per tensor
            part["rows"] = [0, t["shape"][0] if t["shape"] else 0]
            by_file.setdefault(part["file"], []).append((part["key"], t["dtype"], t["shape"]))
    os.makedirs(os.path.join(out, "hf"))
    total = 0
    for fname, entries in by_file.items():
        total += write_holes(os.path.join(out, fname), entries)
    for rel in m["files"]:
        src, dst = os.path.join(ck, "hf", rel), os.path.join(out, "hf", rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(json.dumps(hf).encode() if rel == "config.json" else f.read())
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(m, f)
    return total


def write_holes(path: str, entries: list[tuple[str, str, list[int]]]) -> int:
    """A safetensors file whose header describes `entries` and whose data is one hole."""
    header, offset = {}, 0
    for key, dtype, shape in entries:
        n = SAFETENSORS_DTYPES[dtype].itemsize * math.prod(shape)
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def dry_run(ck: str, world: int, extra: list[str], seq_len: int, calib_size: int) -> tuple[list[list[str]], str, float]:
    """Each rank's row of the dry run's table (split in words), rank 0's plan by its terms, and the run's wall time."""
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "ptq.py"),
        "--nproc-per-node",
        str(world),
        ck,
        "--dry-run",
        "--seq-len",
        str(seq_len),
        "--calib-size",
        str(calib_size),
        "--eval-size",
        "0",
        *extra,
    ]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - start
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rows = [line.split() for line in p.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s+\[", line)]
    terms = next((line for line in p.stdout.splitlines() if line.startswith("memory plan")), "")
    return rows, terms, took


def over(base: dict, fields: dict) -> dict:
    """`base` with `fields` set, nested objects merged one level."""
    nested = {k: {**base[k], **v} for k, v in fields.items() if isinstance(v, dict) and isinstance(base.get(k), dict)}
    return {**base, **fields, **nested}


def with_fields(family: str, config: dict, fields: dict) -> dict:
    """`config` of the family with `fields` set: a VLM's in its text_config."""
    if "text_config" in tiny_config(family):
        return {**config, "text_config": over(config["text_config"], fields)}
    return over(config, fields)


def scale(model: str, worlds: list[int], seq_len: int, calib_size: int, tmp: str) -> list[tuple[str, str]]:
    real = REAL[model]
    family, storage, shards = RELEASE[model]
    # make_tiny's keywords: the real counts at tiny dims, over the family's tiny config
    counts = with_fields(family, tiny_config(family), over(real, TINY_DIMS[family]))
    root = os.path.join(tmp, model)
    rows = []
    say(f"{model}: making the real-count checkpoint, encoded as released")
    hf, t_make = timed(make_tiny, family, os.path.join(root, "hf"), shards=shards, **storage, **counts)
    ck, t_convert = timed(convert_hf, hf, os.path.join(root, "ck"), progress=False)
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        n_source = len(json.load(f)["weight_map"])
    with open(os.path.join(ck, MANIFEST)) as f:
        n_tensors = len(json.load(f)["tensors"])
    rows += [
        (f"{model} real counts", f"{n_source:,} tensors in {shards} shards, {n_tensors:,} in eprt's layout"),
        ("  make (s)", f"{t_make:.1f}"),
        ("  convert (s)", f"{t_convert:.1f}"),
    ]
    _, t_export = timed(export_hf, ck, os.path.join(root, "export"), progress=False)
    rows.append(("  export as it came (s)", f"{t_export:.1f}"))
    for world in worlds:
        *_, took = dry_run(ck, world, [], 64, world)
        rows.append((f"  dry run, world {world} (s)", f"{took:.1f}"))
    say(f"{model}: inflating to the real dims")
    # in bf16, the dtype calibration runs in: every tensor raw, so its real shape is all the inflation needs
    plain = convert_hf(
        make_tiny(family, os.path.join(root, "hf-bf16"), **counts), os.path.join(root, "ck-bf16"), progress=False
    )
    big = os.path.join(root, "real")
    apparent = inflate(plain, with_fields(family, make_config(hf), real), big)
    disk = sum(os.stat(os.path.join(big, f)).st_blocks * 512 for f in os.listdir(big) if f.endswith(".safetensors"))
    rows.append((f"{model} real dims", f"{apparent / 2**40:.2f} TiB of weights in {disk / 2**20:.1f} MiB on disk"))
    cfg = parse_hf_config(with_fields(family, make_config(hf), real), "the real config")
    runs_mtp = cfg.num_nextn_predict_layers and reader_for(cfg.model_type, "the real config").mtp_model
    for world in worlds:
        for label, extra in (*DRY_RUNS, MTP_RUN) if runs_mtp else DRY_RUNS:
            ranks, terms, took = dry_run(big, world, [*GPU, *extra], seq_len, calib_size)
            device = sorted({" ".join(r[-4:-2]) for r in ranks})
            host = sorted({" ".join(r[-2:]) for r in ranks})
            rows.append(
                (
                    f"  {label} at world {world}, {calib_size} x {seq_len} tokens: peak per GPU; host",
                    f"{', '.join(device)}; {', '.join(host)} ({took:.1f} s)",
                )
            )
            rows.append(("    rank 0's plan", terms.split(": ", 1)[-1]))
    return rows


def make_config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(REAL), help="default: all")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--calib-size", type=int, default=64, help="calibration sequences of the real-dims plans")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.model or sorted(REAL):
            rows += scale(model, a.worlds, a.seq_len, a.calib_size, tmp)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
