"""The progress bar's remaining time, as a calibration's layers feed it; log lines above the bar; a quiet run."""

import os
import re

from eprt.progress import QUIET, bar, configure_logging, logger


def remaining_s(pb) -> int:
    """The remaining time the bar shows, in seconds."""
    minutes, seconds = re.search(r"<(\d+):(\d+)", pb.format_meter(**pb.format_dict)).groups()
    return int(minutes) * 60 + int(seconds)


def test_the_remaining_time_counts_the_work_between_a_layers_steps(monkeypatch):
    """Each layer: 4 steps of 10 s, 120 s without a step (its read and GPTQ's solve), 4 more steps:
    200 s a layer. After each whole layer the bar says what is left to the second, though its last
    steps ran at 10 s a step."""
    monkeypatch.setenv("RANK", "0")
    clock = [0.0]
    layers, steps = 5, 8
    with bar(layers * steps, "calibrate", unit="step") as pb:
        pb._time, pb.start_t, pb.last_print_t = lambda: clock[0], 0.0, 0.0
        for layer in range(layers):
            for step in range(steps):
                clock[0] += 10.0 + (120.0 if step == 4 else 0.0)
                pb.update(1)
            assert remaining_s(pb) == (layers - layer - 1) * 200, layer


def test_a_log_line_is_written_above_the_bar_not_into_it(monkeypatch, capsys):
    """tqdm clears its bar, writes the line and draws the bar again below it: the line stands alone."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(QUIET, raising=False)
    configure_logging()
    with bar(10, "calibrate", unit="step") as pb:
        pb.update(3)
        logger().info("layer 0 done")
        pb.update(3)
    err = capsys.readouterr().err
    assert "\r[eprt rank 0] layer 0 done\n" in err or err.count("\n[eprt rank 0] layer 0 done\n"), err
    assert "| 3/10" in err.split("layer 0 done")[1]  # the bar again, below the line


def test_a_quiet_run_shows_warnings_only_and_no_bar(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    # set, not deleted: monkeypatch records a variable it sets, so its teardown leaves the environment as it was
    monkeypatch.setenv(QUIET, "0")
    configure_logging(quiet_run=True)
    assert os.environ[QUIET] == "1"  # the ranks a launcher starts inherit it
    with bar(10, "calibrate", unit="step") as pb:
        pb.update(10)
    logger().info("calibrated")
    logger().warning("an expert got no token")
    assert capsys.readouterr().err == "[eprt rank 0] an expert got no token\n"
    monkeypatch.setenv(QUIET, "0")
    configure_logging()
