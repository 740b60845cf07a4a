"""The examples' ``--image-size``: what the small CNN and its synthetic data take."""

from __future__ import annotations

import argparse

import pytest
import torch

from rallypoint.trainer.examples._launch import add_image_size
from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar


def parsed(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_image_size(parser)
    return parser.parse_args(list(args))


def test_the_default_is_cifars_32_and_a_smaller_side_trains_the_same_model() -> None:
    assert parsed().image_size == 32
    for size in (32, 16, 4):
        images, labels = synthetic_cifar(8, 0, size)
        assert images.shape == (8, 3, size, size) and labels.shape == (8,)
        assert SmallCNN(image_size=size)(images).shape == (8, 10)


def test_the_default_images_are_the_ones_the_example_always_made() -> None:
    # Runs compared bit for bit with older ones, and versions saved by them, need the
    # same data at the default: the generator draws as it did before the option.
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (8,), generator=g)
    images = 0.5 * patterns[labels] + torch.randn(8, 3, 32, 32, generator=g)
    assert torch.equal(synthetic_cifar(8, 0)[0], images)


@pytest.mark.parametrize("bad", ["6", "0", "-4"])
def test_a_side_the_two_pools_cannot_halve_twice_is_refused(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parsed("--image-size", bad)
    assert exited.value.code == 2
    assert "is not a multiple of 4 from 4 up" in capsys.readouterr().err
