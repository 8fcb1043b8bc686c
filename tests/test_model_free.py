"""The model-free export (eprt.hf.streaming): a Hugging Face checkpoint quantized shard by shard
under a data-free recipe, without a model definition.

- On OLMoE, which eprt does not model (a tiny transformers model made here, random weights): the
  export holds exactly the source's tensors with each Linear the default patterns pick replaced by
  its format's tensors (embeddings, lm_head, norms and routers left alone), compressed-tensors'
  compressors decode every quantized tensor to eprt's own fake-quantized weight, and transformers
  runs the decoded checkpoint with logits near the bf16 model's (and equal, to bf16 rounding, to
  those of the model whose weights are eprt's fake-quantized ones).
- The same experts stored stacked (transformers 5's `experts.gate_up_proj`, `experts.down_proj`)
  give the same tensors; a recipe's ignore list replaces the default one.
- For families eprt models, the export is the modeled data-free one (convert, then eprt-export
  --recipe) byte for byte, every file, for every data-free recipe, and with `mtp: true` their
  multi-token-prediction layers quantized as it quantizes them; a model eprt does not model has
  its MTP layers found by name, carried whole without `mtp: true`.
- Two worker processes, or two ranks, write the same bytes as one; a run stopped after some
  shards resumes with them and ends with the same bytes; the output appears only when whole; the
  source is untouched; the dry run plans and writes nothing.
- eprt-check passes the export and says it checked a model eprt does not model by names and
  shapes alone; a recipe that needs calibration, or an HF directory without a recipe, is refused.
"""

import json
import os
import shutil

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.streaming import run as streaming_run
from eprt.hf.streaming import stream_export
from eprt.quant.formats import weight_format
from eprt.quant.formats.int4 import FULL
from eprt.quant.numerics import abs_amax
from eprt.quant.recipe import available, load_recipe
from eprt.quant.run.datafree import statistics_needed
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors, tree_digest
from tests.multiproc import run_world

transformers = pytest.importorskip("transformers")

E, LAYERS = 8, 2
# every data-free recipe, in the layout that holds its formats
DATA_FREE = [r for r in available() if not statistics_needed(load_recipe(r))]


def layout_of(recipe: str) -> str | None:
    return None if all(weight_format(f).modelopt_layout for f in load_recipe(recipe).formats) else "compressed-tensors"


def make_olmoe(out: str) -> str:
    torch.manual_seed(0)
    cfg = transformers.OlmoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = transformers.OlmoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return make_olmoe(str(tmp_path_factory.mktemp("olmoe") / "hf"))


@pytest.fixture(scope="module")
def exported(olmoe, tmp_path_factory):
    cache = {}

    def of(recipe: str, fmt: str | None = None) -> str:
        if (recipe, fmt) not in cache:
            out = str(tmp_path_factory.mktemp("out") / recipe)
            cache[recipe, fmt] = stream_export(olmoe, out, recipe, fmt=fmt, progress=False)
        return cache[recipe, fmt]

    return of


def quantized_modules() -> list[str]:
    """What the default patterns quantize in OLMoE: attention projections and every expert's."""
    out = []
    for i in range(LAYERS):
        out += [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [
            f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return out


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4_a16", "nvfp4_experts_only_input_scale1"])
def test_the_export_holds_the_sources_tensors_with_each_quantized_linear_replaced(olmoe, exported, recipe):
    out = exported(recipe)
    source = read_hf_tensors(olmoe)
    rec = load_recipe(recipe)
    quantized = [m for m in quantized_modules() if rec.format_of(m.rsplit(".", 2)[0] if ".experts." in m else m)]
    fmt = weight_format(next(iter(rec.formats)))
    predicted = set(source) - {f"{m}.weight" for m in quantized}
    predicted |= {f"{m}.{leaf}" for m in quantized for leaf in fmt.modelopt_leaves}
    tensors = read_hf_tensors(out)
    assert set(tensors) == predicted
    assert sorted(os.listdir(out)) == sorted(
        ["README.md", "config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors.index.json"]
        + ["model-00001-of-00001.safetensors"]
    )
    for name in set(source) - {f"{m}.weight" for m in quantized}:  # carried byte for byte: embeddings, norms, ...
        assert raw(tensors[name]) == raw(source[name]), name
    assert check_export(out) == []
    if recipe == "nvfp4_experts_only_input_scale1":  # a constant, not calibrated
        scales = [t.item() for n, t in tensors.items() if n.endswith(".input_scale")]
        assert len(scales) == LAYERS * E * 3 and set(scales) == {1.0}
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]["quant_method"] == "modelopt"


NOT_KIMI = FULL.name  # the source is no Kimi release: a rule naming no INT4 grid takes the full one


def eprt_fake_quantized(source: dict[str, torch.Tensor], module: str, fmt) -> torch.Tensor:
    """eprt's fake quantization of a module's source weight: a per-tensor scale (NVFP4's) from the
    amax of what shares it (an expert's gate and up; q, k and v), then the format's round trip."""
    w = source[f"{module}.weight"]
    parent, leaf = module.rsplit(".", 1)
    group = {"gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj")}.get(leaf)
    if group is None and leaf in ("q_proj", "k_proj", "v_proj"):
        group = ("q_proj", "k_proj", "v_proj")
    amax = max(abs_amax(source[f"{parent}.{g}.weight"]) for g in group or (leaf,))
    return fmt.fake_quantize_weight(w, fmt.scale(amax), False, torch.bfloat16)


@pytest.mark.parametrize("recipe", ["fp8_block", "int4", "mxfp4", "nvfp4_a16", "mxfp8"])
def test_compressed_tensors_decodes_every_quantized_tensor_to_eprts_fake_quantized_weight(olmoe, exported, recipe):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    out = exported(recipe, "compressed-tensors")
    qc = QuantizationConfig.model_validate(json.load(open(os.path.join(out, "config.json")))["quantization_config"])
    theirs, source = read_hf_tensors(out), read_hf_tensors(olmoe)
    fmt = weight_format(load_recipe(recipe).on_source(NOT_KIMI).formats[0])
    decoded = 0
    for module in quantized_modules():
        scheme = next(
            g for g in qc.config_groups.values() if any(t == "Linear" or match_name(module, t) for t in g.targets)
        )
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        state = {
            leaf: theirs[f"{module}.{leaf}"]
            for leaf in compressor.compression_param_names(scheme)
            if f"{module}.{leaf}" in theirs
        }
        weight = compressor.decompress(state, scheme)["weight"]
        torch.testing.assert_close(
            weight.to(torch.bfloat16), eprt_fake_quantized(source, module, fmt), rtol=2**-7, atol=0, msg=module
        )
        decoded += 1
    assert decoded == len(quantized_modules())
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
        assert raw(theirs[name]) == raw(source[name])


NEAR = {"fp8_block": 0.1, "int4": 0.3}


@pytest.mark.parametrize("recipe", ["fp8_block", "int4"])
def test_transformers_runs_the_decoded_checkpoint_near_the_bf16_model(olmoe, exported, recipe, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    out = exported(recipe, "compressed-tensors")
    source = read_hf_tensors(olmoe)
    fmt = weight_format(load_recipe(recipe).on_source(NOT_KIMI).formats[0])
    # the model the export stands for: every quantized weight eprt's fake-quantized one
    shutil.copytree(olmoe, tmp_path / "ref", ignore=shutil.ignore_patterns("*.safetensors"))
    ref_weights = dict(source)
    for m in quantized_modules():
        ref_weights[f"{m}.weight"] = eprt_fake_quantized(source, m, fmt)
    save_file(ref_weights, str(tmp_path / "ref" / "model.safetensors"))
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
        )(ids).logits.float()
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.bfloat16)(ids).logits.float()
        bf16 = AutoModelForCausalLM.from_pretrained(olmoe, dtype=torch.bfloat16)(ids).logits.float()
    error, quantization_error = (loaded - ref).abs().max().item(), (loaded - bf16).abs().max().item()
    assert error <= 2**-6 * ref.abs().max().item(), (error, quantization_error)
    # near the bf16 model's: the quantization's own error, a small part of the logits' range
    # near the bf16 model's: its quantization's own error, measured by the logits' relative RMS
    # (fp8_block 0.05, INT4 0.23 on this random model, whose Gaussian weights INT4's 16 levels fit worst)
    relative = ((loaded - bf16).pow(2).mean() / bf16.pow(2).mean()).sqrt().item()
    assert relative < NEAR[recipe], (relative, quantization_error)
    assert torch.nn.functional.cosine_similarity(loaded.flatten(), bf16.flatten(), 0) > 0.95


def stacked_copy(olmoe: str, out) -> str:
    """The checkpoint with each layer's experts stacked as transformers 5 holds them."""
    from safetensors.torch import save_file

    shutil.copytree(olmoe, out, ignore=shutil.ignore_patterns("*.safetensors"))
    t = read_hf_tensors(olmoe)
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts"
        gate_up = [torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")]) for e in range(E)]
        t[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
    save_file(t, str(out / "model.safetensors"))
    return str(out)


def test_stacked_experts_give_the_same_tensors(olmoe, exported, tmp_path):
    stacked = stream_export(
        stacked_copy(olmoe, tmp_path / "stacked"), str(tmp_path / "out"), "nvfp4_a16", progress=False
    )
    ours, per_expert = read_hf_tensors(stacked), read_hf_tensors(exported("nvfp4_a16"))
    assert set(ours) == set(per_expert)
    for name in ours:
        assert raw(ours[name]) == raw(per_expert[name]), name


def test_a_recipes_ignore_list_replaces_the_default(olmoe, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: attention_too\nquantize:\n  - {pattern: '*', format: fp8_block}\n"
        "ignore: ['*embed*', '*norm*', '*.gate', '*.experts', '*.o_proj']\n"
    )
    out = stream_export(olmoe, str(tmp_path / "out"), str(recipe), progress=False)
    names = set(read_hf_tensors(out))
    assert "lm_head.weight_scale" in names  # the default would have left it alone
    assert "model.layers.0.self_attn.o_proj.weight" in names and "model.layers.0.self_attn.q_proj.weight_scale" in names
    assert not any(".experts." in n and n.endswith("_scale") for n in names)


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "deepseek_v3", "qwen3_5_moe", "minimax_m2", "gpt_oss", "llama4", "llama4_text"]
)
def test_a_modeled_family_gives_the_modeled_export_byte_for_byte(family, tmp_path):
    hf = make_tiny(family, str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    for recipe in DATA_FREE:
        for algorithm in ("max", "mse") if recipe in ("nvfp4_a16", "fp8_block") else ("max",):
            kw = dict(recipe=recipe, algorithm=algorithm, fmt=layout_of(recipe))
            try:
                modeled = export_hf(ck, str(tmp_path / f"m-{recipe}-{algorithm}"), progress=False, **kw)
            except ConfigError:  # the tiny widths do not fit the format's groups (INT4's 128): refused alike
                with pytest.raises(ConfigError):
                    stream_export(hf, str(tmp_path / "x"), progress=False, **kw)
                continue
            ours = stream_export(hf, str(tmp_path / f"s-{recipe}-{algorithm}"), progress=False, **kw)
            assert same_files(modeled, ours), (recipe, algorithm)


def test_fused_fp8_experts_are_decoded_expert_by_expert_to_the_modeled_export(tmp_path, monkeypatch):
    """Mistral-Small-4 as released: per-tensor FP8, each layer's experts fused in one tensor with a
    scale per expert's gate and up rows. Each expert is decoded from its own rows of the weight and
    scales, never the whole stack per expert, to the modeled export's bytes."""
    from eprt.storage.encodings import TensorFP8
    from eprt.testing.tiny import released

    hf = make_tiny("mistral4", str(tmp_path / "hf"), **released("mistral4"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    decoded = []
    decode = TensorFP8.decode
    monkeypatch.setattr(TensorFP8, "decode", lambda self, c: decoded.append(c["weight"].shape) or decode(self, c))
    for recipe in ("fp8_block", "nvfp4_a16"):
        modeled = export_hf(ck, str(tmp_path / f"m-{recipe}"), progress=False, recipe=recipe)
        decoded.clear()
        assert same_files(modeled, stream_export(hf, str(tmp_path / f"s-{recipe}"), recipe, progress=False)), recipe
        whole = [s for s in decoded if len(s) == 3 and s[0] > 1]
        assert len(whole) <= 2 and (1, *whole[0][1:]) in decoded, decoded  # the stacks' probes, then one expert each


def mtp_recipe(tmp_path, fmt: str) -> str:
    """Data-free `fmt` on every Linear, the multi-token-prediction layers' too."""
    recipe = tmp_path / f"{fmt}_mtp.yaml"
    recipe.write_text(f'name: {fmt}_mtp\nquantize:\n  - {{pattern: "*", format: {fmt}}}\nmtp: true\n')
    return str(recipe)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_true_quantizes_the_mtp_layers_as_the_modeled_export_does(family, tmp_path):
    hf = make_tiny(family, str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    mtp = f"model.layers.{json.loads((tmp_path / 'hf' / 'config.json').read_text())['num_hidden_layers']}"
    for fmt in ("fp8_block", "nvfp4_a16"):  # block scales; a per-tensor scale gate and up share
        recipe = mtp_recipe(tmp_path, fmt)
        modeled = export_hf(ck, str(tmp_path / f"m-{fmt}"), progress=False, recipe=recipe)
        ours = stream_export(hf, str(tmp_path / f"s-{fmt}"), recipe, progress=False)
        assert same_files(modeled, ours), fmt
        names = set(read_hf_tensors(ours))
        assert f"{mtp}.self_attn.o_proj.weight_scale" in names and f"{mtp}.mlp.experts.0.up_proj.weight_scale" in names
        assert f"{mtp}.eh_proj.weight" in names and f"{mtp}.eh_proj.weight_scale" not in names


def test_a_model_eprt_does_not_model_has_its_mtp_layers_found_by_name(tmp_path):
    """DeepSeek-V3's layers under a model_type eprt does not model: its MTP layer (past
    num_hidden_layers) is carried whole without `mtp: true` and quantized by the rules with it, but
    for its own input projection and shared head: the tensors the modeled export writes."""
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    unknown = tmp_path / "unknown"
    shutil.copytree(hf, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not_modeled_moe"}))
    for recipe in ("fp8_block", mtp_recipe(tmp_path, "fp8_block")):
        tag = "mtp" if recipe.endswith(".yaml") else "plain"
        expected = read_hf_tensors(export_hf(ck, str(tmp_path / f"m-{tag}"), progress=False, recipe=recipe))
        got = read_hf_tensors(stream_export(str(unknown), str(tmp_path / f"s-{tag}"), recipe, progress=False))
        assert set(got) == set(expected), tag
        for name, t in expected.items():
            assert raw(got[name]) == raw(t), (tag, name)
        assert ("model.layers.3.self_attn.o_proj.weight_scale" in got) == (tag == "mtp")


def same_files(a: str, b: str) -> bool:
    return {k: v.split("@")[0] for k, v in tree_digest(a).items()} == {
        k: v.split("@")[0] for k, v in tree_digest(b).items()
    }


SHARD = 300_000  # bytes: the OLMoE export in several shards


def test_workers_write_the_same_bytes_as_one(olmoe, tmp_path):
    before = tree_digest(olmoe)
    one = stream_export(olmoe, str(tmp_path / "one"), "fp8_block", max_shard_bytes=SHARD, progress=False)
    two = stream_export(olmoe, str(tmp_path / "two"), "fp8_block", max_shard_bytes=SHARD, workers=2, progress=False)
    assert len([f for f in os.listdir(one) if f.endswith(".safetensors")]) > 3
    assert same_files(one, two)
    assert tree_digest(olmoe) == before  # the input untouched


def test_workers_share_a_shard_and_write_the_same_bytes_as_one(olmoe, tmp_path, monkeypatch):
    """An export of one shard (any under 5 GiB) is cut into a span of tensors a worker, each written
    at its place in the one file: the same bytes as one process writes, every span once."""
    one = stream_export(olmoe, str(tmp_path / "one"), "fp8_block", progress=False)
    assert [f for f in os.listdir(one) if f.endswith(".safetensors")] == ["model-00001-of-00001.safetensors"]
    log = tmp_path / "spans.txt"
    write = streaming_run.Stream.write_shard

    def logged(self, work, i, progress=None, span=None):
        write(self, work, i, progress, span)
        with open(log, "a") as f:  # from the forked workers: appended, line by line
            f.write(f"{i} {span[0]} {span[1]} {len(self.shards[i])}\n")

    monkeypatch.setattr(streaming_run.Stream, "write_shard", logged)
    two = stream_export(olmoe, str(tmp_path / "two"), "fp8_block", workers=2, progress=False)
    assert same_files(one, two)  # every file, the temporary ones gone
    spans = sorted(tuple(map(int, line.split())) for line in log.read_text().splitlines())
    (_, a, b, n), (_, c, d, _) = spans
    assert len(spans) == 2 and (a, b, c, d) == (0, b, b, n) and 0 < b < n


def write_as_rank(olmoe: str, out: str) -> str:
    from eprt.parallel import ParallelState

    with ParallelState.from_env() as state:
        return stream_export(olmoe, out, "fp8_block", max_shard_bytes=SHARD, progress=False, parallel=state)


def test_two_ranks_write_the_same_bytes_as_one(olmoe, tmp_path):
    one = stream_export(olmoe, str(tmp_path / "one"), "fp8_block", max_shard_bytes=SHARD, progress=False)
    run_world(write_as_rank, 2, olmoe, str(tmp_path / "ranks"), timeout=240)
    assert same_files(one, str(tmp_path / "ranks"))


def test_an_interrupted_run_resumes_shard_by_shard(olmoe, tmp_path, monkeypatch):
    clean = stream_export(olmoe, str(tmp_path / "clean"), "fp8_block", max_shard_bytes=SHARD, progress=False)
    out = str(tmp_path / "out")
    work = streaming_run.work_dir_for(out)
    write = streaming_run.Stream.write_shard

    def stop_at_third(self, work, i, progress=None):
        if len([f for f in os.listdir(work) if f.endswith(".safetensors")]) == 2:
            raise KeyboardInterrupt
        write(self, work, i, progress)

    monkeypatch.setattr(streaming_run.Stream, "write_shard", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        stream_export(olmoe, out, "fp8_block", max_shard_bytes=SHARD, progress=False)
    assert not os.path.exists(out)  # nothing that looks finished
    kept = sorted(f for f in os.listdir(work) if f.endswith(".safetensors"))
    assert len(kept) == 2
    for f in kept:  # marked: a shard written again would not keep the mark
        os.utime(os.path.join(work, f), ns=(1, 1))
    monkeypatch.setattr(streaming_run.Stream, "write_shard", write)
    stream_export(olmoe, out, "fp8_block", max_shard_bytes=SHARD, progress=False)
    assert same_files(clean, out)
    marked = sorted(f for f in os.listdir(out) if os.stat(os.path.join(out, f)).st_mtime_ns == 1)
    assert marked == kept  # the first run's shards were kept, the others written
    assert not os.path.exists(work)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_stopped_inside_a_shard_resumes(olmoe, tmp_path, monkeypatch, workers):
    """A run killed while it wrote a shard leaves its temporary file; the next run writes it again."""
    clean = stream_export(olmoe, str(tmp_path / "clean"), "fp8_block", max_shard_bytes=SHARD, progress=False)
    out = str(tmp_path / "out")
    close = streaming_run.SafetensorsWriter.close

    def stop_before_renaming(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming_run.SafetensorsWriter, "close", stop_before_renaming)
    with pytest.raises(KeyboardInterrupt):
        stream_export(olmoe, out, "fp8_block", max_shard_bytes=SHARD, progress=False)
    work = streaming_run.work_dir_for(out)
    assert [f for f in os.listdir(work) if f.endswith(streaming_run.PARTIAL)]
    monkeypatch.setattr(streaming_run.SafetensorsWriter, "close", close)
    stream_export(olmoe, out, "fp8_block", max_shard_bytes=SHARD, workers=workers, progress=False)
    assert same_files(clean, out)


def test_a_run_with_other_settings_starts_over(olmoe, tmp_path):
    out = str(tmp_path / "out")
    work = streaming_run.work_dir_for(out)
    os.makedirs(work)
    with open(os.path.join(work, streaming_run.PLAN_FILE), "w") as f:
        json.dump({"recipe": "another"}, f)
    with open(os.path.join(work, "model-00001-of-00001.safetensors"), "w") as f:
        f.write("stale")
    stream_export(olmoe, out, "fp8_block", progress=False)
    assert check_export(out) == []


def test_relative_paths_are_the_same_export(olmoe, exported, tmp_path, monkeypatch):
    """`eprt-export OLMOE_DIR olmoe-fp8 --recipe fp8_block`, as the README writes it, from the directory holding both."""
    import eprt.commands.export as export_command

    shutil.copytree(olmoe, tmp_path / "OLMOE_DIR")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["eprt-export", "OLMOE_DIR", "olmoe-fp8", "--recipe", "fp8_block", "--no-progress"])
    export_command.export()
    assert same_files(exported("fp8_block"), str(tmp_path / "olmoe-fp8"))
    assert sorted(os.listdir(tmp_path)) == ["OLMOE_DIR", "olmoe-fp8"]  # no work directory left


def test_the_dry_run_plans_and_writes_nothing(olmoe, tmp_path):
    plan = stream_export(olmoe, str(tmp_path / "out"), "nvfp4_a16", max_shard_bytes=SHARD, dry_run=True, workers=2)
    assert plan["quantized"] == {"nvfp4_a16": len(quantized_modules())}
    assert plan["shards"] > 1 and plan["peak_bytes"] > 0
    assert os.listdir(tmp_path) == []


def test_eprt_check_says_it_checked_by_names_and_shapes(olmoe, exported, capsys, monkeypatch):
    import eprt.commands.check as check_command

    out = exported("fp8_block")
    monkeypatch.setattr("sys.argv", ["eprt-check", out, "--source", olmoe])
    assert check_command.check() == 0
    said = capsys.readouterr().out
    assert "'olmoe' is not a family eprt models" in said and said.strip().endswith(": ok")


def test_a_wrong_shape_is_named_against_the_source(olmoe, exported, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(exported("fp8_block"), broken)
    t = read_hf_tensors(str(broken))
    t["model.norm.weight"] = t["model.norm.weight"][:64]
    (broken / "model.safetensors.index.json").unlink()
    for f in broken.glob("*.safetensors"):
        f.unlink()
    save_file(t, str(broken / "model.safetensors"))
    problems = check_export(str(broken), olmoe)
    assert any(p.startswith("model.norm.weight: has shape [64]") for p in problems), problems


def test_what_needs_calibration_or_a_recipe_is_refused(olmoe, tmp_path, monkeypatch):
    import eprt.commands.export as export_command

    with pytest.raises(ConfigError, match="needs calibration data and the model; the model-free export takes"):
        stream_export(olmoe, str(tmp_path / "out"), "nvfp4", progress=False)
    # data-free, but a rotation rewrites the model's residual stream, which only a modeled family names
    with pytest.raises(ConfigError, match="its rotation folds the norms .* takes a model eprt models; convert"):
        stream_export(olmoe, str(tmp_path / "out"), "fp8_block", algorithm="rotate", progress=False)
    monkeypatch.setattr("sys.argv", ["eprt-export", olmoe, str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="give a data-free --recipe"):
        export_command.export()
    assert not os.path.exists(tmp_path / "out")


KIMI_K2 = dict(model_type="kimi_k2", num_nextn_predict_layers=0)
# block FP8 with partial last blocks in both dimensions (tests/test_compressed.py's DeepSeek)
FP8_DEEPSEEK = dict(hidden_size=192, intermediate_size=304, moe_intermediate_size=144, num_nextn_predict_layers=0)


@pytest.mark.parametrize(
    "source_format, overrides, recipe",
    [
        ("int4", KIMI_K2, "nvfp4_a16"),  # Kimi-K2-Thinking's INT4 experts
        ("mxfp4", KIMI_K2, "nvfp4_experts_only_input_scale1"),  # MXFP4 experts into NVFP4, kept exactly
        ("fp8-block", FP8_DEEPSEEK, "fp8_block"),  # DeepSeek-V3's block FP8
    ],
)
def test_encoded_sources_are_decoded_tensor_by_tensor(source_format, overrides, recipe, tmp_path):
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"), shards=2, source_format=source_format, **overrides)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    modeled = export_hf(ck, str(tmp_path / "modeled"), progress=False, recipe=recipe)
    assert same_files(modeled, stream_export(hf, str(tmp_path / "ours"), recipe, progress=False))
    # the same checkpoint under a model_type eprt does not model: by name patterns, the same tensors
    unknown = tmp_path / "unknown"
    shutil.copytree(hf, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not_modeled_moe"}))
    by_patterns = read_hf_tensors(stream_export(str(unknown), str(tmp_path / "patterns"), recipe, progress=False))
    expected = read_hf_tensors(modeled)
    assert set(by_patterns) == set(expected)
    for name, t in expected.items():
        assert raw(by_patterns[name]) == raw(t), name


def test_block_fp8_decodes_block_by_block_to_the_elementwise_products():
    from eprt.storage.encodings import dequantize_block_fp8, expand_blocks

    g = torch.Generator().manual_seed(0)
    for rows, cols in ((300, 200), (256, 384), (5, 130)):
        w = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.01
        spread = (w.float() * expand_blocks(scale, w.shape, (128, 128))).to(torch.bfloat16)
        assert raw(dequantize_block_fp8(w, scale, (128, 128), torch.bfloat16)) == raw(spread)


def test_the_command_starts_local_ranks_that_write_the_same_bytes(olmoe, tmp_path):
    import subprocess
    import sys

    one = stream_export(olmoe, str(tmp_path / "one"), "fp8_block", max_shard_bytes=SHARD, progress=False)
    out = str(tmp_path / "ranks")
    cmd = [sys.executable, "-m", "eprt.commands.export", olmoe, out, "--recipe", "fp8_block"]
    cmd += ["--nproc-per-node", "2", "--max-shard-size", str(SHARD), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert same_files(one, out)
