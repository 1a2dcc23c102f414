"""Checkpoints and the final export, on a local directory or `gs://` (orbax handles both).

A checkpoint at step k holds the train state after k optimizer steps (`{"step", "params", "opt_state"}`,
with LoRA only the adapter's params) and the data position (`TrainData.position(k)` plus run totals), so
a restarted run resumes with batch k. The frozen base weights are not in it: they are reloaded.

    {output_uri}/checkpoints/<step>/{state,data}
    {output_uri}/final/params      full weights (full fine-tune, or LoRA merged on request)
    {output_uri}/final/adapter     LoRA params only
    {output_uri}/final/export.json what the export holds and how it was made
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


@dataclasses.dataclass
class _KeepSteps:
    """An orbax preservation policy: keep the checkpoints of `steps`."""

    steps: set[int]

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        return [info.step in self.steps for info in checkpoints]


class Checkpoints:
    """The run's checkpoints under `{output_uri}/checkpoints`, keeping the last `keep` and the one `kept`
    (export_best's: the lowest eval loss's).

    Which go is decided as each save starts and done once it is written: a checkpoint's data position names
    the step `kept` was when it was saved, and that step's checkpoint stays until a later one is written."""

    def __init__(self, output_uri: str, keep: int) -> None:
        self.directory = join(output_uri, "checkpoints")
        self._kept = _KeepSteps(set())
        policies = ocp.checkpoint_managers
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                create=True,
                preservation_policy=policies.AnyPreservationPolicy([policies.LatestN(keep), self._kept]),
            ),
            item_names=("state", "data"),
        )

    def keep(self, step: int | None) -> None:
        """Keep the checkpoint of `step` (None: none) past the last `keep`, from the next save on."""
        self._kept.steps = set() if step is None else {step}

    def uri(self, step: int) -> str:
        return join(self.directory, str(step))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The steps of the checkpoints kept (those past the last `keep` go as soon as a save starts)."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_position: dict[str, Any]) -> None:
        """Start saving; returns once the arrays are copied off the device (the write goes on behind)."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)
            ),
            force=True,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """The state at `step`, placed with the shardings of `abstract_state`, and its data position."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return restored.state, dict(restored.data)

    def wait(self) -> None:
        """Wait for writes in flight (and the removals after them)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for writes in flight, then release the manager."""
        self.wait()
        self.manager.close()


def export_params(params: Any, uri: str) -> None:
    """Save a params tree as a standalone orbax checkpoint (`gm.ckpts.load_params` reads it back)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(epath.Path(uri), params, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()


def write_json(uri: str, value: dict[str, Any]) -> None:
    path = epath.Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")
