"""Several tiny fits in a row inside one job: ``python -m tests.helpers.run_fits OUT_DIR JSON_LIST``.

Each element of the JSON list is a ``tests.helpers.run_tiny`` config; fit ``i`` dumps ``OUT_DIR/<i>/rank<r>.pt``.
The fits share the job's processes and its default process group (started once, by the first fit), so that an
external launcher (``srun``, ``torchrun``) pays its start-up cost once for several strategy settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import run_tiny


def main() -> None:
    out = Path(sys.argv[1])
    for index, cfg in enumerate(json.loads(sys.argv[2])):
        (out / str(index)).mkdir(parents=True, exist_ok=True)
        sys.argv[1:] = [str(out / str(index)), json.dumps(cfg)]
        run_tiny.main()


if __name__ == "__main__":
    main()
