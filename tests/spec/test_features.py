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
