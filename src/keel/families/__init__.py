"""Model families described in one file each: what their HF config.json and checkpoint tensors mean in
keel's one model (config translation, defaults, name layout), with no model code of their own.

A family module defines `FAMILY` (keel's name), `HF_ARCHITECTURE` (transformers' class name), `DEFAULTS` (transformers'
config defaults for fields a config.json may omit), `config_fields(hf, source)` (keel ModelConfig fields read from
config.json beyond the common ones), `hf_fields(config, hf)` (the family's own config.json keys on export, given the
common ones) and, where its checkpoints name or fuse tensors otherwise than keel reads them, `checkpoint_layout(config)`
(keel.weights.parts; docs/ARCHITECTURE.md, "Adding a family"); where its config class sets whole rope parameters when a
file has none, `DEFAULT_ROPE` (those parameters); where its model puts a factor of its own on cos/sin in place of the
rope type's, `rope_attention_factor(rope_type, spec, source)` (Phi-3.5-MoE's mscale); where its releases omit tensors
that transformers leaves at zero, `ZERO_WHEN_ABSENT` (their keel names' endings, read as zeros when absent). A family
that transformers runs on another family's model class (EXAONE 3 on Llama's) defines `MODEL_TYPE`: transformers saves
such a model's config with the class it ran on in `architectures`, so the family is known by its `model_type` first.
Where its config class reads keys under other names (its `attribute_map`), `ATTRIBUTE_MAP` (alias -> the key keel
reads); where it rewrites an older format of its files, `upgrade_config(hf)` (the file in today's format: Sarvam MLA's);
where its config class computes a key keel writes for others (Falcon's head_dim, a property), `COMPUTED_KEYS` (left out
on export). This package imports nothing of keel's but its errors, so that keel.config can read it.
"""

from __future__ import annotations

from types import ModuleType

from keel.families import (
    afmoe,
    apertus,
    apertus1p5,
    arcee,
    axk1,
    axk2,
    bailing_hybrid,
    bamba,
    biogpt,
    bitnet,
    bloom,
    codegen,
    cohere,
    cohere2,
    cohere2_moe,
    cwm,
    dbrx,
    deepseek_v32,
    dots1,
    ernie4_5,
    ernie4_5_moe,
    exaone,
    exaone4,
    exaone_moe,
    falcon,
    falcon_h1,
    falcon_mamba,
    flex_olmo,
    flint,
    gemma,
    gemma2,
    gemma3,
    gemma3n,
    gemma4,
    gemma4_unified,
    glm,
    glm4,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    gpt2,
    gpt_bigcode,
    gpt_neo,
    gpt_neox,
    gpt_neox_japanese,
    gpt_oss,
    gptj,
    granite_swa,
    granitemoe,
    granitemoe_swa,
    granitemoehybrid,
    granitemoeshared,
    helium,
    hunyuan_v1_dense,
    hunyuan_v1_moe,
    hy_v3,
    hyperclovax,
    internlm3,
    iquestcoder,
    jais2,
    jamba,
    jetmoe,
    kimi_linear,
    kolibri1,
    laguna,
    lfm2,
    lfm2_moe,
    lfm3,
    llama4,
    mamba,
    mamba2,
    mellum,
    mimo_v2_flash,
    minicpm3,
    minimax,
    minimax_m2,
    ministral,
    ministral3,
    mistral4,
    mpt,
    nanochat,
    nemotron,
    nemotron_h,
    olmo,
    olmo2,
    olmo3,
    olmo_hybrid,
    olmoe,
    opt,
    persimmon,
    phi,
    phi3,
    phimoe,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    recurrent_gemma,
    sarvam_mla,
    sarvam_moe,
    seed_oss,
    smollm3,
    solar_open,
    stablelm,
    starcoder2,
    vaultgemma,
    xglm,
    youtu,
    zamba2,
)

FAMILIES: dict[str, ModuleType] = {
    module.FAMILY: module
    for module in (
        nemotron_h,
        falcon_h1,
        bamba,
        granitemoehybrid,
        mamba2,
        mamba,
        falcon_mamba,
        jamba,
        lfm2_moe,
        lfm2,
        qwen3_5_moe,
        qwen3_next,
        qwen3_5,
        apertus,
        apertus1p5,
        youtu,
        hyperclovax,
        vaultgemma,
        nemotron,
        jais2,
        helium,
        cwm,
        glm,
        phi3,
        phi,
        stablelm,
        gpt_neox,
        gpt_neox_japanese,
        persimmon,
        olmo2,
        olmo3,
        olmo_hybrid,
        gemma4_unified,
        gemma4,
        gemma3n,
        gemma3,
        gemma2,
        gemma,
        smollm3,
        exaone4,
        exaone_moe,
        starcoder2,
        glm4,
        ministral,
        ministral3,
        mistral4,
        cohere,
        cohere2,
        cohere2_moe,
        seed_oss,
        ernie4_5,
        arcee,
        olmoe,
        gpt_oss,
        glm4_moe,
        glm4_moe_lite,
        granitemoe,
        granitemoeshared,
        dbrx,
        granite_swa,
        granitemoe_swa,
        hunyuan_v1_dense,
        hunyuan_v1_moe,
        phimoe,
        kolibri1,
        llama4,
        minimax,
        minimax_m2,
        dots1,
        solar_open,
        ernie4_5_moe,
        olmo,
        nanochat,
        flex_olmo,
        exaone,
        iquestcoder,
        sarvam_moe,
        sarvam_mla,
        internlm3,
        mellum,
        hy_v3,
        minicpm3,
        afmoe,
        gpt_bigcode,
        gpt2,
        falcon,
        gptj,
        codegen,
        opt,
        gpt_neo,
        bloom,
        mpt,
        flint,
        lfm3,
        axk1,
        axk2,
        laguna,
        xglm,
        biogpt,
        mimo_v2_flash,
        bitnet,
        kimi_linear,
        recurrent_gemma,
        zamba2,
        deepseek_v32,
        glm_moe_dsa,
        jetmoe,
        bailing_hybrid,
    )
}


# model_type -> family, for the families known by their model_type first (`MODEL_TYPE`, the module docstring).
BY_MODEL_TYPE: dict[str, str] = {
    module.MODEL_TYPE: family for family, module in FAMILIES.items() if hasattr(module, "MODEL_TYPE")
}


def as_current_config(family: str, hf: dict) -> dict:
    """`hf` as the family's config class reads it: its aliased keys (`ATTRIBUTE_MAP`) also under the names keel reads
    where those are absent, an older format rewritten (`upgrade_config`)."""
    module = FAMILIES.get(family)
    aliases = getattr(module, "ATTRIBUTE_MAP", {})
    hf = {**{key: hf[alias] for alias, key in aliases.items() if alias in hf and key not in hf}, **hf}
    return module.upgrade_config(hf) if hasattr(module, "upgrade_config") else hf


def checkpoint_layout(config) -> dict:  # noqa: ANN001
    """The family's stored tensors that keel reads under other names or in parts (keel.weights.parts), or {}."""
    family = FAMILIES.get(config.architecture)
    return family.checkpoint_layout(config) if family is not None and hasattr(family, "checkpoint_layout") else {}


def stored_tensor(config, name: str, tensor):  # noqa: ANN001, ANN201
    """`tensor`, written under HF name `name`, as the family's checkpoints store it (ERNIE 4.5 MoE keeps its
    selection bias [1, E]); as it is for the other families."""
    family = FAMILIES.get(config.architecture)
    return family.stored_tensor(name, tensor) if family is not None and hasattr(family, "stored_tensor") else tensor


def zero_when_absent(config, name: str) -> bool:  # noqa: ANN001
    """Whether keel tensor `name` may be absent from the family's checkpoints, read as zeros then (`ZERO_WHEN_ABSENT`:
    name endings; A.X-K1's releases route without the selection bias that transformers leaves at zero)."""
    family = FAMILIES.get(config.architecture)
    return name.endswith(tuple(getattr(family, "ZERO_WHEN_ABSENT", ())))


def stored_names(config) -> dict[str, str] | None:  # noqa: ANN001
    """{the name keel reads: the name the family's checkpoints store it under} where they only rename tensors
    (OLMo 2, the Gemmas; {} where they store keel's names), None where some are fused or split by rows
    (Phi-3, GPT-NeoX): a tensor-parallel rank's shard of one part is no shard of the stored tensor."""
    names = {}
    for stored, parts in checkpoint_layout(config).items():
        if len(parts) != 1 or next(iter(parts.values())) is not None:
            return None
        names[next(iter(parts))] = stored
    return names
