"""eprt's own model code, the blocks the families share: layers, attention, MoE, routers, the
decoder, and what quantization may reach (taps, AWQ's balance groups). Each family's model is its
folder's `model.py` (eprt/families/<name>/); the loader is eprt.loading.

Tensor names carry their shapes (`x_TD`); the letters are in docs/architecture.md, "Shape suffixes".
"""
