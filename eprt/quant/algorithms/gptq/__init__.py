"""GPTQ: the registered object (`algorithm`), the column sweep (`solve`), a layer's Hessians and
solve (`layer`) and its pass (`passes`)."""
