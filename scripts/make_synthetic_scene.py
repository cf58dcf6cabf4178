"""Write a seeded synthetic hyperspectral scene as two GeoTIFFs (image.tif, labels.tif) and print their paths.

Example::

    python scripts/make_synthetic_scene.py --height 145 --width 145 --bands 200 --classes 16 --seed 0 --out data/ip_like
    python -m lightning_het.train data=geotiff data.image=data/ip_like/image.tif data.labels=data/ip_like/labels.tif
"""

from __future__ import annotations

import argparse
import sys

from lightning_het.hsi.synthetic import make_synthetic_scene, write_synthetic_scene


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = make_synthetic_scene.__kwdefaults__ or {}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=64, help="rows, in pixels (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="columns, in pixels (default: %(default)s)")
    parser.add_argument("--bands", type=int, default=32, help="spectral bands over 400-2500 nm (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=6, help="labelled classes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--noise",
        type=float,
        default=defaults.get("noise"),
        help="sensor noise std, reflectance units (default: %(default)s)",
    )
    parser.add_argument(
        "--region-scale",
        type=float,
        default=defaults.get("region_scale"),
        help="size of the class regions, pixels (default: %(default)s)",
    )
    parser.add_argument(
        "--unlabelled-fraction",
        type=float,
        default=defaults.get("unlabelled_fraction"),
        help="fraction of unlabelled background (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=["uint16", "float32"],
        default="uint16",
        help="uint16 = 10000 x reflectance, float32 = reflectance (default: %(default)s)",
    )
    parser.add_argument("--out", required=True, help="output folder (created)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        image, labels = write_synthetic_scene(
            args.out,
            height=args.height,
            width=args.width,
            bands=args.bands,
            classes=args.classes,
            seed=args.seed,
            noise=args.noise,
            region_scale=args.region_scale,
            unlabelled_fraction=args.unlabelled_fraction,
            dtype=args.dtype,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(image)
    print(labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
