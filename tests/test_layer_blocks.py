"""A decoder layer is its (norm, mixer) blocks under a residual rule: layers of one mixer each
(attention alone, a dense MLP alone, a MoE alone) beside the usual attention-then-MoE layer, under
the plain residual sum and under a rule of two residual streams, run through the engine's
layer-major calibration as through the whole-model forward, and to the same bits on two ranks as
in one process. The engine knows neither the layers' kinds nor the rule: it asks a layer for its
routed block and nothing else. The rotation reads a layer block by block."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.loading.loader import build_meta
from eprt.loading.resolved import ResolvedCheckpoint, place_tensors
from eprt.models.decoder import Block, CausalLM, Decoder, DecoderLayer, LayerContext
from eprt.parallel import ParallelState
from eprt.quant.loop import engine as engine_module
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.sequences import Schedule
from eprt.quant.rotation.plan import rotation_plan
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.multiproc import free_port, run_world

# what each layer holds, from the tiny Qwen3-MoE's tensors (its layer 1 is a dense MLP layer)
KINDS = ("attention", "mlp", "attention", "mlp", "attention+mlp")
SEQUENCES, SEQ_LEN = 5, 12


class TwoStreams(DecoderLayer):
    """A residual rule of two streams [B, T, 2, D], as hyper-connections keep several: block k reads
    a mixture of them whose weights it computes from them, token by token; its output, scaled by
    the first weight, joins stream 1 and becomes stream 0, and stream 0's old value stream 1."""

    def enter(self, k: int, x: torch.Tensor, ctx: LayerContext) -> tuple[tuple, torch.Tensor]:
        w = torch.sigmoid(x.mean(-1, keepdim=True))  # [B, T, 2, 1]
        return (x, w), (w * x).sum(-2)

    def leave(self, k: int, carry: tuple, y: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x, w = carry
        return torch.stack([x[..., 1, :] + w[..., 0, :] * y, x[..., 0, :]], dim=-2)


class TwoStreamDecoder(Decoder):
    """Layer 0 reads the embedding in both streams (the second halved); the final norm their sum."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(input_ids)
        return torch.stack([e, 0.5 * e], dim=-2)

    def final(self, x: torch.Tensor, snapshots: list[torch.Tensor]) -> torch.Tensor:
        return self.norm(x.sum(-2))


def one_mixer_model(rc: ResolvedCheckpoint, streams: bool) -> CausalLM:
    """On the meta device: the family's modules, regrouped into the layers of KINDS."""
    family = build_meta(rc)
    layers = []
    for kind, layer in zip(KINDS, family.model.layers):
        attention = (Block("input_layernorm", "self_attn", rotary=True), layer.input_layernorm, layer.self_attn)
        mlp = (Block("post_attention_layernorm", "mlp"), layer.post_attention_layernorm, layer.mlp)
        blocks = {"attention": [attention], "mlp": [mlp], "attention+mlp": [attention, mlp]}[kind]
        layers.append((TwoStreams if streams else DecoderLayer)(*blocks))
    model = CausalLM(rc.ck.config, layers, decoder=TwoStreamDecoder if streams else Decoder)
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def ck_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("blocks")
    hf = make_tiny("qwen3_moe", str(d / "hf"), dtype="fp32", num_hidden_layers=len(KINDS))
    return convert_hf(hf, str(d / "ck"), progress=False)


def samples() -> torch.Tensor:
    return torch.randint(0, 500, (SEQUENCES, SEQ_LEN), generator=torch.Generator().manual_seed(0))


def layered_logits(state: ParallelState, ck_dir: str, streams: bool) -> dict[int, torch.Tensor]:
    """Each of this rank's calibration sequences (by global index) -> its logits after the engine's
    layer-by-layer run of the one-mixer model (the engine's model for the while)."""
    built = engine_module.checked_meta
    engine_module.checked_meta = lambda rc: one_mixer_model(rc, streams)
    try:
        with Checkpoint(ck_dir) as ck, torch.inference_mode():
            rc = ResolvedCheckpoint.of(ck, torch.float32)
            schedule = Schedule.of(SEQUENCES, SEQ_LEN, 2, group_tokens=24)
            engine = LayerEngine(state, rc, samples(), [], schedule=schedule, progress=False)
            ls = engine.run(0, engine.embed())
            mine = engine.calibration.mine
            assert ls.hidden.shape == (len(mine), SEQ_LEN, *((2,) if streams else ()), ck.config.hidden_size)
            with engine.head() as logits:
                return {s: logits(ls, li) for li, s in enumerate(mine)}
    finally:
        engine_module.checked_meta = built


def layouts(ck_dir: str, port: int) -> dict[bool, dict[int, torch.Tensor]]:
    """On a rank of world 2, ep 2: `layered_logits` of both residual rules (as lists: a tensor would
    travel back through shared memory its rank frees on exit; fp32 values are exact as floats)."""
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        return {
            streams: {s: t.tolist() for s, t in layered_logits(state, ck_dir, streams).items()}
            for streams in (False, True)
        }


@pytest.mark.parametrize("streams", [False, True], ids=["residual sum", "two streams"])
def test_one_mixer_layers_calibrate_layer_by_layer_as_the_whole_model_runs(ck_dir, streams):
    with Checkpoint(ck_dir) as ck, torch.inference_mode():
        rc = ResolvedCheckpoint.of(ck, torch.float32)
        whole = one_mixer_model(rc, streams)
        # each layer holds its blocks' modules and nothing else; the MoE layers' routed block is theirs
        held = [{n.split(".")[0] for n in layer.state_dict()} for layer in whole.model.layers]
        names = {"attention": {"input_layernorm", "self_attn"}, "mlp": {"post_attention_layernorm", "mlp"}}
        assert held == [set().union(*(names[k] for k in kind.split("+"))) for kind in KINDS]
        # a dense MLP alone (layer 1), a MoE alone (layer 3), attention then a MoE (layer 4)
        assert [layer.routed is not None for layer in whole.model.layers] == [False, False, False, True, True]
        place_tensors(rc, whole, list(whole.state_dict()), device="cpu")
        want = whole(samples())
    got = layered_logits(ParallelState.single("cpu"), ck_dir, streams)
    assert sorted(got) == list(range(SEQUENCES))
    torch.testing.assert_close(torch.stack([got[s] for s in range(SEQUENCES)]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(200)
def test_one_mixer_layers_give_the_same_bits_on_two_ranks(ck_dir):
    """At world 2, ep 2 (each rank its sequences and half the experts), every sequence's logits are
    the single process's to the last bit, under either residual rule."""
    ranks = run_world(layouts, 2, ck_dir, free_port(), timeout=190)
    for streams in (False, True):
        one = layered_logits(ParallelState.single("cpu"), ck_dir, streams)
        two = {s: torch.tensor(t) for r in ranks for s, t in r[streams].items()}
        assert sorted(two) == sorted(one) == list(range(SEQUENCES))
        assert all(torch.equal(two[s], one[s]) for s in one), streams


def test_one_mixer_layers_rotate_block_by_block_and_another_residual_rule_is_refused(ck_dir):
    """The rotation reads a layer block by block: each tensor of a one-mixer layer gets the steps
    it gets in the family's own two-block layer, and every tensor it rotates there that the toy
    holds is rotated; a residual rule other than the plain sum is refused by name."""
    with Checkpoint(ck_dir) as ck:
        rc = ResolvedCheckpoint.of(ck, torch.float32)
        family, toy = rotation_plan(build_meta(rc)), rotation_plan(one_mixer_model(rc, streams=False))
        held = set(one_mixer_model(rc, streams=False).state_dict())
        assert toy.steps == {n: s for n, s in family.steps.items() if n in held}
        assert "model.layers.3.mlp.experts.w13" in toy.steps and "model.layers.0.mlp.gate.weight" not in toy.steps
        with pytest.raises(ConfigError, match=r"model\.layers\.0 \(TwoStreams\) joins its blocks by a residual rule"):
            rotation_plan(one_mixer_model(rc, streams=True))
