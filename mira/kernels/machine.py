"""Measured figures of a machine (memory and PCIe bandwidth), stored as data per device.

`machines/<device>.json` beside this file (device: the GPU's name, as kernel tuning names it) holds
each figure with where it was measured. The bound on decode time (mira.bench.bound) and the
simulator's PCIe time (mira.bench.simulate) read them; a device with no file gets the reference
machine's, the one the project measures on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mira.kernels.tuning import device_key

MACHINES_DIR = Path(__file__).resolve().parent / "machines"
REFERENCE = "NVIDIA H200"


@dataclass(frozen=True)
class Machine:
    """hbm_bytes_per_s: device memory bandwidth; pcie_bytes_per_s: pinned host-to-device copies."""

    hbm_bytes_per_s: float
    pcie_bytes_per_s: float


def machine(device_name: str = REFERENCE, directory: Path = MACHINES_DIR) -> Machine:
    """The stored figures of `device_name`, or of the reference machine when it has none.

    Raises:
        ValueError: the file exists but does not hold the figures (fix it or delete it).
    """
    path = directory / f"{device_key(device_name)}.json"
    if not path.exists():
        path = directory / f"{device_key(REFERENCE)}.json"
    try:
        data = json.loads(path.read_text())
        return Machine(float(data["hbm_bytes_per_s"]), float(data["pcie_bytes_per_s"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} does not hold a machine's figures ({error}); fix or delete it") from error
