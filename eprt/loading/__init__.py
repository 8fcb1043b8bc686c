"""A checkpoint's model, built and read: the family table resolved for a checkpoint
(`resolved`), and the model loaded from it on one process or on every rank of an
expert-parallel run (`loader`). Above the family table, which names each family's model class."""
