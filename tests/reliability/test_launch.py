"""The replica launcher's refusals, worded as Lightning's own launcher words them."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.environments import LightningEnvironment


class _LaunchesFromAnyRank(LightningEnvironment):
    """A cluster environment that wrongly says it does not create the replicas on ranks other than the first."""

    @property
    def creates_processes_externally(self) -> bool:
        return False


def test_a_launch_from_another_local_rank_is_refused_as_lightning_refuses_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        strategy="heterogeneous",
        accelerator="cpu",
        devices=2,
        plugins=[_LaunchesFromAnyRank()],
        barebones=True,
    )
    with pytest.raises(
        RuntimeError, match="Lightning attempted to launch new distributed processes with `local_rank > 0`"
    ):
        trainer.fit(BoringModel())


def test_lightning_sees_its_own_launcher_class_and_can_kill_the_replicas(tmp_path) -> None:
    """Lightning checks `isinstance(launcher, _SubprocessScriptLauncher)` before `launcher.kill` (on Ctrl-C)."""
    import signal
    import subprocess
    import sys

    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_het.reliability.launch import ScriptLauncher

    trainer = pl.Trainer(
        default_root_dir=tmp_path, strategy="heterogeneous", accelerator="cpu", devices=2, logger=False
    )
    launcher = trainer.strategy.launcher
    assert type(launcher) is ScriptLauncher and isinstance(launcher, _SubprocessScriptLauncher)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher.procs.append(child)
    try:
        launcher.kill(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        launcher.procs.remove(child)
        if child.poll() is None:
            child.kill()
