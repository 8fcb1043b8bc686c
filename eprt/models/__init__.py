"""eprt's own model code: shared layers, attention, MoE, one file per family, and the loader.

Tensor names carry their shapes (`x_TD`); the letters are in docs/architecture.md, "Shape suffixes".
"""
