"""What every family's MTP calibration is held to: after the last decoder layer the engine runs the
MTP layer on what that layer left and on the next tokens, and records what one forward of the whole
batch through the MTP layer records."""

import torch

from eprt.loading.loader import load_model, load_mtp
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.passes import layer_passes
from eprt.quant.loop.sequences import Schedule
from eprt.storage.checkpoint import Checkpoint


def assert_the_engine_calibrates_mtp_as_one_forward(
    ck_dir: str, names: list[str], prefix: str, experts: str, kv_attention: str | None = None
) -> Calibrator:
    """MTP layer 0 of checkpoint `ck_dir` (its tensors under `prefix`), calibrated by the engine over 5
    sequences of 12 tokens in groups of 2, against one forward of the batch: the input amax of every
    module `names` but the routed `experts` (each positive), the experts' amax and tokens, and the KV
    amax of `kv_attention` where given. Returns the whole batch's calibrator."""
    samples = torch.randint(0, 512, (5, 12), generator=torch.Generator().manual_seed(0))
    model = load_model(ck_dir, dtype=torch.float32)
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _a, out: captured.update(h=out))
    kv = kv_attention is not None
    with Checkpoint(ck_dir) as ck, torch.inference_mode():
        model(samples)
        mtp = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu")
        whole = Calibrator(None, names, kv=kv)
        whole.observe(mtp, prefix)
        mtp(mtp.mtp_input(samples, captured["h"]), model.model.context(12, torch.float32, "cpu", []))
        layered = Calibrator(None, names, kv=kv)
        engine = LayerEngine(
            ParallelState.single("cpu"),
            ResolvedCheckpoint.of(ck, torch.float32),
            samples,
            layer_passes(layered),
            schedule=Schedule.of(5, 12, 2, group_tokens=24),
            progress=False,
        )
        engine.run(0, engine.embed())
    assert set(whole.input_amax) == set(names) - {experts}
    for name, amax in whole.input_amax.items():
        assert amax > 0, name
        torch.testing.assert_close(layered.input_amax[name], amax, rtol=1e-5, atol=0, msg=name)
    if kv:
        assert kv_attention in layered.kv_amax
        torch.testing.assert_close(
            torch.stack(layered.kv_amax[kv_attention]), torch.stack(whole.kv_amax[kv_attention]), rtol=1e-5, atol=0
        )
    torch.testing.assert_close(
        torch.stack(layered.expert_amax[experts]), torch.stack(whole.expert_amax[experts]), rtol=1e-5, atol=0
    )
    assert torch.equal(layered.expert_tokens[experts], whole.expert_tokens[experts])
    return whole


def assert_an_expert_range_loads_only_its_experts(ck_dir: str, experts: str) -> None:
    """An expert-parallel rank builds MTP layer 0 of `ck_dir` with its own routed experts (module
    `experts` of the layer), stacked as the decoder layers hold theirs: rows [4, 8) of the whole layer's."""
    with Checkpoint(ck_dir) as ck:
        whole = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu").get_submodule(experts)
        half = load_mtp(ResolvedCheckpoint.of(ck, torch.float32, (4, 4)), 0, device="cpu").get_submodule(experts)
    for name in ("w13", "w2"):
        torch.testing.assert_close(getattr(half, name), getattr(whole, name)[4:8], rtol=0, atol=0)
    assert half.w13.shape[0] == 4
