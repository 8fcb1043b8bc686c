"""The calibration algorithms, each one registered object that owns its life in a run
(docs/adding-an-algorithm.md): `registry` names them and parses a rule's sequence, `base` is the
contract, `program` builds a run's program from a recipe; one module an algorithm."""
