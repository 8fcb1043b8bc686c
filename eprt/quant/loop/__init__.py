"""The layer-major loop of a calibration: the engine, its schedule of sequences, the statistics it
records and the passes that join it."""
