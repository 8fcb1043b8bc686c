"""The progress bar's remaining time, as a calibration's layers feed it."""

import re

from eprt.progress import bar


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
