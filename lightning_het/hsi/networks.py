"""Patch classifiers for hyperspectral pixels: spectral 1-D CNN, 2-D CNN, 3-D CNN and a HybridSN-style net."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CNN2D", "CNN3D", "NETWORKS", "HybridSN", "Spectral1DCNN", "build_network"]


def _groups(channels: int) -> int:
    """Groups for ``GroupNorm``: the largest of 4, 2 and 1 that divides ``channels``."""
    return math.gcd(channels, 4)


class Spectral1DCNN(nn.Module):
    """1-D convolutions along the spectrum of the centre pixel only (ignores the spatial context)."""

    def __init__(self, in_bands: int, num_classes: int, patch_size: int = 1, width: int = 8, dropout: float = 0.0):
        super().__init__()
        k1, k2 = min(7, in_bands), min(5, max(1, in_bands // 2))
        self.features = nn.Sequential(
            nn.Conv1d(1, width, k1, padding=k1 // 2),
            nn.GroupNorm(_groups(width), width),
            nn.ReLU(),
            nn.MaxPool1d(2, ceil_mode=True),
            nn.Conv1d(width, 2 * width, k2, padding=k2 // 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(4),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(8 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centre = x[:, :, x.shape[2] // 2, x.shape[3] // 2]  # (N, B)
        return self.classifier(self.features(centre.unsqueeze(1)))


class CNN2D(nn.Module):
    """2-D CNN over the patch: a 1x1 spectral projection, then two 3x3 convolutions and global average pooling."""

    def __init__(self, in_bands: int, num_classes: int, patch_size: int = 5, width: int = 32, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_bands, width, 1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.GroupNorm(_groups(width), width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CNN3D(nn.Module):
    """3-D CNN: joint spectral-spatial ``(k, 3, 3)`` kernels on the cube ``(1, B, p, p)``."""

    def __init__(self, in_bands: int, num_classes: int, patch_size: int = 5, width: int = 8, dropout: float = 0.0):
        super().__init__()
        k1 = min(7, in_bands)
        stride = 2 if in_bands >= 32 else 1
        k2 = min(5, (in_bands - k1) // stride + 1)
        self.features = nn.Sequential(
            nn.Conv3d(1, width, (k1, 3, 3), padding=(0, 1, 1), stride=(stride, 1, 1)),
            nn.GroupNorm(_groups(width), width),
            nn.ReLU(),
            nn.Conv3d(width, 2 * width, (k2, 3, 3), padding=(0, 1, 1)),
            nn.ReLU(),
            nn.AdaptiveAvgPool3d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.unsqueeze(1)))


class HybridSN(nn.Module):
    """HybridSN-style network (Roy et al., 2020): three 3-D convolutions, a 2-D one, then dense layers."""

    def __init__(self, in_bands: int, num_classes: int, patch_size: int = 5, width: int = 4, dropout: float = 0.0):
        super().__init__()
        depth = in_bands
        layers: list[nn.Module] = []
        channels = 1
        for k, out in ((7, width), (5, 2 * width), (3, 4 * width)):
            k = min(k, depth)
            layers += [nn.Conv3d(channels, out, (k, 3, 3), padding=(0, 1, 1)), nn.ReLU()]
            depth, channels = depth - k + 1, out
        layers.append(nn.AdaptiveAvgPool3d((min(depth, 8), None, None)))
        self.spectral = nn.Sequential(*layers)
        stacked = channels * min(depth, 8)
        self.spatial = nn.Sequential(nn.Conv2d(stacked, 8 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(8 * width * 4, 16 * width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(16 * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.spectral(x.unsqueeze(1))  # (N, c, d, p, p)
        y = y.flatten(1, 2)  # (N, c*d, p, p)
        return self.classifier(self.spatial(y))


#: Registered network constructors, by name.
NETWORKS: dict[str, Callable[..., nn.Module]] = {
    "spectral1d": Spectral1DCNN,
    "cnn2d": CNN2D,
    "cnn3d": CNN3D,
    "hybridsn": HybridSN,
}


def build_network(name: str, in_bands: int, num_classes: int, patch_size: int, **kwargs: object) -> nn.Module:
    """Build the network ``name`` of :data:`NETWORKS` (``kwargs``: ``width``, ``dropout``)."""
    if name not in NETWORKS:
        raise ValueError(f"Expected argument `name` to be one of {sorted(NETWORKS)}, but got {name!r}.")
    for arg, value in (("in_bands", in_bands), ("num_classes", num_classes), ("patch_size", patch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected argument `{arg}` to be a positive integer, but got {value!r}.")
    return NETWORKS[name](in_bands, num_classes, patch_size, **kwargs)
