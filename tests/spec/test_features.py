"""A request's target features: rows by position, overwritten from where the target runs again,
read with a zero row before position 0, forgotten once read, and a clear error for a gap."""

import pytest
import torch

from faser.spec.features import TargetFeatures


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values)[:, None].repeat(1, 2)


def test_write_overwrite_read_forget() -> None:
    features = TargetFeatures()
    features.write(0, rows(0, 1, 2))  # a prefill
    features.write(2, rows(20, 30, 40))  # a verification from the last token: 30, 40 rejected
    features.write(3, rows(31))  # the next step overwrites the rejected rows
    assert features.read(-1, 3)[:, 0].tolist() == [0, 0, 1, 20]
    features.forget_before(2)
    assert (features.start, features.end) == (2, 4)
    assert features.read(2, 4)[:, 0].tolist() == [20, 31]
    with pytest.raises(RuntimeError, match=r"positions \[1, 3\) are not held"):
        features.read(1, 3)
    features.write(0, rows(5))  # a preempted request computed again from the start
    assert (features.start, features.end) == (0, 1)


def test_a_long_run_of_writes_keeps_every_row_and_grows_by_doubling() -> None:
    """Plain steps append a row each and nobody reads them: the buffer grows a few times, never
    at every write, and forgetting then writing reuses the room it has."""
    features = TargetFeatures()
    features.write(0, rows(*range(10)))
    buffers = set()
    for pos in range(10, 500):
        features.write(pos, rows(pos))
        buffers.add(features.rows.untyped_storage().data_ptr())
    assert len(buffers) <= 6
    assert features.read(-1, 500)[:, 1].tolist() == [0.0, *range(500)]
    features.forget_before(450)
    ptr = features.rows.untyped_storage().data_ptr()
    for pos in range(500, 700):  # 250 rows held: room in the buffer once the first are gone
        features.write(pos, rows(pos))
    assert features.rows.untyped_storage().data_ptr() == ptr
    assert features.read(450, 700)[:, 0].tolist() == list(range(450, 700))
    features.write(600, rows(-1, -2))  # a rejected tail overwritten: later rows dropped
    assert features.end == 602 and features.read(598, 602)[:, 0].tolist() == [598, 599, -1, -2]
