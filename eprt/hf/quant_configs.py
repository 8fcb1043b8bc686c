"""The quantization configs of a quantized export, from what it quantizes: ModelOpt's
(config.json's quantization_config and hf_quant_config.json) and compressed-tensors'
(config.json's quantization_config). Both exports build them here: the one of a calibrated
checkpoint (eprt.hf.export_quantized) from its family's table, the model-free one
(eprt.hf.streaming) from the name patterns that matched.
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt import __version__
from eprt.hf import compressed_tensors_export as ct
from eprt.quant.formats import WeightFormat
from eprt.quant.formats.kv import kv_cache_format
from eprt.storage.encodings import without_quantization

MIXED = "MIXED_PRECISION"
PRODUCER = {"name": "modelopt", "version": "0.47.0", "exported_by": f"eprt {__version__}"}


@dataclass(frozen=True)
class QuantizedLinears:
    """What an export quantizes, as its configs name it."""

    source_config: dict  # the source's config.json
    # each quantized module, a layer's routed experts as one `...experts` module, in module order
    modules: dict[str, WeightFormat]
    # each quantized Linear, routed experts one by one -> its format
    linears: dict[str, WeightFormat]
    unquantized: frozenset[str]  # the Linear-like modules left unquantized, routed experts one by one
    unquantized_experts: frozenset[str]  # routed-experts modules left whole
    passthrough: frozenset[str]  # what travels through unmodeled, one module prefix each
    kv_cache: str | None = None

    def excluded(self) -> list[str]:
        """exclude_modules: the Linear-like modules left unquantized, summarized by prefix wildcards
        as ModelOpt summarizes them (`summarize_excluded`), then what travels through, one pattern each."""
        names = summarize_excluded(set(self.unquantized), set(self.linears))
        return sorted(names | {f"{p}.*" for p in self.passthrough})


def ct_config(q: QuantizedLinears) -> dict:
    """config.json: the source's, its own quantization configs replaced by compressed-tensors'
    quantization_config."""
    dense = {m for m in q.unquantized if not any(m.startswith(f"{e}.") for e in q.unquantized_experts)}
    qc = ct.quantization_config(
        set(q.modules.values()),
        ct.ignore_list(dense, set(q.unquantized_experts), set(q.passthrough)),
        q.kv_cache,
        ct.targets(q.linears, set(q.unquantized)),
    )
    return {**without_quantization(q.source_config), "quantization_config": qc}


def modelopt_configs(q: QuantizedLinears) -> tuple[dict, dict]:
    """(config.json, hf_quant_config.json), as ModelOpt writes them: one quant_algo with its
    exclude_modules, or MIXED_PRECISION with each quantized module's own (`quantized_layers`,
    the routed experts of a layer as one `...experts` module), where a module it does not list
    is unquantized and only what travels through unmodeled is excluded. The source's own
    quantization configs (a VLM's text_config one too) describe its weights, not these: dropped."""
    kv = kv_cache_format(q.kv_cache)
    kv_algo = kv.quant_algo if kv is not None else None
    layers = {m: fmt.modelopt_layer() for m, fmt in q.modules.items()}  # in module order
    if len(set(q.modules.values())) == 1:
        fmt, excluded = next(iter(q.modules.values())), q.excluded()
        algo = fmt.quant_algo
        quant = {
            "quant_algo": algo,
            "kv_cache_quant_algo": kv_algo,
            "exclude_modules": excluded,
            **{k: v for k, v in fmt.modelopt_layer().items() if k != "quant_algo"},
        }
        groups = {"group_0": {"targets": ["Linear"], **group_config(fmt)}}
        qc = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "config_groups": groups,
            "ignore": excluded,
            "producer": PRODUCER,
        }
    else:
        quant = {"quant_algo": MIXED, "kv_cache_quant_algo": kv_algo, "quantized_layers": layers}
        # what travels through unmodeled (MTP layers left whole) is excluded by prefix, as ModelOpt adds it
        passthrough = sorted(f"{p}.*" for p in q.passthrough)
        if passthrough:
            quant["exclude_modules"] = passthrough
        by_config: dict[WeightFormat, list[str]] = {}  # in order of first use, as ModelOpt numbers its groups
        for m, fmt in q.modules.items():
            by_config.setdefault(fmt, []).append(m)
        groups = {
            f"group_{i}": {**group_config(fmt), "targets": sorted(ms)} for i, (fmt, ms) in enumerate(by_config.items())
        }
        qc = {
            "quant_method": "modelopt",
            "quant_algo": MIXED,
            "config_groups": groups,
            "ignore": passthrough,
            "quantized_layers": layers,
            "producer": PRODUCER,
        }
    if kv is not None:
        qc["kv_cache_scheme"] = kv.modelopt_scheme if isinstance(kv.modelopt_scheme, str) else dict(kv.modelopt_scheme)
    config = {**without_quantization(q.source_config), "quantization_config": qc}
    return config, {"producer": PRODUCER, "quantization": quant}


def group_config(fmt: WeightFormat) -> dict:
    """A config group's weights and input_activations (none where inputs stay unquantized) for one
    module's quantization."""
    inputs = fmt.modelopt_input_group()
    return {"weights": fmt.modelopt_group(), **({"input_activations": inputs} if inputs is not None else {})}


def summarize_excluded(unquantized: set[str], quantized: set[str]) -> set[str]:
    """ModelOpt's exclude_modules for these module names (its export's prefix-wildcard summary).

    Each unquantized module is named by the first of `P*` (cut at each dot, left to right), then
    the pair `P`, `P.*` (written as `P.*` alone), then its own name, that covers no quantized
    module: a prefix wildcard `Q[:i]*` of a quantized Q, or Q itself, is never used. So a layer
    whose Linears all stay unquantized is one `model.layers.1*`, while an excluded lm_head next
    to quantized model.* modules stays `lm_head`. Every engine reads these patterns (vLLM splits
    `P*` into `P` and `P.*`)."""
    taken = {q[:i] + "*" for q in quantized for i in range(len(q) + 1)} | quantized
    out: set[str] = set()
    for module in sorted(unquantized):
        cuts = [i for i, c in enumerate(module) if c == "."]
        candidates = [w for i in cuts for w in ([module[:i] + "*"], [module[:i], module[:i] + ".*"])] + [[module]]
        chosen = next(c for c in candidates if not any(w in taken for w in c))
        out.add(chosen[-1])  # the pair is written as its `P.*`
    return out
