"""The multi-token-prediction layers as a pass: after the last decoder layer, each MTP layer the
recipe quantizes a module of (DeepSeek-V3's `model.layers.{num_hidden_layers + k}`, DeepSeek-V4's
`mtp.k`: eprt.families.family.Family.mtp_layer), in order, on
the final hidden states and the next tokens' embeddings, through the passes that cover MTP layers
(eprt.quant.loop.engine.LayerEngine.run_mtp). The chain stops at the first layer it skips."""

from __future__ import annotations

from eprt.quant.loop.engine import LayerEngine, Pass
from eprt.quant.loop.sequences import LayerState


class MTPLayers(Pass):
    def __init__(self, targets: list[str]):
        self.targets = targets

    def prefixes(self, engine: LayerEngine) -> list[str]:
        c = engine.ck.config
        out = []
        for k in range(c.num_nextn_predict_layers):
            prefix = engine.rc.family.mtp_layer(c, k, engine.prefix)
            if not any(t.startswith(prefix) for t in self.targets):
                break
            out.append(prefix)
        return out

    def finish(self, engine: LayerEngine, ls: LayerState) -> None:
        hidden = ls.hidden  # `ls` is left as it is
        for k, prefix in enumerate(self.prefixes(engine)):
            hidden = engine.run_mtp(k, prefix, hidden)
