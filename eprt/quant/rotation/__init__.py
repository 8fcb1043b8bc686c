"""The rotations fused into the weights (`--algorithm rotate...`): the randomised Hadamard
(`hadamard`), which tensors they change (`plan`) and the checkpoint read rotated (`rotated`):
docs/rotation.md."""
