"""AWQ: the registered object (`algorithm`), its balance groups (`groups`), folds (`folds`), searches
(`search`, `clip`), memory (`plan`) and pass (`passes`)."""
