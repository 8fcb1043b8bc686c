"""Expert-parallel models on gloo: every rank loads the dense part and only its experts, and its
logits for its own batch are the single-process logits of that batch; failures on one rank
raise on every rank, naming it, and leave nothing half-written."""

import math
import os
import re
import shutil
import struct
import time
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file, save_file

import eprt
from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.loading import loader
from eprt.parallel import ParallelState, RankFailure, fail_together, write_together
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.safetensors_io import save_tensors
from eprt.testing.tiny import make_tiny
from tests.hf_utils import tree_digest
from tests.multiproc import free_port, run_world

E = 8  # routed experts of both tiny families
# Rank r runs a batch of SHAPES[r] = (sequences, tokens): sizes differ between ranks.
SHAPES = [(2, 6), (1, 5), (3, 4), (1, 7)]
SKEWED_OUT = range(E // 2, E)  # experts the skewed checkpoints never route a token to
MODELS = ["qwen3_moe", "qwen3_moe skewed", "deepseek_v3", "deepseek_v3 skewed"]
FAULT_TIMEOUT = timedelta(seconds=8)


def skew(family: str, tensors: dict[str, torch.Tensor]) -> None:
    """Make every MoE layer route no token to experts 4-7: the upper half of every ep layout.

    DeepSeek-V3 chooses by sigmoid score + correction bias, so a bias of -100 rules an expert
    out (and the groups 2 and 3 it fills). Qwen3-MoE's router has no bias: every embedding gets
    a large hidden coordinate 0, which the residual stream carries into each post-attention
    norm, and the router rows of experts 4-7 read only that coordinate, negatively.
    """
    for name, t in tensors.items():
        if family == "deepseek_v3" and name.endswith("mlp.gate.e_score_correction_bias"):
            t[E // 2 :] = -100.0
        if family == "qwen3_moe" and name.endswith("mlp.gate.weight"):
            t[E // 2 :] = 0.0
            t[E // 2 :, 0] = -20.0
        if family == "qwen3_moe" and name == "model.embed_tokens.weight":
            t[:, 0] = 1.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{name: eprt checkpoint dir} for MODELS, float32, plus a qwen3_moe with 3 experts and a
    copy of qwen3_moe with one layer file truncated ("corrupt")."""
    root = tmp_path_factory.mktemp("ep")
    out = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        hf = make_tiny(family, str(root / f"{family}-hf"), dtype="fp32")
        out[family] = convert_hf(hf, str(root / family), progress=False)
        skewed_hf = root / f"{family}-skewed-hf"
        shutil.copytree(hf, skewed_hf)
        tensors = load_file(str(skewed_hf / "model.safetensors"))
        skew(family, tensors)
        save_file(tensors, str(skewed_hf / "model.safetensors"), metadata={"format": "pt"})
        out[f"{family} skewed"] = convert_hf(str(skewed_hf), str(root / f"{family}-skewed"), progress=False)
    three = make_tiny("qwen3_moe", str(root / "three-hf"), dtype="fp32", num_experts=3)
    out["three experts"] = convert_hf(three, str(root / "three"), progress=False)
    corrupt = root / "qwen3_moe-corrupt"
    shutil.copytree(out["qwen3_moe"], corrupt)
    layer = corrupt / "layer-00002.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])
    out["corrupt"] = str(corrupt)
    return out


def tokens(rank: int) -> torch.Tensor:
    B, T = SHAPES[rank]
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(rank))


def record_received(model) -> dict[int, list[list[int]]]:
    """{MoE layer: [rows each local expert received, per call]}, filled in as the model runs."""
    seen = {}
    for layer, block in model.moe_blocks():
        seen[layer] = []
        block.experts.register_forward_hook(lambda mod, args, out, calls=seen[layer]: calls.append(args[1].tolist()))
    return seen


class CountingCheckpoint(Checkpoint):
    """Keeps the bytes read when load_model closes it."""

    last_bytes_read = None

    def close(self):
        CountingCheckpoint.last_bytes_read = self.bytes_read
        super().close()


def run_layouts(ckpts, ep_list, ports):
    """On one rank: for each ep, load every model expert parallel and run this rank's batch;
    returns {(ep, model): results} to compare with the single-process run of the same batch."""
    ids = tokens(int(os.environ.get("RANK", "0")))
    reference = {name: eprt.load_model(ckpts[name], dtype=torch.float32)(ids) for name in MODELS}
    out = {}
    for ep, port in zip(ep_list, ports):
        os.environ["MASTER_PORT"] = str(port)
        with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
            for name in MODELS:
                loader.Checkpoint = CountingCheckpoint
                try:
                    model = eprt.load_model(ckpts[name], dtype=torch.float32, parallel=state)
                finally:
                    loader.Checkpoint = Checkpoint
                received = record_received(model)
                logits, ref = model(ids), reference[name]
                out[ep, name] = {
                    "rank": state.rank,
                    "ep_rank": state.ep_rank,
                    "experts": {i: (b.experts.first, b.experts.count) for i, b in model.moe_blocks()},
                    "dispatchers": {type(b.dispatcher).__name__ for _, b in model.moe_blocks()},
                    "bytes_read": CountingCheckpoint.last_bytes_read,
                    "received": received,
                    "shape": (tuple(logits.shape), tuple(ref.shape)),
                    "bitwise": torch.equal(logits, ref),
                    "close": torch.allclose(logits, ref, rtol=1e-5, atol=1e-6),
                    "max_diff": (logits - ref).abs().max().item(),
                }
    return out


def expected_bytes_read(ck_dir: str, ep: int) -> tuple[int, int, int]:
    """(dense, one rank's experts, headers) in bytes, from the manifest and the file headers.

    Checkpoint.bytes_read counts the bytes of every pread: each file's 8-byte header length
    and JSON header once, when the file is first opened, then the tensors' bytes.
    """
    ck = Checkpoint(ck_dir)
    dense = experts = 0
    files = set()
    for name in ck.names():
        t = ck.meta(name)
        n = t.dtype.itemsize * math.prod(t.shape)
        if re.search(r"\.mlp\.experts\.w(13|2)$", name):
            assert t.shape[0] == E and n % ep == 0
            experts += n // ep
        else:
            dense += n
        files |= {p.file for p in t.parts}
    headers = 0
    for f in files:
        with open(os.path.join(ck_dir, f), "rb") as fh:
            headers += 8 + struct.unpack("<Q", fh.read(8))[0]
    return dense, experts, headers


def check_layouts(ckpts, results, world, ep_list):
    for rank, out in enumerate(results):
        B, T = SHAPES[rank]
        for ep in ep_list:
            count = E // ep
            for name in MODELS:
                r = out[ep, name]
                where = f"world {world}, ep {ep}, rank {rank}, {name}"
                assert r["rank"] == rank and r["ep_rank"] == rank % ep, where
                assert r["shape"] == ((B, T, 512), (B, T, 512)), where
                # batch-invariant kernels make the expert-parallel logits the single-process bits
                assert r["close"] and r["bitwise"], f"{where}: max diff {r['max_diff']}"
                first = (rank % ep) * count
                assert set(r["experts"].values()) == {(first, count)}, where
                assert r["dispatchers"] == {"EPDispatcher"}, where

                dense, experts, headers = expected_bytes_read(ckpts[name], ep)
                assert r["bytes_read"] == dense + experts + headers, (where, r["bytes_read"], dense, experts, headers)

                if name.endswith("skewed"):
                    for layer, calls in r["received"].items():
                        assert len(calls) == 1, where
                        for local, rows in enumerate(calls[0]):
                            if first + local in SKEWED_OUT:
                                assert rows == 0, f"{where}: expert {first + local} got {rows} rows in layer {layer}"
    # The skewed models really leave experts without a token, and at ep > 1 the ranks holding
    # them (ep 2: rank 1; ep 4: ranks 2 and 3), while the others do get tokens.
    for ep in ep_list:
        for name in ("qwen3_moe skewed", "deepseek_v3 skewed"):
            for layer in results[0][ep, name]["received"]:
                got = {}
                for out in results:
                    r = out[ep, name]
                    first, _ = r["experts"][layer]
                    for local, rows in enumerate(r["received"][layer][0]):
                        got[first + local] = got.get(first + local, 0) + rows
                assert all(got[e] == 0 for e in SKEWED_OUT) and sum(got.values()) > 0, (ep, name, layer, got)
                idle = {o[ep, name]["ep_rank"] for o in results if sum(o[ep, name]["received"][layer][0]) == 0}
                assert idle == {r for r in range(ep) if r * (E // ep) >= SKEWED_OUT.start}, (ep, name, layer, idle)


@pytest.mark.timeout(60)
def test_ep_world1(ckpts, monkeypatch):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_PORT", "0")  # run_layouts sets it; the fixture undoes that
    results = [run_layouts(ckpts, [1], [free_port()])]
    check_layouts(ckpts, results, 1, [1])


@pytest.mark.timeout(150)
def test_ep_world2(ckpts):
    results = run_world(run_layouts, 2, ckpts, [2, 1], [free_port(), free_port()], timeout=140)
    check_layouts(ckpts, results, 2, [2, 1])


@pytest.mark.timeout(200)
def test_ep_world4(ckpts):
    results = run_world(run_layouts, 4, ckpts, [4, 2], [free_port(), free_port()], timeout=190)
    check_layouts(ckpts, results, 4, [4, 2])


def _outcome(state, step):
    """("ok", value) or (message, ranks, seconds) of the RankFailure every rank should raise."""
    start = time.monotonic()
    try:
        return "ok", step()
    except RankFailure as e:
        return str(e), e.ranks, time.monotonic() - start


def run_faults(ckpts, out_dir):
    state = ParallelState.from_env(ep=2, timeout=FAULT_TIMEOUT)
    rank, result = state.rank, {}

    # ep 2 cannot split 3 experts: every rank refuses alike, having read the manifest alone.
    CountingCheckpoint.last_bytes_read = None
    loader.Checkpoint = CountingCheckpoint
    try:
        eprt.load_model(ckpts["three experts"], dtype=torch.float32, parallel=state)
    except ConfigError as e:
        result["ep refused"] = (str(e), CountingCheckpoint.last_bytes_read)
    finally:
        loader.Checkpoint = Checkpoint

    # Rank 1 sees a checkpoint whose layer-2 file was cut short.
    path = ckpts["corrupt"] if rank == 1 else ckpts["qwen3_moe"]
    result["corrupt"] = _outcome(state, lambda: eprt.load_model(path, dtype=torch.float32, parallel=state))

    def write(fail_on, attempt=0):
        """Each rank writes its file (holding 10 * attempt + rank); rank `fail_on` then fails."""

        def write_fn(tmp):
            save_tensors(os.path.join(tmp, f"rank-{rank}.safetensors"), {"x": torch.full((4,), 10.0 * attempt + rank)})
            if rank == fail_on:
                raise OSError(28, "No space left on device")

        return write_fn

    result["write ok"] = _outcome(state, lambda: write_together(state, f"{out_dir}/ok", write(None)))
    result["write exists"] = _outcome(state, lambda: write_together(state, f"{out_dir}/ok", write(None)))
    result["write fails"] = _outcome(state, lambda: write_together(state, f"{out_dir}/failed", write(1)))
    result["overwrite fails"] = _outcome(
        state, lambda: write_together(state, f"{out_dir}/ok", write(0, attempt=1), overwrite=True)
    )

    # Rank 1's experts raise in the first MoE layer, after the tokens reached it: rank 0 waits
    # for its results in an all-to-all until the collective times out.
    model = eprt.load_model(ckpts["qwen3_moe"], dtype=torch.float32, parallel=state)
    if rank == 1:

        def broken(*args):
            raise RuntimeError("injected fault in the experts")

        model.moe_blocks()[0][1].experts.forward = broken

    def forward():
        with fail_together(state, "running the forward"):
            return model(tokens(rank)).shape

    result["forward"] = _outcome(state, forward)
    state.close()
    return result


@pytest.mark.timeout(120)
def test_faults_fail_together(ckpts, tmp_path):
    inputs = {name: tree_digest(ckpts[name]) for name in ("qwen3_moe", "corrupt")}
    results = run_world(run_faults, 2, ckpts, str(tmp_path), timeout=110)

    for rank, r in enumerate(results):
        assert r["ep refused"] == (
            "ep=2 does not divide the 3 routed experts; valid ep for world 2 and 3 experts: 1",
            0,
        )

        message, ranks, seconds = r["corrupt"]
        assert ranks == [1] and seconds < 60, message
        assert message.startswith("rank 1 failed while loading the checkpoint: CheckpointError: "), message
        assert "layer-00002.safetensors" in message and "truncated" in message, message

        assert r["write ok"][0] == "ok"
        message, ranks, seconds = r["write exists"]
        assert ranks == [0, 1] and "OutputExistsError" in message and "--overwrite" in message, message

        message, ranks, seconds = r["write fails"]
        assert ranks == [1] and seconds < 60, message
        assert message == "rank 1 failed while writing the output: OSError: [Errno 28] No space left on device"

        message, ranks, seconds = r["overwrite fails"]
        assert ranks == [0] and seconds < 60, message

        message, ranks, seconds = r["forward"]
        assert ranks == [1] and seconds < 60, message
        first, *rest = message.split("\n")
        assert first == "rank 1 failed while running the forward: RuntimeError: injected fault in the experts"
        assert rest and rest[0].startswith("rank 0 then timed out waiting in a collective"), message
    for case in ("corrupt", "write exists", "write fails", "overwrite fails", "forward"):
        assert results[0][case][:2] == results[1][case][:2], case

    # Nothing half-written: the failed output never appeared, no temp directory is left, the
    # output that was to be overwritten is the first one, whole, and the inputs are untouched.
    assert sorted(os.listdir(tmp_path)) == ["ok"]
    assert sorted(os.listdir(tmp_path / "ok")) == ["rank-0.safetensors", "rank-1.safetensors"]
    for rank in range(2):
        x = load_file(str(tmp_path / "ok" / f"rank-{rank}.safetensors"))["x"]
        assert torch.equal(x, torch.full((4,), float(rank)))
    assert {name: tree_digest(ckpts[name]) for name in inputs} == inputs
