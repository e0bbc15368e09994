"""``kvikio.defaults`` (25.04+ API): ``get``, ``set``, ``is_compat_mode_preferred``."""

from __future__ import annotations

import threading
from typing import Any

from kvikio._fake import state

state.imports.append(threading.get_ident())  # a test control: where and how often kvikio is set up

_NAMES = {"compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size"}


def set(*config: Any) -> None:
    if len(config) == 1 and isinstance(config[0], dict):
        items = config[0]
    elif len(config) == 2 and isinstance(config[0], str):
        items = {config[0]: config[1]}
    else:
        raise ValueError("Valid arguments are kvikio.defaults.set(config: dict) or kvikio.defaults.set(key: str, value: Any)")
    for k, v in items.items():
        if k not in _NAMES:
            raise KeyError(k)
        state.values[k] = v


def get(config_name: str) -> Any:
    if config_name not in _NAMES:
        raise KeyError(config_name)
    return state.values[config_name]


def is_compat_mode_preferred() -> bool:
    return state.compat_preferred
