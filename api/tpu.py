"""The TPU catalogue: every slice shape GKE offers, and what a job's TPU request means in VMs and chips.

One row per (accelerator, topology, machine type). A few topologies run on two VM shapes (v5e/v6e `2x4`:
one 8-chip VM or two 4-chip VMs); `resolve` picks one, and the cluster's node pools must match it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The node label GKE puts on each generation's TPU nodes (`cloud.google.com/gke-tpu-accelerator`).
GKE_ACCELERATOR = {"v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice", "v6e": "tpu-v6e-slice"}


@dataclass(frozen=True)
class SliceShape:
    accelerator: str
    topology: str
    machine_type: str
    chips_per_vm: int
    vms: int

    @property
    def chips(self) -> int:
        return self.chips_per_vm * self.vms

    @property
    def gke_accelerator(self) -> str:
        return GKE_ACCELERATOR[self.accelerator]

    @property
    def multi_host(self) -> bool:
        return self.vms > 1


def _shape(accelerator: str, topology: str, machine_type: str, chips_per_vm: int, vms: int) -> SliceShape:
    return SliceShape(accelerator, topology, machine_type, chips_per_vm, vms)


CATALOGUE: tuple[SliceShape, ...] = (
    # accelerator, topology, machine type, chips per VM, VMs per slice
    _shape("v5e", "1x1", "ct5lp-hightpu-1t", 1, 1),
    _shape("v5e", "2x2", "ct5lp-hightpu-4t", 4, 1),
    _shape("v5e", "2x4", "ct5lp-hightpu-8t", 8, 1),
    _shape("v5e", "2x4", "ct5lp-hightpu-4t", 4, 2),
    _shape("v5e", "4x4", "ct5lp-hightpu-4t", 4, 4),
    _shape("v5e", "4x8", "ct5lp-hightpu-4t", 4, 8),
    _shape("v5e", "8x8", "ct5lp-hightpu-4t", 4, 16),
    _shape("v5e", "8x16", "ct5lp-hightpu-4t", 4, 32),
    _shape("v5e", "16x16", "ct5lp-hightpu-4t", 4, 64),
    _shape("v5p", "2x2x1", "ct5p-hightpu-4t", 4, 1),
    _shape("v5p", "2x2x2", "ct5p-hightpu-4t", 4, 2),
    _shape("v5p", "2x2x4", "ct5p-hightpu-4t", 4, 4),
    _shape("v5p", "2x4x4", "ct5p-hightpu-4t", 4, 8),
    _shape("v5p", "4x4x4", "ct5p-hightpu-4t", 4, 16),
    _shape("v5p", "4x4x8", "ct5p-hightpu-4t", 4, 32),
    _shape("v5p", "4x8x8", "ct5p-hightpu-4t", 4, 64),
    _shape("v5p", "8x8x8", "ct5p-hightpu-4t", 4, 128),
    _shape("v5p", "8x8x16", "ct5p-hightpu-4t", 4, 256),
    _shape("v5p", "8x16x16", "ct5p-hightpu-4t", 4, 512),
    _shape("v5p", "16x16x16", "ct5p-hightpu-4t", 4, 1024),
    _shape("v6e", "1x1", "ct6e-standard-1t", 1, 1),
    _shape("v6e", "2x2", "ct6e-standard-4t", 4, 1),
    _shape("v6e", "2x4", "ct6e-standard-8t", 8, 1),
    _shape("v6e", "2x4", "ct6e-standard-4t", 4, 2),
    _shape("v6e", "4x4", "ct6e-standard-4t", 4, 4),
    _shape("v6e", "4x8", "ct6e-standard-4t", 4, 8),
    _shape("v6e", "8x8", "ct6e-standard-4t", 4, 16),
    _shape("v6e", "8x16", "ct6e-standard-4t", 4, 32),
    _shape("v6e", "16x16", "ct6e-standard-4t", 4, 64),
)


def topology_chips(topology: str) -> int:
    return math.prod(int(side) for side in topology.split("x"))


def topologies(accelerator: str) -> list[str]:
    """The topologies an accelerator offers, smallest first."""
    seen = dict.fromkeys(s.topology for s in CATALOGUE if s.accelerator == accelerator)
    return sorted(seen, key=topology_chips)


class TpuShapeError(ValueError):
    """A TPU request that can never schedule; `code` is stable, `message` says what would."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class TpuRequest:
    """A job's TPUs: `slices` copies of one slice shape."""

    shape: SliceShape
    slices: int

    @property
    def processes(self) -> int:
        """JAX processes of the job: one per VM (pod) of every slice."""
        return self.shape.vms * self.slices

    @property
    def devices(self) -> int:
        return self.shape.chips * self.slices


def resolve(
    accelerator: str | None, topology: str | None, slices: int = 1, machine_types: tuple[str, ...] = ()
) -> TpuRequest:
    """The shape a job runs on. Several slices need a multi-host shape (multislice runs only on those).
    Where a topology still runs on more than one VM shape, a machine type listed in `machine_types` (the
    cluster's node pools) wins, else the fewest VMs."""
    if accelerator is None:
        raise TpuShapeError(
            "accelerator_required",
            f"resources.accelerator is required on this server: one of {', '.join(GKE_ACCELERATOR)}, "
            'with a topology, e.g. {"accelerator": "v6e", "topology": "2x4"}.',
            "resources.accelerator",
        )
    if accelerator not in GKE_ACCELERATOR:
        raise TpuShapeError(
            "unknown_accelerator",
            f"resources.accelerator '{accelerator}' is not offered; use one of {', '.join(GKE_ACCELERATOR)}.",
            "resources.accelerator",
        )
    offered = topologies(accelerator)
    if topology is None or topology not in offered:
        given = "is required" if topology is None else f"'{topology}' is not offered for {accelerator}"
        raise TpuShapeError(
            "topology_required" if topology is None else "unknown_topology",
            f"resources.topology {given}; {accelerator} offers {', '.join(offered)}.",
            "resources.topology",
        )
    candidates = [s for s in CATALOGUE if s.accelerator == accelerator and s.topology == topology]
    pool = [s for s in candidates if s.multi_host] if slices > 1 else candidates
    if not pool:
        multi = [s.topology for s in CATALOGUE if s.accelerator == accelerator and s.multi_host]
        raise TpuShapeError(
            "multislice_needs_multi_host",
            f"{accelerator} {topology} runs on one VM, and several slices need multi-host slices; use "
            f"slices=1 or a multi-host topology ({', '.join(dict.fromkeys(multi))}).",
            "resources.slices",
        )
    preferred = [s for s in pool if s.machine_type in machine_types]
    shape = preferred[0] if preferred else min(pool, key=lambda s: s.vms)
    return TpuRequest(shape, slices)


def chips_of(resources: Any, executor: str) -> int:
    """What a job with these `resources` (a worker.config.Resources) holds while it runs: its TPU chips
    (every slice) on Kubernetes, its processes (each stands in for a TPU VM) on the local executor; 0 for
    a TPU shape not offered (a job stored before the catalogue changed: nothing here can tell)."""
    if executor != "kubernetes":
        return int(resources.processes or 1)
    try:
        return resolve(resources.accelerator, resources.topology, resources.slices).devices
    except TpuShapeError:
        return 0


def chip_unit(executor: str) -> str:
    """What `chips_of` counts on an executor: TPU chips, or (the local executor) processes."""
    return "TPU chips" if executor == "kubernetes" else "processes"
