"""Storage, below the Hugging Face border: the eprt checkpoint, the safetensors reader and writer,
the encodings source weights stay in (compressed-tensors, block FP8), the Hugging Face file names,
and outputs that appear atomically, inside the directories they belong to."""
