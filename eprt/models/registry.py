"""The model class that runs each eprt family (ModelConfig.family), as the family table names it."""

from __future__ import annotations

import importlib

from eprt.families import family


def model_class(name: str) -> type:
    module, cls = family(name).model.split(":")
    return getattr(importlib.import_module(module), cls)
