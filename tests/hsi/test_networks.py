"""The four patch classifiers: shapes for many band/patch sizes, size, factory, and split-invariance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_het.hsi.networks import NETWORKS, build_network
from tests.conftest_hsi import torch_single_thread

__all__ = ["torch_single_thread"]


@pytest.mark.parametrize("name", sorted(NETWORKS))
@pytest.mark.parametrize(("bands", "patch"), [(1, 1), (3, 3), (16, 5), (40, 7), (200, 5)])
def test_output_shape(name, bands, patch):
    net = build_network(name, bands, 9, patch)
    out = net(torch.randn(4, bands, patch, patch))
    assert out.shape == (4, 9) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_small_trainable_and_exact_under_any_batch_split(name):
    torch.manual_seed(0)
    net = build_network(name, 16, 4, 5)
    assert sum(p.numel() for p in net.parameters()) < 60_000  # CPU-test sized
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    x, y = torch.randn(10, 16, 5, 5), torch.randint(0, 4, (10,))
    # per-sample outputs do not depend on the other samples of the batch (no batch statistics)
    torch.testing.assert_close(net(x), torch.cat([net(x[:3]), net(x[3:])]), rtol=1e-5, atol=1e-6)
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_spectral1d_uses_only_the_centre_pixel():
    net = build_network("spectral1d", 8, 3, 5)
    x = torch.randn(2, 8, 5, 5)
    y = x.clone()
    y[:, :, 0, 0] += 10.0
    torch.testing.assert_close(net(x), net(y))


def test_width_and_dropout_kwargs():
    wide = build_network("cnn2d", 8, 3, 5, width=64, dropout=0.5)
    assert any(isinstance(m, nn.Dropout) and m.p == 0.5 for m in wide.modules())
    narrow = build_network("cnn2d", 8, 3, 5)
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in narrow.parameters())


def test_factory_errors():
    with pytest.raises(ValueError, match=r"`name` to be one of \['cnn2d', 'cnn3d', 'hybridsn', 'spectral1d'\]"):
        build_network("resnet", 8, 3, 5)
    with pytest.raises(ValueError, match="`in_bands` to be a positive integer"):
        build_network("cnn2d", 0, 3, 5)
