"""A PTQ run from its arguments to its output: the settings, what it settles before it reads a weight
(the recipe, the memory plan, the time estimate), the data, the data-free path, the work directory
--resume continues from, and the run itself."""
