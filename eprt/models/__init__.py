"""eprt's own model code: shared layers, attention, MoE, one file per family, and the loader."""
