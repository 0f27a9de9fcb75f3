"""Falcon Mamba (`FalconMambaForCausalLM`: tiiuae/falcon-mamba-7b): Mamba's model (keel.families.mamba), its mixers
RMS-normalising the step, B and C after `x_proj` without weights (`mamba_dt_bc_norm` "weightless", eps
`mixer_rms_eps`); the same checkpoint names.
"""

from __future__ import annotations

from typing import Any

from keel.families import mamba

FAMILY = "falcon_mamba"
HF_ARCHITECTURE = "FalconMambaForCausalLM"
# transformers' FalconMambaConfig defaults (Mamba's).
DEFAULTS: dict[str, Any] = dict(mamba.DEFAULTS)
MIXER_RMS_EPS = 1e-6


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    eps = hf.get("mixer_rms_eps")
    return {
        **mamba.config_fields(hf, source),
        "mamba_dt_bc_norm": "weightless",
        "mamba_dt_bc_norm_eps": float(MIXER_RMS_EPS if eps is None else eps),
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**mamba.hf_fields(config, hf), "mixer_rms_eps": config.mamba_dt_bc_norm_eps}


checkpoint_layout = mamba.checkpoint_layout
