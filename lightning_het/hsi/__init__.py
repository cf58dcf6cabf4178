"""Hyperspectral land-cover data: raster I/O, synthetic scenes, preprocessing, splits, datasets, prediction maps."""

from lightning_het.hsi.datamodule import HyperspectralDataModule
from lightning_het.hsi.datasets import InMemoryPatches, PatchDataset, WindowedPatches
from lightning_het.hsi.matfile import read_mat_scene
from lightning_het.hsi.prediction import (
    PredictionMapWriter,
    assemble_class_map,
    write_prediction_geotiff,
    write_prediction_png,
)
from lightning_het.hsi.preprocessing import SpectralTransform, fit_spectral_transform, valid_mask
from lightning_het.hsi.raster import RasterInfo, check_alignment, raster_info, read_image, read_labels, write_geotiff
from lightning_het.hsi.splits import Split, block_split, footprint_mask, random_split
from lightning_het.hsi.synthetic import SyntheticScene, make_synthetic_scene, write_synthetic_scene

__all__ = [
    "HyperspectralDataModule",
    "InMemoryPatches",
    "PatchDataset",
    "PredictionMapWriter",
    "RasterInfo",
    "SpectralTransform",
    "Split",
    "SyntheticScene",
    "WindowedPatches",
    "assemble_class_map",
    "block_split",
    "check_alignment",
    "fit_spectral_transform",
    "footprint_mask",
    "make_synthetic_scene",
    "random_split",
    "raster_info",
    "read_image",
    "read_labels",
    "read_mat_scene",
    "valid_mask",
    "write_geotiff",
    "write_prediction_geotiff",
    "write_prediction_png",
    "write_synthetic_scene",
]
