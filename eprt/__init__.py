"""eprt: an expert-parallel runtime for post-training quantization of Mixture-of-Experts LLMs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Loaded on first use so that `import eprt` does not pull in torch and the model code.
    if name == "load_model":
        from eprt.loading.loader import load_model

        return load_model
    raise AttributeError(f"module 'eprt' has no attribute {name!r}")


__all__ = ["load_model"]
