"""The Kimi family's models against outside implementations, on tiny random checkpoints in the
real layout: Kimi-Linear and Kimi-K2.5 against transformers, Kimi-K3 against mlx-lm's kimi_k3
(transformers has no K3), Kimi-VL against transformers' DeepSeek-V3 on its text config, all in
float32; and the chunked KDA against its recurrence."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

import eprt  # noqa: E402
from eprt.config import SiTUConfig  # noqa: E402
from eprt.errors import CheckpointError, ConfigError  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.families.kimi_linear.config import LatentExperts  # noqa: E402
from eprt.hf.check_export import check_export  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.models.kda import KimiDeltaAttention, chunk_size, kda, kda_chunked, kda_recurrent, l2norm  # noqa: E402
from eprt.models.mla import MLAttention  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny, tiny_config, vision_tensors  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.oracles.test_models import DEEPSEEK, VOCAB, assert_logits_and_carried  # noqa: E402

# --- KDA --------------------------------------------------------------------------------------


def kda_inputs(T: int, decay: float, seed: int = 0, B: int = 2, H: int = 3, Dk: int = 16, Dv: int = 12):
    """(q, k) as the short convolutions give them, v, the log-decay g, beta."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, Dk, generator=g), torch.randn(B, T, H, Dk, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    log_decay = -decay * torch.sigmoid(2 * torch.randn(B, T, H, Dk, generator=g))
    return q, k, v, log_decay, torch.rand(B, T, H, generator=g)


# decay per token up to 0.1 (chunks of 64), up to 5 (Kimi-K3's lower bound: chunks of 16) and up
# to 40 (chunks of 2, where a chunk of 64 would overflow fp32)
@pytest.mark.parametrize("decay,chunk", [(0.1, 64), (5.0, 16), (40.0, 2)])
@pytest.mark.parametrize("T", [1, 37, 64, 130])
def test_chunked_kda_equals_the_recurrence(T, decay, chunk):
    q, k, v, g, beta = kda_inputs(T, decay)
    assert chunk_size(g) == (chunk if T > 1 else 64)
    qn, kn = l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)
    want = kda_recurrent(qn, kn, v, g, beta)
    torch.testing.assert_close(kda_chunked(qn, kn, v, g, beta), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(kda(q, k, v, g, beta), want, rtol=0, atol=1e-5)
    # shorter chunks than chosen are as exact: the state passes from chunk to chunk
    torch.testing.assert_close(kda_chunked(qn, kn, v, g, beta, chunk=min(8, chunk)), want, rtol=0, atol=1e-5)


# --- Kimi-Linear against transformers ---------------------------------------------------------


def kimi_linear(**kw) -> KimiLinearConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        # the defaults lie outside this vocabulary
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        linear_attn_config={
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
            "head_dim": 8,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
    )
    return KimiLinearConfig(**{**base, **kw})


def spread_routers(layers, attr: str) -> None:
    """Router weights spread enough that routing does not hinge on near-ties, and a correction bias."""
    with torch.no_grad():
        for layer in layers:
            gate = getattr(getattr(layer, attr), "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.weight.normal_(0, 0.3)
                gate.e_score_correction_bias.normal_(0, 0.1)


def rename_tensors(hf_dir: Path, rename) -> None:
    """Rewrite the names of a saved single-file checkpoint (transformers' save_pretrained maps its
    own module names back onto some tensors that the released checkpoints name otherwise)."""
    path = hf_dir / "model.safetensors"
    save_file({rename(n): t for n, t in load_file(path).items()}, path, metadata={"format": "pt"})


KIMI_LINEAR_CASES = {
    "q_proj_70_tokens": (dict(), 70),  # crosses a 64-token chunk
    "q_lora_groups_two_shared": (dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=2), 12),
}


@pytest.mark.parametrize("case", KIMI_LINEAR_CASES)
def test_kimi_linear_logits(tmp_path, case):
    overrides, T = KIMI_LINEAR_CASES[case]
    torch.manual_seed(0)
    m = KimiLinearForCausalLM(kimi_linear(**overrides)).eval()
    spread_routers(m.model.layers, "mlp")
    m.save_pretrained(tmp_path / "hf")  # the dense layer 0 under block_sparse_moe, as transformers saves it
    em = eprt.load_model(convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    kinds = [type(layer.self_attn) for layer in em.model.layers]
    assert kinds == [KimiDeltaAttention, MLAttention, KimiDeltaAttention]
    assert [i for i, _ in em.moe_blocks()] == [1, 2]
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(ids).logits, em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# the dense layer's MLP as Moonshot's code and the release name it, and as transformers 5 saves it
DENSE_MLP_SPELLINGS = {"mlp": lambda n: n, "block_sparse_moe": lambda n: n.replace(".0.mlp.", ".0.block_sparse_moe.")}
# the dense MLP quantized in FP8, the routed experts in NVFP4: its modules are named in the config's quantized_layers
DENSE_FP8_EXPERTS_NVFP4 = """
quantize:
  - {pattern: "*.experts", format: nvfp4}
  - {pattern: "*.mlp.*", format: fp8}
  - {pattern: "*", format: none}
"""


@pytest.mark.parametrize("spelling", DENSE_MLP_SPELLINGS)
def test_kimi_linear_exports_the_dense_mlp_as_the_source_spells_it(tmp_path, spelling):
    hf = tmp_path / "hf"
    make_tiny("kimi_linear", str(hf))
    rename_tensors(hf, DENSE_MLP_SPELLINGS[spelling])
    source = read_hf_tensors(str(hf))
    assert {n for n in source if n.startswith("model.layers.0.") and "_proj.weight" in n and "self_attn" not in n} == {
        f"model.layers.0.{spelling}.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    ck = convert_hf(str(hf), str(tmp_path / "ck"), progress=False)
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "export"), progress=False))
    assert set(exported) == set(source)
    for n, t in source.items():
        assert exported[n].dtype == t.dtype and raw(exported[n]) == raw(t), n

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DENSE_FP8_EXPERTS_NVFP4)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, str(recipe), q, calib_size=2, seq_len=16, progress=False))
    out = export_hf(q, q + "-hf", progress=False)
    dense = {f"model.layers.0.{spelling}.{p}_proj" for p in ("gate", "up", "down")}
    experts = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w{k}" for i in (1, 2) for e in range(8) for k in (1, 2, 3)
    }
    want = {n for n in source if n.rsplit(".", 1)[0] not in dense | experts}
    want |= {f"{m}.{c}" for m in dense for c in ("weight", "weight_scale", "input_scale")}
    want |= {f"{m}.{c}" for m in experts for c in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    assert set(read_hf_tensors(out)) == want
    layers = json.loads((Path(out) / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert layers == {
        **{m: {"quant_algo": "FP8"} for m in sorted(dense)},
        **{f"model.layers.{i}.block_sparse_moe.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in (1, 2)},
    }
    assert check_export(out, str(hf)) == []


def test_kimi_linear_holding_both_spellings_of_a_tensor_is_refused(tmp_path):
    hf = tmp_path / "hf"
    make_tiny("kimi_linear", str(hf))
    path = hf / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.block_sparse_moe.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' and "
        r"'model\.layers\.0\.block_sparse_moe\.up_proj\.weight' are one tensor "
        r"under its two spellings, and the checkpoint holds both; keep one",
    ):
        convert_hf(str(hf), str(tmp_path / "ck"), progress=False)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3", "kimi_k25", "kimi_vl"])
def test_parameter_names_are_the_layout_names(family):
    c = parse_hf_config(tiny_config(family))
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq != 1 is not supported"),
        ({"mla_use_nope": False}, "without RoPE only"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"moe_router_activation_func": "softmax"}, "Kimi routes by sigmoid"),
    ],
)
def test_kimi_linear_refusals_name_the_setting(fields, message):
    with pytest.raises(ConfigError, match=message):
        parse_hf_config({**tiny_config("kimi_linear"), **fields})


def test_kimi_configs():
    linear = parse_hf_config(tiny_config("kimi_linear"))
    assert linear.kimi_linear.kda.layers == (0, 2) and linear.moe_layers == (1, 2)
    assert linear.kimi_linear.kda.a_log_shape == (1, 1, 4, 1) and linear.kimi_linear.attn_res_block_size is None
    assert linear.rope is None and linear.kimi_linear.situ is None and linear.own is None  # NoPE, SiLU, no latent
    k3 = parse_hf_config(tiny_config("kimi_k3"))
    assert (k3.family, k3.model_type, k3.kimi_linear.situ) == ("kimi_k3", "kimi_k3", SiTUConfig(4.0, 25.0))
    # A_log one entry per head; the checkpoints pad it (tests below)
    assert k3.kimi_linear.kda.a_log_shape == (4,) and k3.own == LatentExperts(latent_size=32, latent_norm=True)
    k25 = parse_hf_config(tiny_config("kimi_k25"))
    assert (k25.family, k25.model_type, k25.moe.n_group) == ("kimi_k25", "kimi_k25", 1)
    names = [s.name for s in reader_for("kimi_k25", "test").layout(k25).specs]
    assert all(n.startswith("language_model.") for n in names)


# --- Kimi-K3 against mlx-lm --------------------------------------------------------------------


def mlx_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(hf_dir))
    return torch.from_numpy(np.array(model(mx.array(ids.numpy())).astype(mx.float32)))


def k3_checkpoint(tmp_path, seed: int, **overrides) -> str:
    hf = make_tiny("kimi_k3", str(tmp_path / "hf"), dtype="fp32", seed=seed, **overrides)
    # mlx-lm drops the groups it does not keep by setting their scores to 0, not -inf: the two agree
    # while every biased score is positive, so the biases are made non-negative here.
    path = Path(hf) / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t.abs_()
    save_file(tensors, path, metadata={"format": "pt"})
    return hf


def text(**fields) -> dict:
    return {"text_config": {**tiny_config("kimi_k3")["text_config"], **fields}}


K3_CASES = {
    # 4 layers KDA, KDA, MLA, KDA; blocks of 2 start at layer 0 (KDA) and layer 2 (MLA)
    "grouped": {},
    "plain_routing": text(num_expert_group=1, topk_group=1),
    # without the K3 options that have a plain form: attention residuals, gate lower bound, full-rank
    # gate, MLA output gate, latent norm, SiTU's linear bound; blocks of 3 start at layers 0 and 3
    "plain_options": text(
        attn_res_block_size=None,
        mla_use_output_gate=False,
        latent_moe_use_norm=False,
        activation_situ_linear_beta=None,
        linear_attn_config={
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    ),
    "blocks_of_3": text(
        attn_res_block_size=3,
        num_hidden_layers=5,
        linear_attn_config={
            "kda_layers": [1, 2, 3, 5],
            "full_attn_layers": [4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
    ),
}


@pytest.mark.parametrize(
    "case,seed",
    [
        ("grouped", 0),
        ("grouped", 1),
        ("grouped", 2),
        ("plain_routing", 0),
        ("plain_routing", 1),
        ("plain_options", 0),
        ("blocks_of_3", 0),
    ],
)
def test_kimi_k3_logits_equal_mlx_lm(tmp_path, case, seed):
    hf = k3_checkpoint(tmp_path, seed, **K3_CASES[case])
    em = eprt.load_model(convert_hf(hf, str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    c = em.config
    assert c.kimi_linear.kda.layers and len(c.kimi_linear.kda.layers) < c.num_layers
    assert [i for i, _ in em.moe_blocks()] == list(range(1, c.num_layers))  # first_k_dense_replace 1
    ids = torch.randint(0, c.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = em(ids)
    torch.testing.assert_close(got, mlx_logits(hf, ids), rtol=0, atol=2e-4)


def with_a_log_length(hf: str, length: int) -> dict[str, torch.Tensor]:
    """Rewrite every A_log of `hf` to `length` entries: the heads' own first, then padding unlike
    anything the heads hold; returns the source tensors as stored."""
    path = Path(hf) / "model.safetensors"
    tensors = load_file(path)
    heads = tiny_config("kimi_k3")["text_config"]["linear_attn_config"]["num_heads"]
    for name in [n for n in tensors if n.endswith(".A_log")]:
        pad = torch.full((max(length - heads, 0),), 7.0)
        tensors[name] = torch.cat([tensors[name][:heads], pad])[:length].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


# one entry per head, 12 past them, and the release's 128 (for 96 heads; 4 here)
@pytest.mark.parametrize("extra", [0, 12, 124])
def test_kimi_k3_a_log_of_any_stored_length(tmp_path, extra):
    hf = k3_checkpoint(tmp_path, 0)
    heads = tiny_config("kimi_k3")["text_config"]["linear_attn_config"]["num_heads"]
    source = with_a_log_length(hf, heads + extra)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    em = eprt.load_model(ck, dtype=torch.float32)
    ids = torch.randint(0, em.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = em(ids)
    torch.testing.assert_close(got, mlx_logits(hf, ids), rtol=0, atol=2e-4)
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "export"), progress=False))
    assert set(exported) == set(source)
    for n, t in source.items():
        assert exported[n].dtype == t.dtype and raw(exported[n]) == raw(t), n


def test_kimi_k3_a_log_shorter_than_the_heads_is_refused(tmp_path):
    hf = k3_checkpoint(tmp_path, 0)
    with_a_log_length(hf, 3)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'language_model\.model\.layers\.0\.self_attn\.A_log' "
        r"holds 3 entries but config.json implies 4 KDA heads.*"
        r"fix the KDA head count in config.json, or use a checkpoint that "
        r"stores at least 4 entries$",
    ):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert not (tmp_path / "ck").exists()


def test_kimi_linear_a_log_keeps_its_exact_shape(tmp_path):
    """transformers and mlx-lm load Kimi-Linear's A_log only as [1, 1, heads, 1]: no padding."""
    hf = make_tiny("kimi_linear", str(tmp_path / "hf"), dtype="fp32")
    path = Path(hf) / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.A_log"] = torch.zeros(1, 1, 6, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.A_log' has shape \[1, 1, 6, 1\] "
        r"but config.json implies \[1, 1, 4, 1\]$",
    ):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)


# --- Kimi-K2.5 against transformers ------------------------------------------------------------


def kimi_k25() -> Kimi_K25Config:
    text = dict(DEEPSEEK, model_type="deepseek_v3", tie_word_embeddings=False)
    vision = dict(
        patch_size=14,
        pos_emb_height=4,
        pos_emb_width=4,
        pos_emb_time=2,
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
    )
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16, tie_word_embeddings=False)


def to_released_names(name: str) -> str:
    """transformers saves the language model's layers as `blocks` and the projector's norm under
    `model.`; the released checkpoints have `language_model.model.layers` and `mm_projector.`."""
    return name.replace("language_model.model.blocks.", "language_model.model.layers.").replace(
        "model.mm_projector.", "mm_projector."
    )


def test_kimi_k25_logits_and_vision_tensors(tmp_path):
    torch.manual_seed(0)
    m = Kimi_K25ForConditionalGeneration(kimi_k25()).eval()
    spread_routers(m.model.language_model.layers, "mlp")
    m.save_pretrained(tmp_path / "hf")
    rename_tensors(tmp_path / "hf", to_released_names)
    assert_logits_and_carried(tmp_path, m, "kimi_k25", [1, 2], 12, ("vision_tower.", "mm_projector."))


# --- Kimi-VL against transformers' DeepSeek-V3 on its text config ---------------------------------


def as_kimi_vl(text_dir: Path, out: Path) -> None:
    """A Kimi-VL checkpoint around the DeepSeek-V3 saved in `text_dir`: its tensors under
    `language_model.`, its config as `text_config`, and a MoonViT tower and projector beside them."""
    text = json.loads((text_dir / "config.json").read_text())
    out.mkdir()
    tensors = {f"language_model.{n}": t for n, t in load_file(text_dir / "model.safetensors").items()}
    tensors.update(vision_tensors(text["hidden_size"], torch.Generator().manual_seed(0), "kimi_vl"))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    vision = tiny_config("kimi_vl")["vision_config"]
    config = {"model_type": "kimi_vl", "text_config": text, "vision_config": vision, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config))


KIMI_VL_CASES = {
    "released_no_q_lora_two_shared": dict(q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1),
    "q_lora_groups": dict(),
}


@pytest.mark.parametrize("case", KIMI_VL_CASES)
def test_kimi_vl_logits_and_vision_tensors(tmp_path, case):
    """Kimi-VL's language model is DeepSeek-V3 (remote code, no transformers class of its own):
    eprt's logits are transformers' DeepseekV3ForCausalLM's on the text config, and the MoonViT
    tower and projector export byte for byte."""
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK, **KIMI_VL_CASES[case]})).eval()
    spread_routers(m.model.layers, "mlp")
    m.save_pretrained(tmp_path / "text")
    as_kimi_vl(tmp_path / "text", tmp_path / "hf")
    assert_logits_and_carried(tmp_path, m, "kimi_vl", [1, 2], 12, ("vision_tower.", "multi_modal_projector."))
