"""Independent multi-process jobs of one test module, run side by side in a module fixture.

Jobs that mostly wait (for a hung replica's ``timeout``, a rendezvous, a sleeping step, a signal's grace) cost wall
time, not CPU: a module registers each as a named job with the tests that check it, its fixture runs those of the
selected tests (:meth:`SideBySide.run`, at most ``width`` at a time, in registration order) and each test then asserts
on what its job returned. A job that raised re-raises in the tests that use it, and in no other.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class Results:
    """What each job returned, by name; a job that raised re-raises when its result is read."""

    def __init__(self, outcomes: dict[str, Any]) -> None:
        self.outcomes = outcomes

    def __getitem__(self, name: str) -> Any:
        outcome = self.outcomes[name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class SideBySide:
    """The registry of a module's jobs (``width``: how many run at a time)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.jobs: dict[str, Callable[[Path], Any]] = {}
        self.users: dict[str, set[str]] = {}

    def add(self, name: str, run: Callable[[Path], Any], *tests: str) -> None:
        """Register ``run`` (called with a fresh directory) as job ``name``, needed by the tests named ``tests`` (test
        names as pytest gives them, parameters included; default: the test called ``name``)."""
        self.jobs[name] = run
        self.users[name] = set(tests or (name,))

    def job(self, name: str, *tests: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
        """:meth:`add` as a decorator."""

        def register(run: Callable[[Path], Any]) -> Callable[[Path], Any]:
            self.add(name, run, *tests)
            return run

        return register

    def run(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
        """Run the jobs that the selected tests of ``request``'s module need, side by side."""
        selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
        names = [name for name in self.jobs if self.users[name] & selected]
        with concurrent.futures.ThreadPoolExecutor(self.width) as pool:
            futures = {name: pool.submit(self.jobs[name], tmp_path_factory.mktemp("job")) for name in names}
            return Results({name: future.exception() or future.result() for name, future in futures.items()})
