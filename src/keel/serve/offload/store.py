"""Cold storage: where the experts that are not resident live, and how one is copied into a slot.

- HostExpertStore: the stacked expert weights in host memory, in the model's dtype; pinned when the
  model is on a GPU, so a copy into a device slot is asynchronous (non_blocking) DMA.
- DiskExpertStore: nothing in memory; an expert is read from the safetensors checkpoint when it is
  loaded (safe_open memory-maps the file, so the OS page cache is the only host copy). Reads the
  per-expert hub layout (`experts.{e}.gate_proj.weight`, ...; Mixtral's w1/w3/w2) and the stacked
  transformers-5 layout (`experts.gate_up_proj`, one row per expert), by the names in
  keel.weights.names.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.weights.names import hf_source


class ExpertStore(Protocol):
    where: str  # for the log line

    def copy_into(self, layer: int, expert: int, gate_up: Tensor, down: Tensor) -> None:
        """Copy one expert's weights into a slot's views gate_up [2I, H] and down [H, I]."""
        ...


class HostExpertStore:
    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.where = "pinned host memory" if pin else "host memory"
        self.weights: dict[int, tuple[Tensor, Tensor]] = {}

    def add_layer(self, layer: int, gate_up: Tensor, down: Tensor) -> None:
        """Keep a layer's stacked weights [E, ...]. On CPU this is the model's own storage (no copy);
        from a GPU, one pinned host copy."""
        self.weights[layer] = (self._host(gate_up), self._host(down))

    def _host(self, weight: Tensor) -> Tensor:
        weight = weight.detach()
        if weight.device.type == "cpu" and not self.pin:
            return weight
        host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=self.pin)
        return host.copy_(weight)

    def copy_into(self, layer: int, expert: int, gate_up: Tensor, down: Tensor) -> None:
        src_gate_up, src_down = self.weights[layer]
        gate_up.copy_(src_gate_up[expert], non_blocking=self.pin)
        down.copy_(src_down[expert], non_blocking=self.pin)


class DiskExpertStore:
    def __init__(self, reader: object, config: ModelConfig, layers: list[int]) -> None:
        from keel.weights.safetensors import SafetensorsReader

        if not isinstance(reader, SafetensorsReader):
            raise KeelError("--expert-storage disk needs a safetensors checkpoint (an HF directory)")
        self.reader = reader
        self.where = f"{reader.directory} (memory-mapped safetensors)"
        available = reader.names()
        self.sources = {}
        for layer in layers:
            gate_up = hf_source(config, f"layers.{layer}.mlp.experts.gate_up_proj", available)
            down = hf_source(config, f"layers.{layer}.mlp.experts.down_proj", available)
            missing = [n for n in (*gate_up.names, *down.names) if n not in available]
            if missing:
                raise KeelError(f"{reader.directory}: expert tensor {missing[0]!r} is missing")
            self.sources[layer] = (gate_up.names, down.names)

    def copy_into(self, layer: int, expert: int, gate_up: Tensor, down: Tensor) -> None:
        gate_up_names, down_names = self.sources[layer]
        read = self.reader
        if len(gate_up_names) == 1:  # stacked [E, 2I, H]
            gate_up.copy_(read.get_row(gate_up_names[0], expert))
        else:  # per expert: gate then up (up alone: ungated experts), stacked on rows as keel's gate_up_proj
            per_expert, row = len(gate_up_names) // len(down_names), 0
            for name in gate_up_names[per_expert * expert : per_expert * (expert + 1)]:
                part = read.get(name)
                gate_up[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
        down.copy_(read.get_row(down_names[0], expert) if len(down_names) == 1 else read.get(down_names[expert]))
