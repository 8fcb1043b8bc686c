import time

import pytest

from tests.multiproc import run_world


def _rank_times_ten(offset):
    import os

    return int(os.environ["RANK"]) * 10 + offset


def _rank1_raises():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 broke")
    return "fine"


def _rank0_hangs():
    import os

    if os.environ["RANK"] == "0":
        time.sleep(60)


@pytest.mark.timeout(60)
def test_run_world_results_failures_and_hangs():
    assert run_world(_rank_times_ten, 2, 3) == [3, 13]

    with pytest.raises(AssertionError) as info:
        run_world(_rank1_raises, 2)
    message = str(info.value)
    assert "--- rank 1 failed:" in message and "ValueError: rank 1 broke" in message
    assert 'in _rank1_raises\n    raise ValueError("rank 1 broke")' in message

    # long enough for rank 1 to start and finish on a loaded machine, far below rank 0's hang
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0\] had not finished after \d+ s and were killed"):
        run_world(_rank0_hangs, 2, timeout=10)
    assert time.monotonic() - start < 30
