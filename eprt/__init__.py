"""eprt: an expert-parallel runtime for post-training quantization of Mixture-of-Experts LLMs."""
