"""The model-free export's throughput, side by side with copying the same safetensors and with
llm-compressor's `model_free_ptq`, as ratios taken run by run; and what each stage of the export
costs per GB.

    python bench/model_free.py [--gb 1.1] [--workers 1] [--runs 3] [--peer-python PY] [--dir /tmp] [--stages]

A random MoE checkpoint of at least --gb GB, in bf16 and OLMoE's names (a model eprt does not
model: its export goes by name pattern), is written once under --dir. Then, run by run, in turn
(A B C, A B C, ...), each a fresh process:
- copy: `cp -r` of the checkpoint directory: the disk's (and the page cache's) speed for its bytes;
- copy+sync: the same, then `sync` of the copied files: durable on disk, as eprt's output is
  before it is published;
- eprt: `eprt-export HF OUT --recipe fp8_block --workers N` (the ModelOpt layout; compressed-tensors'
  writes the same tensors);
- llm-compressor (with --peer-python, a Python that has llm-compressor, kept out of eprt's
  environment): bench/peer_model_free.py, `model_free_ptq(..., scheme="FP8_BLOCK", max_workers=N)`;
- torch's import: `python -c "import torch"`, what any process that quantizes with torch pays
  before its first byte.
One copy runs first and is not counted: every side reads the source from the page cache (the
checkpoint was just written; under 24 GiB of memory an 8 GB one stays cached), which the report says.
Throughput is the source's bytes over wall seconds; reported are each side's median wall and CPU
seconds, and the medians of the per-run ratios of eprt's throughput to each other side's (above 1:
eprt is faster). What bounds eprt is printed beside: torch's import against the time 0.7x the copy's
throughput allows, and fp8_block's arithmetic alone (the bench's weights, and weights of a
DeepSeek-V3 expert's size, quantized in memory, one thread) in GB/s of bf16 per core. With
--stages, one export more runs in a process of its own with each stage timed (one worker): the CPU
seconds of torch's and eprt's imports and the plan, which a checkpoint of any size pays once, and
per GB of the source those of reading, decoding, quantizing, writing, syncing and checking the
export, with the wall seconds of the sync. On a machine other jobs share, run it under
OMP_NUM_THREADS=1 and compare CPU seconds.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 10**9
HIDDEN, INTER, EXPERTS, HEADS, VOCAB = 1024, 512, 32, 8, 32000
AIM = 0.7  # the throughput, as a fraction of the copy's, the model-free export aims at


def layer_params() -> int:
    return 4 * HIDDEN * HIDDEN + EXPERTS * 3 * HIDDEN * INTER + EXPERTS * HIDDEN + 2 * HIDDEN


def make_checkpoint(out: str, gb: float) -> int:
    """A random bf16 OLMoE-named checkpoint of at least `gb` GB in shards of ~500 MB; returns its weight bytes."""
    import torch
    from safetensors.torch import save_file

    layers = max(1, -(-int(gb * GB / 2 - 2 * VOCAB * HIDDEN) // layer_params()))
    config = {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 4,
        "torch_dtype": "bfloat16",
    }
    os.makedirs(out)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards, cur, total = [], {}, 0
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            cur[f"{p}.self_attn.{proj}.weight"] = w(HIDDEN, HIDDEN)
        for e in range(EXPERTS):
            cur[f"{p}.mlp.experts.{e}.gate_proj.weight"] = w(INTER, HIDDEN)
            cur[f"{p}.mlp.experts.{e}.up_proj.weight"] = w(INTER, HIDDEN)
            cur[f"{p}.mlp.experts.{e}.down_proj.weight"] = w(HIDDEN, INTER)
        cur[f"{p}.mlp.gate.weight"] = w(EXPERTS, HIDDEN)
        cur[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        cur[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        if sum(t.nbytes for t in cur.values()) > 500 * 10**6:
            shards.append(cur)
            cur = {}
    cur.update({"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN)})
    cur["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    shards.append(cur)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def run(cmd: list[str], out: str) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS) of one run of `cmd`, writing `out`; its workers' are their own."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": REPO}
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{cmd[:4]} failed: {err.read().decode()[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # Linux reports kB


# A routed expert's gate projection of DeepSeek-V3's size: a weight whose fp32 copy outgrows a core's cache
LARGE_WEIGHT = (2048, 7168)


def arithmetic_gbps(rows: int = INTER, cols: int = HIDDEN, seconds: float = 2.0) -> float:
    """fp8_block's quantization alone of bf16 weights [rows, cols] (the bench's experts', by default;
    in memory, one thread), in GB of bf16 per second of this thread's CPU time (which other jobs on
    the host do not stretch, as they do wall time): the floor of the export's time per core, reading
    and writing aside."""
    import torch

    from eprt.quant.formats.fp8_block import FP8_BLOCK

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    count = max(2, 32 * INTER * HIDDEN // (rows * cols))
    weights = [(torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16) for _ in range(count)]
    done, start = 0, time.thread_time()
    with torch.inference_mode():
        while time.thread_time() - start < seconds:
            for w in weights:
                FP8_BLOCK.quantize(w, None, False)
            done += sum(w.nbytes for w in weights)
    return done / (time.thread_time() - start) / GB


def stages(hf: str, out: str) -> str:
    """One model-free fp8_block export of `hf` into `out` in this process, one worker, each stage's CPU
    seconds taken on the thread that runs it (the reading and quantizing run on the producing thread,
    the writing on this one): a JSON object of stage -> CPU seconds, and the sync's wall seconds."""
    cpu = {}
    start = time.process_time()
    import torch  # noqa: F401

    cpu["import torch"] = time.process_time() - start
    start = time.process_time()
    from eprt.hf.streaming import run as streaming_run
    from eprt.hf.streaming.source import StreamSource
    from eprt.quant.formats.base import ScaledByBlocks
    from eprt.storage import atomic
    from eprt.storage.safetensors_io import SafetensorsFile, SafetensorsWriter

    cpu["import eprt"] = time.process_time() - start
    seen = {"sync wall": 0.0}
    active = threading.local()  # a stage inside another (a read inside a decode or the check) is the outer one's

    def timed(owner, attr: str, stage: str) -> None:
        inner = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            if getattr(active, "stage", None) is not None:
                return inner(*args, **kwargs)
            active.stage, t, w = stage, time.thread_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                active.stage = None
                cpu[stage] = cpu.get(stage, 0.0) + time.thread_time() - t
                if stage == "sync":
                    seen["sync wall"] += time.perf_counter() - w

        setattr(owner, attr, wrapper)

    timed(streaming_run, "Stream", "plan")
    timed(StreamSource, "_decoded", "decode")
    timed(SafetensorsFile, "read", "read")
    timed(ScaledByBlocks, "quantize", "quantize")
    for attr in ("write", "copy_range", "close"):
        timed(SafetensorsWriter, attr, "write")
    timed(SafetensorsWriter, "_sync", "sync")  # the writer's syncs behind the writing, on a thread of its own
    timed(atomic, "sync_tree", "sync")
    timed(streaming_run, "check_export", "check")
    streaming_run.stream_export(hf, out, "fp8_block", workers=1, progress=False)
    return json.dumps({**cpu, **seen})


CHILD = {
    "make": lambda out, gb: make_checkpoint(out, float(gb)),
    "arithmetic": lambda *shape: arithmetic_gbps(*map(int, shape)),
    "stages": stages,
}


def in_child(what: str, *args) -> float:
    """CHILD[what](*args) in a process of its own, so that this one holds neither torch nor tensors:
    a child's peak resident set counts its parent's at the fork."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, *map(str, args)]
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def planned_peak(cmd: list[str]) -> str:
    """The dry run's line of a process's planned peak."""
    done = subprocess.run([*cmd, "--dry-run"], env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True)
    return next((line.split("each ", 1)[1] for line in done.stderr.splitlines() if "peaks at" in line), "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer-python", help="a Python with llm-compressor, for its side")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--stages", action="store_true", help="time each stage of one more export (one worker)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(CHILD[a.child[0]](*a.child[1:]))
        return
    root = os.path.join(a.dir, f"eprt-model-free-bench-{os.getpid()}")
    hf = os.path.join(root, "hf")
    try:
        size = int(in_child("make", hf, a.gb))
        copy = os.path.join(root, "copy")
        sides = {
            "copy": ["cp", "-r", hf, copy],
            "copy+sync": ["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/*', hf, copy],
            "eprt": [
                *(sys.executable, "-m", "eprt.commands.export", hf, os.path.join(root, "eprt")),
                *("--recipe", "fp8_block", "--workers", str(a.workers), "--no-progress"),
            ],
        }
        if a.peer_python:
            peer = os.path.join(REPO, "bench", "peer_model_free.py")
            sides["llm-compressor"] = [
                *(a.peer_python, peer, "--hf", hf, "--out", os.path.join(root, "llmc"), "--workers", str(a.workers))
            ]
        sides["import torch"] = [sys.executable, "-c", "import torch"]
        walls: dict[str, list[float]] = {k: [] for k in sides}
        cpus: dict[str, list[float]] = {k: [] for k in sides}
        run(sides["copy"], os.path.join(root, "copy"))  # a warm-up: the source in the page cache for every side
        print(f"eprt's dry run: {planned_peak(sides['eprt'])}")
        peaks = {}
        for _ in range(a.runs):
            for name, cmd in sides.items():
                out = os.path.join(root, {"copy": "copy", "copy+sync": "copy", "eprt": "eprt"}.get(name, "llmc"))
                wall, cpu, peaks[name] = run(cmd, out)
                walls[name].append(wall)
                cpus[name].append(cpu)
        print(
            f"checkpoint {size / GB:.2f} GB (bf16, {a.workers} worker(s)), {a.runs} runs, the source in the page "
            f"cache (copied once before), load average {os.getloadavg()[0]:.1f}; medians:"
        )
        for name, w in walls.items():
            wall = statistics.median(w)
            print(
                f"  {name:>14}: {wall:6.2f} s ({statistics.median(cpus[name]):6.2f} s CPU), {size / GB / wall:5.2f} GB/s"
            )
        print(f"  eprt's process peaked at {peaks['eprt'] / 2**20:.0f} MiB (its last run; workers aside)")
        for other in [k for k in walls if k not in ("eprt", "import torch")]:
            ratio = statistics.median(o / e for o, e in zip(walls[other], walls["eprt"]))
            print(f"  eprt's throughput / {other}'s: {ratio:.2f}x")
        budget, floor = statistics.median(walls["copy"]) / AIM, in_child("arithmetic")
        large = in_child("arithmetic", *LARGE_WEIGHT)
        print(
            f"  {AIM}x the copy's throughput allows {budget:.2f} s; torch's import alone takes "
            f"{statistics.median(walls['import torch']):.2f} s; fp8_block's arithmetic alone runs at "
            f"{floor:.2f} GB of bf16 per CPU second ({size / GB / floor:.2f} CPU s for the checkpoint), "
            f"{large:.2f} on {LARGE_WEIGHT[0]} x {LARGE_WEIGHT[1]} weights"
        )
        if a.stages:
            print_stages(size, in_child_json("stages", hf, os.path.join(root, "eprt")))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def in_child_json(what: str, *args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, *map(str, args)]
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


FIXED = ("import torch", "import eprt", "plan")
PER_BYTE = ("read", "decode", "quantize", "write", "sync", "check")


def print_stages(size: int, cpu: dict) -> None:
    gb = size / GB
    print(f"  stages of one export (one worker), CPU seconds (of {gb:.2f} GB of source):")
    print("    once: " + ", ".join(f"{k} {cpu.get(k, 0.0):.2f}" for k in FIXED))
    print(
        "    per GB: "
        + ", ".join(f"{k} {cpu.get(k, 0.0) / gb:.3f}" for k in PER_BYTE)
        + f"; the sync's wall {cpu['sync wall'] / gb:.2f} s per GB"
    )


if __name__ == "__main__":
    main()
