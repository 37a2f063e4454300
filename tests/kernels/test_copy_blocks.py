"""copy_blocks copies whole blocks by id and leaves every other block alone."""

from __future__ import annotations

import pytest
import torch

from ragkv.errors import InvalidInputError
from ragkv.kernels import copy_blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_listed_blocks_are_copied_and_others_untouched(backend):
    src = torch.randn(5, 8, 2, 16)
    dst = torch.randn(4, 8, 2, 16)
    want = dst.clone()
    want[3], want[0] = src[1], src[4]

    copy_blocks(src, dst, torch.tensor([1, 4]), torch.tensor([3, 0]), backend=backend)

    assert torch.equal(dst, want)


def test_blocks_of_another_shape_are_refused():
    with pytest.raises(InvalidInputError):
        copy_blocks(
            torch.zeros(2, 8, 2, 16),
            torch.zeros(2, 16, 2, 16),
            torch.tensor([0]),
            torch.tensor([0]),
        )
