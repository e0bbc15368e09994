"""``kvikio.cufile_driver``: ``get`` of the driver's properties."""

from __future__ import annotations

from typing import Any

from kvikio._fake import state


def get(config_name: str) -> Any:
    props = {"is_gds_available": state.gds, "major_version": 1, "minor_version": 14, "allow_compat_mode": True}
    if config_name not in props:
        raise KeyError(config_name)
    return props[config_name]
