"""Model families described in one file each: what their HF config.json and checkpoint tensors mean in
keel's one model (config translation, defaults, name layout), with no model code of their own.

A family module defines `FAMILY` (keel's name), `HF_ARCHITECTURE` (transformers' class name),
`DEFAULTS` (transformers' config defaults for fields a config.json may omit), `config_fields(hf,
source)` (keel ModelConfig fields read from config.json beyond the common ones), `hf_fields(config)`
(the family's own config.json keys on export) and, where its checkpoints fuse tensors that keel keeps
apart, `fused_rows(config)` (docs/ARCHITECTURE.md, "Adding a family"). This package imports nothing
of keel's but its errors, so that keel.config can read it.
"""

from __future__ import annotations

from types import ModuleType

from keel.families import phi3

FAMILIES: dict[str, ModuleType] = {module.FAMILY: module for module in (phi3,)}
# Families whose checkpoints store some of keel's projections fused in one tensor (split at load).
FUSED_CHECKPOINT_FAMILIES = {family for family, module in FAMILIES.items() if hasattr(module, "fused_rows")}
