"""Test controls of the stand-in (not in the real kvikio)."""

from __future__ import annotations

from typing import Any


class State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values: dict[str, Any] = {"num_threads": 1, "task_size": 4 << 20, "compat_mode": 2}
        self.compat_preferred = False
        self.gds = True
        self.direct_io = True
        self.max_io = 1 << 62
        self.fail: Exception | None = None  # raised by the next CuFile.pread/pwrite
        self.calls: list[tuple[str, int, int, int]] = []  # (op, thread, offset, size)
        self.opened: list[Any] = []
        if not hasattr(self, "imports"):
            self.imports: list[int] = []  # threads `import kvikio.defaults` ran on (kept by reset: one import per fixture)


state = State()
