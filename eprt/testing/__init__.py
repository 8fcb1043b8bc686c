"""Fixtures, not runtime code: the tiny random checkpoints the demo, `eprt-make-tiny` and the tests share."""
