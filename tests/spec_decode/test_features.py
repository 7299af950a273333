"""A request's target features: rows by position, overwritten from where the target runs again,
read with a zero row where nothing is held (before position 0, and positions the target ran while
the request kept no rows), forgotten once read."""

import torch

from faser.spec_decode.features import TargetFeatures

ZERO = torch.zeros(2)


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values)[:, None].repeat(1, 2)


def test_write_overwrite_read_forget() -> None:
    features = TargetFeatures()
    features.write(0, rows(0, 1, 2))  # a prefill
    features.write(2, rows(20, 30, 40))  # a verification from the last token: 30, 40 rejected
    features.write(3, rows(31))  # the next step overwrites the rejected rows
    assert features.read(-1, 3, ZERO)[:, 0].tolist() == [0, 0, 1, 20]
    features.forget_before(2)
    assert (features.start, features.end) == (2, 4)
    assert features.read(2, 4, ZERO)[:, 0].tolist() == [20, 31]
    assert features.read(1, 3, ZERO)[:, 0].tolist() == [0, 20]  # h_1 was forgotten
    features.write(0, rows(5))  # a preempted request computed again from the start
    assert (features.start, features.end) == (0, 1)


def test_a_gap_reads_zeros_and_keeps_the_rows_before_it() -> None:
    """Steps that kept no rows (the request did not draft) leave a gap: it reads as zeros, and
    the prompt's rows before it are still there for the draft's catch-up."""
    features = TargetFeatures()
    features.write(0, rows(0, 1, 2))  # a prefill
    features.write(5, rows(50, 60))  # two steps kept nothing; then a verification
    assert (features.start, features.end) == (0, 7)
    assert features.read(-1, 7, ZERO)[:, 0].tolist() == [0, 0, 1, 2, 0, 0, 50, 60]
    features.forget_before(4)
    features.write(9, rows(90))  # a gap again, after forgetting: room reused, the gap zeroed
    assert features.read(4, 10, ZERO)[:, 1].tolist() == [0, 50, 60, 0, 0, 90]


def test_a_request_with_no_rows_held_reads_zeros() -> None:
    """A request whose features were never kept (it did not speculate yet) drafts from zeros."""
    assert TargetFeatures().read(-1, 3, ZERO).tolist() == [[0.0, 0.0]] * 4


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
    assert features.read(-1, 500, ZERO)[:, 1].tolist() == [0.0, *range(500)]
    features.forget_before(450)
    ptr = features.rows.untyped_storage().data_ptr()
    for pos in range(500, 700):  # 250 rows held: room in the buffer once the first are gone
        features.write(pos, rows(pos))
    assert features.rows.untyped_storage().data_ptr() == ptr
    assert features.read(450, 700, ZERO)[:, 0].tolist() == list(range(450, 700))
    features.write(600, rows(-1, -2))  # a rejected tail overwritten: later rows dropped
    assert features.end == 602
    assert features.read(598, 602, ZERO)[:, 0].tolist() == [598, 599, -1, -2]
