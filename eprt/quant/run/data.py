"""A PTQ run's data, from its settings: refused before the memory plan (`check_data_settings`), read
after it (`report_data`: the calibration sequences and the quality report's held-out ones)."""

from __future__ import annotations

from eprt.data import Calibration, calibration_samples, check_sources, read_calibration
from eprt.errors import ConfigError
from eprt.quant.run.args import PTQArgs
from eprt.samples import read_rows


def check_data_settings(a: PTQArgs) -> None:
    """Refuse the data settings before the memory plan, which runs before any data is read."""
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size} must be positive")
    if a.eval_size < 0:
        raise ConfigError(f"--eval-size {a.eval_size}: give a positive size, or 0 for no quality report")
    if a.eval_size == 0 and a.eval is not None:
        raise ConfigError(f"--eval {a.eval} with --eval-size 0: give a positive --eval-size, or leave out --eval")
    check_sources(a.calib)
    if a.eval is not None:
        check_sources(a.eval, "--eval")


def describe_calib(calib: str | tuple[str, ...] | None) -> str | None:
    """--calib as given, for the report and the summary."""
    return calib if isinstance(calib, str) or calib is None else ", ".join(calib)


def report_data(a: PTQArgs, hf_dir: str, vocab_size: int) -> Calibration:
    """The calibration sequences, the quality report's held-out ones (None with --eval-size 0) and
    what each source gave: the last --eval-size of calib_size + eval_size sequences of the data
    (of each source, its share), or --eval-size of --eval FILE."""
    sizes = dict(
        num_samples=a.calib_size,
        held_out=a.eval_size if a.eval is None else 0,
        seq_len=a.seq_len,
        vocab_size=vocab_size,
        column=a.calib_column,
    )
    if a.calib_rows == "pack" and a.seed is None:
        data = read_calibration(a.calib, hf_dir, **sizes)
    else:  # one document a sequence, or shuffled (eprt.samples)
        data = read_rows(a.calib, hf_dir, rows=a.calib_rows, seed=a.seed, **sizes)
    if a.eval_size and a.eval is not None:
        data = data._replace(
            held_out=calibration_samples(
                a.eval, hf_dir, num_samples=a.eval_size, seq_len=a.seq_len, vocab_size=vocab_size, column=a.calib_column
            )
        )
    return data
