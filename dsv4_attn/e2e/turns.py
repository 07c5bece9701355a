"""Turns for servers that share one GPU: all resident at once, one benchmark step at a time.

Each server is benchmarked by its own process (:mod:`dsv4_attn.e2e.bench_serve`). With every
server started together, their cold starts (compiles, graph capture) overlap, and their KV
caches are the same size when each is given the same ``--kv-cache-memory-bytes``. A step (the
greedy set, then each case) then runs on one server at a time, ordered step by step and, within
a step, server by server: no two benchmarks share the GPU, and a run cut short still has every
server's figures for the steps it reached.

The processes agree through files in one directory: ``<server>.up`` once a server answers,
``<step>.<server>`` once it has taken a step, ``<server>.finished`` once it takes no more (a
server that failed to start, or that is done). A server that finished early is skipped by the
others, so one crash does not stall the rest.
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["Turns"]


class Turns:
    """The turn order of ``servers`` (names, in turn order) through ``directory``.

    ``start_after``: a file whose existence the first step also waits for (another job on the
    same GPU that must end first). ``poll_s``: seconds between looks at the directory.
    """

    def __init__(
        self,
        directory: Path,
        servers: list[str],
        start_after: Path | None = None,
        poll_s: float = 2.0,
    ) -> None:
        if len(set(servers)) != len(servers) or not servers:
            raise ValueError(f"turn order needs distinct server names, got {servers!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.servers = list(servers)
        self.start_after = Path(start_after) if start_after else None
        self.poll_s = poll_s

    def _mark(self, name: str) -> None:
        (self.directory / name).touch()

    def _marked(self, name: str) -> bool:
        return (self.directory / name).exists()

    def _check(self, server: str) -> None:
        if server not in self.servers:
            raise ValueError(f"server {server!r} is not in the turn order {self.servers}")

    def up(self, server: str) -> None:
        """``server`` answers requests."""
        self._check(server)
        self._mark(f"{server}.up")

    def finished(self, server: str) -> None:
        """``server`` takes no more steps (done, or it failed): the others stop waiting on it."""
        self._check(server)
        self._mark(f"{server}.finished")

    def done(self, step: str, server: str) -> None:
        """``server`` has taken ``step``."""
        self._check(server)
        self._mark(f"{step}.{server}")

    def _settled(self, server: str) -> bool:
        return self._marked(f"{server}.up") or self._marked(f"{server}.finished")

    def _waiting(self, timeout_s: float, what: str, ready) -> float:
        start = time.monotonic()
        while not ready():
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for {what} (turn files in {self.directory})"
                )
            time.sleep(self.poll_s)
        return time.monotonic() - start

    def _all_up(self) -> bool:
        return all(self._settled(name) for name in self.servers) and (
            self.start_after is None or self.start_after.exists()
        )

    def wait_up(self, timeout_s: float) -> float:
        """Block until every server is up (or finished) and ``start_after`` exists. Returns
        the seconds waited; raises ``TimeoutError`` after ``timeout_s``."""
        return self._waiting(timeout_s, "every server to answer", self._all_up)

    def wait(self, steps: list[str], step: str, server: str, timeout_s: float) -> float:
        """Block until it is ``server``'s turn at ``step`` (one of ``steps``, the step order
        every process shares): every server is up (or finished), ``start_after`` exists, and
        every earlier (step, server) pair is done or its server finished. Returns the seconds
        waited; raises ``TimeoutError`` after ``timeout_s``."""
        self._check(server)
        if step not in steps:
            raise ValueError(f"step {step!r} is not one of {steps}")
        width = len(self.servers)
        position = steps.index(step) * width + self.servers.index(server)
        earlier = [(steps[k // width], self.servers[k % width]) for k in range(position)]

        def ready() -> bool:
            return self._all_up() and all(
                self._marked(f"{s}.{name}") or self._marked(f"{name}.finished")
                for s, name in earlier
            )

        return self._waiting(timeout_s, f"{server}'s turn at {step!r}", ready)
