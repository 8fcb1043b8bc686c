"""The rotations (eprt.quant.rotation): the randomised Hadamard is orthogonal at any width and is the
matrix it says; the rotated fp32 model computes the original's logits in every family that rotates
(its multi-token-prediction layer's too); what cannot rotate exactly is refused by name; a recipe
says rotate as an algorithm or a rule's list."""

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.loading.loader import load_mtp, load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.recipe import parse_recipe
from eprt.quant.rotation.hadamard import random_hadamard, rotate
from eprt.quant.rotation.plan import Identity, PerHead, Residual
from eprt.quant.rotation.rotated import RotatedCheckpoint
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import FAMILIES
from tests.test_awq import assert_same_logits

# the families whose structure the rotation does not model, and what it names
REFUSED = {
    "kimi_k3": "output_attn_res_norm",  # attention residuals
    "qwen3_5_moe": "model.visual.",  # a vision tower carried through untouched
    "kimi_k25": "mm_projector.",
    "minimax_m3_vl": "multi_modal_projector.",
    "llama4": "multi_modal_projector.",
    "nemotron_h": "mtp.layers.",  # its multi-token-prediction layers carried through untouched
    "nemotron_h_omni": "mtp.layers.",
    "deepseek_v4": "model.hc_head",  # hyper-connections: several residual streams, mixed token by token
}
# Llama-4's language model rotates where the VLM's projector keeps it from rotating
ROTATED = [f for f in FAMILIES if f not in REFUSED] + ["llama4_text"]


def sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / b**0.5


@pytest.mark.parametrize("width", [1, 16, 7 * 16, 5 * 64, 45 * 4, 96])
def test_the_hadamard_is_orthogonal_and_the_matrix_it_says(width):
    """Q = diag(signs) (C ⊗ H) at widths with and without an odd part; rotate() is x @ Q."""
    r = random_hadamard(width, seed=3)
    q = r.matrix()
    torch.testing.assert_close(q.T @ q, torch.eye(width, dtype=torch.float64), rtol=0, atol=1e-12)
    expected = torch.diag(r.signs) @ torch.kron(r.mix, sylvester(r.block))
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-12)
    assert r.block == width & -width and r.mix.shape == (width // r.block,) * 2
    x = torch.randn(3, width, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, r), x @ expected, rtol=0, atol=1e-12)
    assert torch.equal(random_hadamard(width, seed=3).signs, r.signs)  # the same draw every time


def fp32_checkpoint(tmp_path, family: str) -> str:
    return convert_hf(make_tiny(family, str(tmp_path / "hf")), str(tmp_path / "ck"), dtype="fp32", progress=False)


@pytest.mark.parametrize("family", ROTATED)
def test_the_rotated_model_computes_the_same(tmp_path, family):
    """Every reader and writer of the residual stream rotated, every norm folded, each head's values
    rotated where the attention allows: the fp32 model's logits are the original's within rounding.
    A reader or writer the plan missed would be off by a whole rotation."""
    ck_dir = fp32_checkpoint(tmp_path, family)
    state = ParallelState.single()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with Checkpoint(ck_dir) as ck:
        rotated = RotatedCheckpoint(ck)
        model = load_parallel(ResolvedCheckpoint.of(ck, torch.float32), state)
        assert_same_logits(model, load_parallel(ResolvedCheckpoint.of(rotated, torch.float32), state), ids, family)
        kinds = {type(s) for steps in rotated.plan.steps.values() for s in steps}
        assert kinds == {Residual, Identity, PerHead} or (kinds == {Residual, Identity} and rotated.plan.left_out)
        # what no step names is read as stored
        # (in Llama-4 every tensor reads or writes the stream or is a norm: none is left)
        for untouched in [n for n in ck.tensors if n not in rotated.plan.steps][:1]:
            assert torch.equal(rotated.read(untouched), ck.read(untouched))


def test_the_mtp_layer_computes_the_same_rotated(tmp_path):
    """DeepSeek-V3's multi-token-prediction layer read rotated (its embedding, enorm and hnorm folded
    into eh_proj, its decoder layer, its head's norm) predicts what it did from the rotated hidden
    state: the layer's logits are the original's."""
    ck_dir = fp32_checkpoint(tmp_path, "deepseek_v3")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (2, 12), generator=g)
    with Checkpoint(ck_dir) as ck, torch.inference_mode():
        rotated = RotatedCheckpoint(ck)
        hidden = torch.randn(2, 12, ck.config.hidden_size, generator=g)
        logits = []
        for view, h in ((ck, hidden), (rotated, rotate(hidden, rotated.residual).float())):
            mtp = load_mtp(ResolvedCheckpoint.of(view, torch.float32), 0, device="cpu")
            x = mtp.mtp_input(ids, h)
            decoder = load_parallel(ResolvedCheckpoint.of(ck, torch.float32), ParallelState.single()).model
            out = mtp(x, decoder.context(12, x.dtype, x.device, []))
            logits.append(mtp.shared_head.head(mtp.shared_head.norm(out)))
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_what_cannot_rotate_exactly_is_refused_by_name(tmp_path, family):
    ck_dir = convert_hf(make_tiny(family, str(tmp_path / "hf")), str(tmp_path / "ck"), progress=False)
    with Checkpoint(ck_dir) as ck, pytest.raises(ConfigError, match=f"algorithm rotate: .*{REFUSED[family]}"):
        RotatedCheckpoint(ck)


def test_tied_embeddings_are_refused(tmp_path):
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"), tie_word_embeddings=True)
    with Checkpoint(convert_hf(hf, str(tmp_path / "ck"), progress=False)) as ck:
        with pytest.raises(ConfigError, match="ties its head to its embeddings"):
            RotatedCheckpoint(ck)


def test_a_recipe_says_rotate():
    """`rotate+gptq` and a rule's list `[rotate, gptq]` are the same; the scales are then chosen as the
    rest says (rotate alone: max); a recipe rotating some quantized modules and not others is refused."""
    as_list = parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": ["rotate", "gptq"]}]}, "r")
    assert as_list == parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4"}]}, "r", algorithm="rotate+gptq")
    assert as_list.rotates and as_list.algorithm_of("x") == "gptq" and as_list.roundings == ["gptq"]
    alone = parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": "rotate"}]}, "r")
    assert alone.rotates and alone.algorithm_of("x") == "max"
    plain = parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": ["awq", "gptq"]}]}, "r")
    assert not plain.rotates and plain.algorithm_of("x") == "awq+gptq"
    mixed = {
        "quantize": [
            {"pattern": "*.experts", "format": "nvfp4", "algorithm": "rotate+gptq"},
            {"pattern": "*", "format": "fp8", "algorithm": "gptq"},
        ]
    }
    with pytest.raises(ConfigError, match="the rotation is the whole model's"):
        parse_recipe(mixed, "r")
    with pytest.raises(ConfigError, match="unknown algorithm"):
        parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": ["gptq", "rotate"]}]}, "r")


def test_a_tensor_is_rotated_a_piece_at_a_time_as_whole(tmp_path, monkeypatch):
    """The embedding (rotated along its rows' last dim), a down projection (along its rows) and a stack
    of routed experts read in pieces of a few rows, columns or experts: the bits of the whole."""
    from eprt.quant.rotation import rotated as rotated_module

    monkeypatch.setattr(rotated_module, "PIECE_ROWS", 3)
    with Checkpoint(fp32_checkpoint(tmp_path, "qwen3_moe")) as ck:
        rotated = RotatedCheckpoint(ck)
        for name in (
            "model.embed_tokens.weight",
            "model.layers.0.mlp.experts.w2",
            "model.layers.0.self_attn.o_proj.weight",
        ):
            steps, t = rotated.plan.steps[name], ck.read(name)
            whole = (
                torch.stack([rotated.apply_whole(steps, x) for x in t])
                if t.dim() == 3
                else rotated.apply_whole(steps, t)
            )
            assert torch.equal(rotated.read(name), whole), name
