"""GGUF checkpoints (llama.cpp's format): config from metadata, HF-named tensors, tokenizer.

A GGUF file carries everything in one place: the hyper-parameters as `<arch>.*` metadata keys, the
vocabulary as `tokenizer.ggml.*` keys, and the tensors under llama.cpp names (`blk.N.attn_q.weight`)
with shapes in ggml order (innermost dimension first). `open_gguf` turns that into the same
`Checkpoint` the safetensors path builds: a `ModelConfig`, a reader that serves tensors under HF
names in HF layout (dequantized lazily with `gguf.quants.dequantize`), and a `tokenizers` tokenizer.
Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 tensors are also served as integer codes and group scales
(`get_blocks`, keel.weights.gguf_blocks), which `--quantize gguf` (keel.quant.on_load) repacks for
the integer kernels without a float copy; the other block types load as float.

Nothing of llama.cpp's naming is retyped here: the metadata keys are gguf's `Keys` constants, the
architecture names `MODEL_ARCH_NAMES`, and the tensor names come from gguf's `TensorNameMap` run
forward over the HF names a checkpoint of the config holds (as llama.cpp's convert_hf_to_gguf.py
names them), so that a llama.cpp tensor is read as the HF tensor it was converted from; a family
that stores fused or renamed tensors (keel.families) then splits or renames them as for safetensors.

Supported: architectures llama (and llama with experts, i.e. Mixtral), qwen2, qwen3, qwen2moe, qwen3moe, qwen2vl,
qwen3vl, qwen3vlmoe (the text models of Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE), granite,
granitemoe (with a shared expert or not), phi2, phi3, olmo2, gemma, gemma2, gemma3, gemma3n, gemma4, stablelm, gptneox,
smollm3, starcoder2, exaone4, command-r, cohere2, gpt-oss, chatglm, glm4, glm4moe, dots1, ernie4_5, ernie4_5-moe,
llama4, deepseek2 (DeepSeek-V2 / V3), lfm2, lfm2moe, qwen35, qwen35moe, qwen3next, granitehybrid, falcon-h1, olmoe,
olmo, phimoe, seed_oss, arcee, apertus, nemotron, minimax-m2, mistral3 (Ministral 3), exaone (EXAONE 3.0 / 3.5),
minicpm3, hunyuan-dense, hunyuan-moe, exaone-moe (K-EXAONE), jais2, mamba, mamba2, nemotron_h, nemotron_h_moe, starcoder
(GPT-BigCode), gpt2, falcon, jamba, dbrx, bloom, mpt, gptj, afmoe, mimo2 (MiMo-V2-Flash), bitnet (BitNet b1.58),
kimi-linear, glm-dsa (GLM-5), internlm2 (read as llama) and minicpm (read as granite) (others are refused by name;
DeepSeek-V3.2 has no architecture gguf 0.19 names);
tensor types F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL MXFP4 TQ1_0 TQ2_0 (others, e.g.
IQ2_XXS, are a one-line error naming these); byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`), SentencePiece ones (`"llama"`: Llama 2, Mistral v0.1, TinyLlama, Phi-3) and
Gemma 4's (`"gemma4"`), tokenized as llama.cpp does (keel.weights.gguf_tokenizer).

Conventions of llama.cpp's converter (convert_hf_to_gguf.py, which the gguf package does not ship;
these are assumptions about it, shared by transformers' GGUF loader where it reads the architecture):
q/k rows (and biases) are permuted for the llama architecture and its subclasses granite, granitemoe and smollm3 only;
Granite MoE's experts are split into gate and up (`ffn_gate_exps`, `ffn_up_exps`) and stacked again at load; Phi-3
keeps q/k/v fused in `attn_qkv` and gate/up in `ffn_up` (gate rows first); OLMo 2's output norms are
`post_attention_norm` and `post_ffw_norm`; Granite's four multipliers are `embedding_scale`,
`residual_scale`, `attention.scale` and `logit_scale`, each written only when config.json has it
(absent, transformers' default 1.0 is taken). Phi-3's `attention.sliding_window` (0: none) applies
to every layer, as transformers applies the HF config's; a Phi-3 with longrope factors is refused.

Gemma, Gemma 2 and 3: the converter adds 1 to every `*norm.weight` (llama.cpp's RMSNorm has no 1 + w), which is
taken off on load; the embedding is stored unscaled (keel scales it by sqrt(hidden) as transformers does)
and the head is tied (no `output.weight`). No key holds query_pre_attn_scalar: the softmax scale is
llama.cpp's, (hidden / heads)^-1/2 for the 27B models (46 layers for Gemma 2, 62 for Gemma 3) and
key_length^-1/2 otherwise, which is query_pre_attn_scalar^-1/2 for every released Gemma 2/3. Gemma 2:
`attn_logit_softcapping` and `final_logit_softcapping` (absent: llama.cpp's 50 and 30), the window
`attention.sliding_window` (absent: 4096) on even layers, one RoPE base (the converter writes none:
llama.cpp's 10000). Gemma 3: `final_logit_softcapping` where written (else none), five sliding layers in
six (`attention.sliding_window_pattern` where a file has it; absent or 0 `attention.sliding_window`:
every layer global), the global layers' RoPE in `rope.freq_base` and its linear scaling, the sliding
layers' base in `rope.freq_base_swa` (absent: llama.cpp's hard-coded 10000, unscaled), and the vocabulary
from the embedding's rows (the converter drops rows past the tokenizer's). StableLM and GPT-NeoX:
LayerNorms with biases (eps `attention.layer_norm_epsilon`), rotary over the first `rope.dimension_count`
channels of each head (the head size is hidden / heads); StableLM's parallel residual is read from the
tensors, as llama.cpp and transformers do (no `ffn_norm`: parallel), and StableLM 2 12B's LayerNorms per head from
`attn_q_norm` / `attn_k_norm` (the converter stacks them as keel does: [head_dim, heads] in ggml order); GPT-NeoX's from
`use_parallel_residual`. GPT-NeoX's converter regroups HF's per-head interleaved query_key_value into
`attn_qkv` rows [all q; all k; all v], split here by rows; its MLP is transformers' erf GELU (the file
names no activation; llama.cpp runs ggml's tanh-approximated GELU).

Gemma 3n (`gemma3n`; Gemma3NModel on Gemma3Model): norms stored as HF's (no shift: they scale by w), the embedding
and the per-layer table (`per_layer_token_embd`) padded with zero rows to the vocabulary (the table's rows are keel's
per-layer vocabulary: ids past HF's shorter table read zeros, as llama.cpp runs them), AltUp's projections stacked
(`altup_proj`, `altup_unembd_proj`: [copies - 1, H, H], split here), its copies, active copy and the per-layer width
as keys, the KV-sharing layers as `attention.shared_kv_layers`, each layer's sparsity as its normal quantile
(`activation_sparsity_scale`, its CDF taken back), the pattern as a list, the sliding layers' RoPE base as
`rope.freq_base_swa` (absent: 10000); LAuReL's rank and AltUp's output scale by tensor. (llama.cpp itself fixes the KV
layers at the first 20 and the sparse ones at the first ten, the releases' values, which the converter's keys also
say; keel reads the keys.)
Gemma 4 (`gemma4`; Gemma4Model on Gemma3Model): norms as HF's, the sliding layers' head width as
`attention.key_length_swa` and the full-attention layers' as `attention.key_length`, the KV heads per layer
(`head_count_kv` a list: the full-attention layers' own count, with values equal to the keys' projection, which a
full-attention layer without `attn_v` has), the pattern as a list, the MLP widths per layer (the KV-sharing layers'
twice as wide: use_double_wide_mlp; other differences refused), the full-attention layers' proportional RoPE as
`rope_freqs` (1 for each turning frequency, 1e30 for the rest), the sliding layers' base as `rope.freq_base_swa` over
the whole head (a partial `rope.dimension_count_swa` refused), the final cap (absent: llama.cpp's 30),
`layer_output_scale` (HF's layer_scalar), the per-layer inputs and KV sharing as Gemma 3n's (the table unpadded), and
the MoE model's experts stacked as HF's (`ffn_gate_up_exps`, or gate and up apart, and `ffn_down_exps`), the router's
scale as `ffn_gate_inp.scale`, per_expert_scale as `ffn_down_exps.scale`, its counts and width as keys.

ChatGLM (`chatglm`; ChatGLMModel, for ChatGLM2/3, GLM-4-9B(-chat) and transformers' GlmForCausalLM alike) is read as
keel's `glm` (transformers' GLM, the same computation): RMS norms, biased q/k/v, gate and up fused in `ffn_up` (gate
rows first), rotary over `rope.dimension_count` channels of each head (the converter writes half of hidden / heads; no
key_length: the head size is hidden / heads) on interleaved pairs (llama.cpp's NORM rope), the base 10000 x rope_ratio
(a GlmForCausalLM's rope_theta and rms_norm_eps are not read by the converter: the file's 10000 and eps are what
llama.cpp runs, and keel reads them). ChatGLM's own checkpoints keep q/k/v fused (`attn_qkv`, rows [all q; all k; all
v]: split here), GlmForCausalLM's apart; ChatGLM2/3's multi-query groups are the KV head count. Output or MLP biases
and a separate `ffn_gate` (none of which llama.cpp loads) are refused by name.

EXAONE 4: q/k norms per head and output norms (`post_attention_norm`, `post_ffw_norm`), the window in
`attention.sliding_window` and the sliding layers in `attention.sliding_window_pattern` (a list), the global
layers without position encoding; llama.cpp's window of 4096 for a 64-layer file without the keys.
Command R (`command-r`) and Cohere 2: LayerNorms without biases (eps `attention.layer_norm_epsilon`), `logit_scale`,
q/k rows as in the HF checkpoint (no permutation: llama.cpp rotates their interleaved pairs, keel regroups them as
for safetensors), Command R+'s per-head q/k norms (`attn_q_norm` [head_dim, heads] in ggml order) with each head's
channels regrouped the same way; Cohere 2's `attention.sliding_window` with one global layer (no position encoding)
in four, as llama.cpp takes it.
SmolLM3: no key for its layers without position encoding; llama.cpp places one every fourth layer, as the
released models do, and so does keel. StarCoder2: LayerNorms with biases (eps `attention.layer_norm_epsilon`),
its MLP as `ffn_up` / `ffn_down`, no window key (llama.cpp attends over the whole context, and so does keel).
LFM2 (`lfm2`): no layer_types key; `attention.head_count_kv` per layer, 0 for a short-convolution layer (the
attention layers' one count is keel's num_kv_heads), the kernel width `shortconv.l_cache`, the MLP width written
already adjusted, the final norm (HF's `embedding_norm`) as `token_embd_norm`, q/k rows as in HF, the conv weight
squeezed to [C, K] (unsqueezed at load); convolution biases where the file has them (llama.cpp reads none).
LFM2 MoE (`lfm2moe`): LFM2's layer kinds, kernel width, norms and conv weight; the dense layers' width
`feed_forward_length` (unadjusted), the experts' `expert_feed_forward_length`, the dense layers' count
`leading_dense_block_count` (absent: llama.cpp's 0), sigmoid gating (others refused by name), the experts stacked
(`ffn_gate_exps` ...) and the selection bias as `exp_probs_b.bias`. The file has no key for norm_topk_prob or
routed_scaling_factor: llama.cpp always renormalises the chosen scores and never scales them (the releases' true
and 1), and so does keel.

Qwen3.5, Qwen3.5 MoE and Qwen3-Next (`qwen35`, `qwen35moe`, `qwen3next`; Qwen3NextModel and its Qwen3.5 subclasses):
the layer kinds from `full_attention_interval` (absent: llama.cpp's 4; a file cannot hold other patterns), the Gated
DeltaNet's shape from `ssm.group_count` (key heads), `ssm.time_step_rank` (value heads), `ssm.state_size` (key head
size), `ssm.inner_size` (all value heads' width) and `ssm.conv_kernel`, the rotary width from `rope.dimension_count`.
1 is taken off every `*norm.weight` but the Gated DeltaNet's `ssm_norm`; `ssm_a` (no suffix) holds -exp(A_log) and
`ssm_dt.bias` dt_bias; `ssm_conv1d` is HF's conv1d squeezed to [C, K]; q_proj (each head's queries, then its gate) is
kept whole in `attn_q`. Qwen3.5's converter reorders the value heads from HF's grouping by key head to a tiled order
([K0 v0, K1 v0, ..., K0 v1, ...]) in attn_qkv's value rows, attn_gate, ssm_beta / ssm_alpha, ssm_a, ssm_dt, the conv's
value channels and ssm_out's columns; they are put back in HF's order here. Qwen3-Next's converter splits its
in_proj_qkvz into `attn_qkv` (all q, all k, all v: keel's in_proj_qkv) and `attn_gate` (older files keep it whole as
`ssm_in`) and stores in_proj_ba as `ssm_ba`, grouped as in HF. The experts' top k are renormalised (llama.cpp's, no
key) and the shared expert gated.

Granite 4.0-H (`granitehybrid`; GraniteHybridModel, on Mamba2Model and GraniteMoeModel): the layer kinds from the KV
head count per layer (0 for a mamba layer), the Mamba 2 mixer's shape from `ssm.time_step_rank` (heads),
`ssm.inner_size` (all heads' width), `ssm.group_count`, `ssm.state_size` and `ssm.conv_kernel`, Granite's scalars as
above, experts as Granite MoE's (expert_count 0 or absent: the shared MLP stored as the dense `ffn_*`) with the shared
MLP as `ffn_*_shexp`; q/k rows permuted as Llama's. `ssm_a` (no suffix, [n, 1]) holds -exp(A_log), `ssm_d` D as
[n, 1], `ssm_dt.bias` dt_bias, `ssm_norm` the gated norm as [groups, inner / groups], `ssm_conv1d` conv1d squeezed to
[C, K]; biases by tensor. The converter writes `rope.scaling.finetuned` false for every hybrid (no position encoding,
as llama.cpp runs it, whatever position_embedding_type was) and true for BambaForCausalLM's files, which are refused;
the vocabulary from the embedding's rows (the token list is padded to a multiple of 8).

Families whose converters write TextModel's keys and little more (_table_hf_config): OLMoE (`olmoe`: experts stacked
as Qwen-MoE's, their width as feed_forward_length; no key for norm_topk_prob or clip_qkv, and llama.cpp neither
renormalises nor clamps: false and none, OLMoE-1B-7B's), OLMo (`olmo`: weightless LayerNorms, eps fixed at 1e-5,
clip_qkv as `attention.clamp_kqv`; OlmoModel permutes the q/k weights, not their biases), Phi-3.5-MoE (`phimoe`:
Phi-3's keys and LongRoPE; the file's factor on cos/sin is llama.cpp's sqrt(1 + ln(s) / ln(original)), not the
config's mscale; no key for the router's jitter: transformers' 0.01, the release's; llama.cpp routes by a plain
softmax over the top two), Seed-OSS (`seed_oss`), Arcee (`arcee`: q/k permuted; ReLU squared, as llama.cpp runs
it), Apertus (`apertus`: q/k as in HF; xIELU's alpha_p, alpha_n, beta and eps per layer in the `xielu.*` keys, served
as HF's `mlp.act_fn.*` tensors) and Nemotron (`nemotron`: LayerNorm1P's weights stored plus 1, taken off on load;
the eps as `attention.layer_norm_epsilon`; the rotary width), MiniMax-M2 (`minimax-m2`: the experts' width and the
rotary width as keys, sigmoid gating (others refused), the selection bias as `exp_probs_b.bias`; no key for
norm_topk_prob: llama.cpp renormalises, as the family does), Ministral 3 (`mistral3`, Ministral3Model on
LlamaModel: q/k permuted; YaRN's keys with mscale_all_dim itself as `rope.scaling.yarn_log_multiplier` (not 0.1 x it,
as DeepSeek's) and mscale, which no key holds, taken equal to it, as the releases have them; Llama 4's temperature as
`attention.temperature_scale` over YaRN's pre-training context) and EXAONE 3 (`exaone`: q/k as in HF, Llama 3's rope
scaling as `rope_freqs`, the eps as the RMS key or, written as TextModel's from config.json's layer_norm_epsilon, the
LayerNorm key). MiniCPM3 (`minicpm3`): its own keys, DeepSeek-V2's latent attention as the older files store it
(`attn_kv_b` whole), no value width (llama.cpp's hidden / heads), LongRoPE's factors as Phi-3's tensors without its
keys (pre-trained on the whole context: the short factors, no factor on cos/sin), and none of muP's scalars: the
release's 12, 1.4 and 256, which llama.cpp's graph fixes. Hunyuan dense and MoE (`hunyuan-dense`, `hunyuan-moe`):
TextModel's keys, q/k as in HF, NTK's alpha folded into `rope.freq_base` (no scaling left; the context 256k, as
the converter writes it); the MoE's expert width, top k, shared count and shared width as keys, which the family
checks as it checks config.json's (transformers' experts are as wide as the one shared MLP). K-EXAONE (`exaone-moe`,
ExaoneMoEModel on Exaone4Model): EXAONE 4's window and pattern keys, DeepSeek-V3's experts as _deepseek_moe_fields
reads them (sigmoid gating, which no key names: llama.cpp's), the dense layers by tensor (no router: the file's
leading_dense_block_count counts the first ones only), the multi-token-prediction layers past block_count less
nextn_predict_layers not read. Jais 2 (`jais2`): TextModel's keys, LayerNorms' eps as `attention.layer_norm_epsilon`,
q/k as in HF. Biases come from the tensors; the activation, which no key names, is the family's
default (llama.cpp's per architecture).

Falcon-H1 (`falcon-h1`; FalconH1Model, on Mamba2Model): every layer hybrid, its mixer's shape and tensors as Granite
4.0-H's (under `mamba.`), q/k as HF stores them, the head size as `attention.key_length`. The converter folds every
muP multiplier into the weights (ssm_in by segment, the embedding and the LM head too), so all read as 1; it writes
no key for the gated norm: where `ssm_norm` is stored, it follows the gate (llama.cpp's order), else the output is
gated alone. The MLP's norm is stored without a suffix (`ffn_norm`: a TensorNameMap entry that holds `.weight`).

Mamba and Mamba 2 (`mamba`, `mamba2`; MambaModel, Mamba2Model): no attention (`head_count` 0: keel's placeholders), the
mixer's width as `ssm.inner_size`, Mamba's step rank and Mamba 2's heads (inner / head size) as `ssm.time_step_rank`,
the state, kernel and Mamba 2's groups as ssm.* keys, the norms' eps as the RMS key, biases by tensor; the vocabulary
from the embedding's rows (the token list is padded). Tensors as Granite 4.0-H's mixer's (Mamba 1: `ssm_a` as
-exp(A_log) [inner, state], `ssm_d`, `ssm_x`, `ssm_dt` weight and bias). No key for Mamba 2's time_step_limit (llama.cpp
clamps no step: none); Falcon Mamba's files (`ssm.dt_b_c_rms` true) are refused.

Nemotron-H (`nemotron_h`, `nemotron_h_moe`; NemotronHModel on GraniteHybridModel): one sublayer a layer, its kind from
the per-layer KV head count (attention where not 0) and feed-forward length (where not 0: the ungated MLP, or in a
`nemotron_h_moe` file the experts; the converter writes a MoE model's dense layers as 0, which llama.cpp reads as a
Mamba layer: refused), else Granite 4.0-H's Mamba 2 mixer; no position encoding, q/k permuted as Llama's, the head size
as key_length, the eps as either key; DeepSeek-V3's sigmoid experts (ungated, `ffn_up_exps` alone: keel's
gate_up_proj) with the selection bias and shared expert, their counts, widths, renormalisation and scale as keys; no
key for the groups' top k (a file with more than one group is refused) or time_step_min (the releases' 0.001).

GPT-BigCode, GPT-2 and Falcon (`starcoder`, `gpt2`, `falcon`; StarCoderModel, GPT2Model, FalconModel): their own keys
(LayerNorms' eps, heads; feed_forward_length always 4 x hidden, so the MLP's width comes from `ffn_up`), q/k/v fused in
`attn_qkv` as all q, all k, all v (GPT-2's Conv1D weights stored transposed, as Linear's; Falcon's KV groups regrouped,
"jploski"), learned positions as `position_embd`, biases by tensor. No key for GPT-2's per-layer softmax scale or
GPT-BigCode's scale_attn_weights (llama.cpp's 1/sqrt(head size)); StarCoderModel writes one KV head whatever
multi_query says, so a file whose attn_qkv holds more is refused. Falcon: the parallel block (llama.cpp runs no other),
two norms where `attn_norm_2` is stored (new_decoder_architecture), rotary (FalconModel writes nothing of ALiBi).

BLOOM and MPT (`bloom`, `mpt`; BloomModel, MPTModel): ALiBi (keel's position_embedding "alibi"), LayerNorms with their
eps, q/k/v fused in `attn_qkv` as all q, all k, all v (BloomModel regroups its per-head rows), the embedding's own
norm as `token_embd_norm` (BLOOM). MPT: its `max_alibi_bias` (0, learned positions, refused) and `clamp_kqv`; no key
for softmax_scale (llama.cpp's 1/sqrt(head size)); the MLP's width from `ffn_up`.
GPT-J (`gptj`; GPTJModel): its own keys (the LayerNorm's eps, heads, the context; feed_forward_length always 4 x hidden:
the MLP's width from `ffn_up`; the rotary width only where it is part of the head), q/k rows as in HF (llama.cpp rotates
their interleaved pairs; keel regroups them as for safetensors), the head's bias as `output.bias`, the vocabulary
from the embedding's rows (GPT-J-6B's 50400 for 50257 tokens).

AFMoE (`afmoe`; AfmoeModel on LlamaModel): q/k as in HF, LlamaModel's keys and the experts' (counts, width, shared
count, route_scale as `expert_weights_scale`, the dense layers as `leading_dense_block_count`), the window, the
selection bias as `exp_probs_b.bias`, the experts stacked per kind, the output gate as `attn_gate`. llama.cpp fixes one
global layer (no position encoding) in four and the embedding times sqrt(hidden) (mup_enabled), which keel takes; a file
without a window, with other gating than sigmoid, or with `expert_weights_norm` false is refused.
MiMo-V2-Flash (`mimo2`; MimoV2Model): the KV heads per layer (`head_count_kv`, the sliding layers twice the full ones'
as keel runs them; other counts refused), the pattern as a list (1 = sliding) and the window, the value width as
`attention.value_length`, one rotary width for both kinds (`rope.dimension_count`: the file cannot hold transformers'
per-kind shares apart) at each kind's base (`rope.freq_base`, `rope.freq_base_swa`, absent: llama.cpp's 10000), the
sinks as `attn_sinks.weight` in the sliding layers (a full layer with them, or a sliding one without, refused), the
dense layers those without a router, the experts stacked, the selection bias as `exp_probs_b.bias`. llama.cpp's graph
routes by sigmoid, renormalised and unscaled (another gating, `expert_weights_norm` false or an `expert_weights_scale`
other than 1 are refused). The converter writes no attention_value_scale and llama.cpp's graph scales no values;
keel scales them by MiMoV2FlashConfig's default, the release's 0.707, as transformers, vLLM and Megatron-Bridge run
the model (`attention.output_scale`, the same product before o_proj, where a file has it): on a release file keel's
tokens follow transformers', not llama.cpp's. The multi-token-prediction layers are not written.

Jamba (`jamba`; JambaModel): the attention layers from the per-layer KV head count (0 for a Mamba layer), the expert
layers by tensor (those with a router: no key), each every k-th layer from an offset as config.json's keys give them
(other patterns refused); Mamba 1 mixers as Mamba's with their step, B and C norms (`ssm_dt_norm`, `ssm_b_norm`,
`ssm_c_norm`), the experts stacked as Qwen2-MoE's (softmax top k, not renormalised: the family's, as llama.cpp's).
DBRX (`dbrx`; DbrxModel): its own keys (the RoPE base, `attention.clamp_kqv`, the expert counts, the experts' width as
feed_forward_length, the LayerNorms' eps), q/k/v fused in `attn_qkv` as in HF, `norm_2` as `attn_output_norm`, the
experts stacked from HF's fused rows as [E, I, H] (gate, up) and [E, H, I] (down), read as keel's stacked experts. No
key for moe_normalize_expert_weights or the activation: llama.cpp always divides the top-k weights by their sum and
runs SiLU (the releases' 1 and silu), and so does keel.
BitNet b1.58 (`bitnet`; BitnetModel): TextModel's keys (a linear rope scaling of 1; rotary pairs as HF's, llama.cpp's
NEOX order, no permutation), the sub-norms `attn_sub_norm` / `ffn_sub_norm`, the head the embedding (llama.cpp reads
no `output.weight`). The converter ternarizes each projection as AutoBitLinear's online mode does (round(w / s) clamped
to -1..1, times s = mean |w|) and stores the products (F16/F32, or TQ1_0 / TQ2_0 after llama-quantize, whose block
scale is then s in fp16); older files hold the ternary values with a `.scale` tensor [1] that llama.cpp's graph
multiplies in after the product. keel runs the projections as keel.quant.bitnet's AutoBitLinear offline layers
(BITNET_LAYERS): y = (x' W^T) * scale (1 without a `.scale` tensor), x' the activations rounded to int8 per token as
BitNet was trained and transformers runs it. llama.cpp instead rounds activations as its vec_dot type asks: Q8_K
blocks of 256 for TQ1_0 / TQ2_0, none for F16/F32 files. TQ blocks are dequantized at load (gguf.quants), not kept as
codes. bitnet.cpp's I2_S (type id 36, and its bitnet-b1.58 / bitnet-25 architectures) is refused by name.
Kimi Linear (`kimi-linear`; KimiLinearModel): the layer kinds from the per-layer `head_count_kv` (0: a KDA layer; the
latent-attention layers' 1, their MQA form), the KDA head size `kda.head_dim` and kernel `ssm.conv_kernel`, the KDA head
count (no key: llama.cpp takes `head_count`) from `ssm_a`'s shape; the KDA tensors under Moonshot's names, the short
convolutions stored [1, C, 1, K] (read back as [C, 1, K]), A_log as -exp(A_log), dt_bias as `ssm_dt.bias`; the
latent attention as DeepSeek-V3's MQA form (`attn_k_b` / `attn_v_b`, `key_length_mla`, `value_length_mla`), unrotated
(rope_layers all false, as keel.families.kimi_linear); DeepSeek-V3's experts, the dense layers first
(`leading_dense_block_count`). The converter writes no gating function, renormalisation or group keys: sigmoid,
renormalised (the release's moe_renormalize) and one group unless the file says otherwise.
GLM-5 (`glm-dsa`; GlmMoeDsaModel on DeepseekV2Model), read into keel.families.glm_moe_dsa: the latent attention and
experts as `deepseek2`'s (the NextN layer counted in block_count, unread); DeepSeek Sparse Attention's indexer from
`attention.indexer.head_count` / `key_length` / `top_k` and its tensors (`indexer.attn_q_b`, `indexer.attn_k`,
`indexer.k_norm` with its bias, `indexer.proj`) as HF's rows (no permutation; its interleaved rotary is the family's).
Each layer's indexer is "full" or "shared" by `attention.indexer.types` (a bool per layer, true: full; newer converters
write it, gguf 0.19 has no name for it), else by which layers hold indexer tensors (transformers gives a shared layer
none); a key that disagrees with the tensors is refused. The dense layers by tensor (no router). A rotary width
(`rope.dimension_count`, the converter's qk_rope_head_dim x partial_rotary_factor) other than the keys' is refused.
keel selects keys as transformers does; llama.cpp of gguf 0.19's day builds glm-dsa as deepseek2 (the indexer loaded,
unused: dense attention), so its logits differ from keel's past `top_k` keys. (Newer llama.cpp's `deepseek32`,
DeepSeek-V3.2, is no architecture gguf 0.19 names: refused as unsupported.)

InternLM2 / 2.5 (`internlm2`; InternLM2Model) is read as keel's `llama` (its HF class is remote code; `keel convert`
writes LlamaForCausalLM): TextModel's keys, the head size hidden / heads (no key), wqkv split by the converter into
`attn_q` / `attn_k` / `attn_v` with q/k permuted as Llama's, the rest under Llama's names. InternLM2.5's dynamic NTK
scaling is no key the converter writes (TextModel skips "dynamic"): llama.cpp runs the plain frequencies, which are
the dynamic ones up to max_position_embeddings, and so does keel; a linear factor, where written, is read.
MiniCPM 1/2/4 (`minicpm`; MiniCPMModel) is read as keel's `granite`: llama.cpp builds it with Granite's graph, the
embedding times `embedding_scale` (scale_emb), each sublayer's output times `residual_scale` (scale_depth /
sqrt(layers)), the logits over `logit_scale` (hidden / dim_model_base), the softmax scale 1/sqrt(head size) (as
Granite's attention_multiplier; MiniCPMModel writes no attention.scale and llama.cpp reads none for minicpm: a file
with one is refused); keys absent (older files): 12, 1.4 / sqrt(layers) and a divisor hidden / 256, the releases'
(llama.cpp's first two; its absent logit_scale, 256 / hidden, is divided by as well: logits hidden^2 / 256^2 times
keel's, the same greedy tokens). q/k weights permuted (not biases); LongRoPE (MiniCPM4) as
TextModel's `rope.scaling.type` with the factors as Phi-3's tensors and no other key, read as MiniCPM3's (pre-trained
on the whole context: the short factors, no factor on cos/sin). MiniCPM-MoE (`expert_count`) is refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    MODEL_TENSORS,
    TENSOR_NAMES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    Keys,
    get_tensor_name_map,
)
from gguf.quants import dequantize
from torch import Tensor

from keel.config import DEEPSEEK_V2_ROUTER, FAMILY_DEFAULTS, HIDDEN_ACTS, ModelConfig, RopeScaling
from keel.errors import ConfigError, WeightsError
from keel.families import FAMILIES, checkpoint_layout
from keel.families.parts import Columns, Transposed
from keel.weights.checkpoint import Checkpoint
from keel.weights.gguf_blocks import BLOCK_TYPES, QuantBlocks, decode_blocks
from keel.weights.gguf_file import ForeignTypeError, GGUFFile, GGUFTensor
from keel.weights.gguf_tokenizer import tokenizer_from_gguf
from keel.weights.names import MIXTRAL_NAMED
from keel.weights.shard import Shard, narrow

_A = MODEL_ARCH
# llama.cpp's fixed Llama 4 settings (no GGUF keys): the attention chunk, and the expert count of the one model
# without the q/k norm (Llama 4 Maverick, 17B-128E).
_LLAMA4_CHUNK = 8192
_LLAMA4_MAVERICK_EXPERTS = 128
# llama.cpp architecture -> keel family ("llama" with experts becomes "mixtral" below).
_FAMILIES = {
    _A.LLAMA: "llama",
    _A.QWEN2: "qwen2",
    _A.QWEN3: "qwen3",
    _A.QWEN2MOE: "qwen2_moe",
    _A.QWEN3MOE: "qwen3_moe",
    # the text models of Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (the vision tower in a separate mmproj
    # file): Qwen2's, Qwen3's and Qwen3-MoE's tensors and keys, M-RoPE by `rope.dimension_sections`, which on text
    # (one position for all sections) is the plain rotary (keel.config._rope_from_hf), so the sections go unread
    _A.QWEN2VL: "qwen2",
    _A.QWEN3VL: "qwen3",
    _A.QWEN3VLMOE: "qwen3_moe",
    _A.GRANITE: "granite",
    _A.GRANITE_MOE: "granitemoe",
    _A.PHI3: "phi3",
    _A.OLMO2: "olmo2",
    _A.PHI2: "phi",
    _A.GEMMA: "gemma",
    _A.GEMMA2: "gemma2",
    _A.GEMMA3: "gemma3",
    _A.GEMMA3N: "gemma3n",
    _A.GEMMA4: "gemma4",
    _A.STABLELM: "stablelm",
    _A.GPTNEOX: "gpt_neox",
    _A.SMOLLM3: "smollm3",
    _A.STARCODER2: "starcoder2",
    _A.EXAONE4: "exaone4",
    _A.COMMAND_R: "cohere",
    _A.COHERE2: "cohere2",
    _A.GPT_OSS: "gpt_oss",
    # ChatGLM2/3 and GLM-4-9B (ChatGLMModel, which converts GlmForCausalLM too): transformers' GLM block (module doc)
    _A.CHATGLM: "glm",
    _A.GLM4: "glm4",
    _A.GLM4_MOE: "glm4_moe",
    _A.DOTS1: "dots1",
    _A.ERNIE4_5: "ernie4_5",
    _A.ERNIE4_5_MOE: "ernie4_5_moe",
    _A.DEEPSEEK2: "deepseek_v3",  # or deepseek_v2, by the expert gating function (_deepseek2_family)
    _A.LLAMA4: "llama4",
    _A.LFM2: "lfm2",
    _A.LFM2MOE: "lfm2_moe",
    _A.QWEN35: "qwen3_5",
    _A.QWEN35MOE: "qwen3_5_moe",
    _A.QWEN3NEXT: "qwen3_next",
    _A.GRANITE_HYBRID: "granitemoehybrid",
    _A.OLMOE: "olmoe",
    _A.OLMO: "olmo",
    _A.PHIMOE: "phimoe",
    _A.SEED_OSS: "seed_oss",
    _A.ARCEE: "arcee",
    _A.APERTUS: "apertus",
    _A.NEMOTRON: "nemotron",
    _A.MINIMAXM2: "minimax_m2",
    _A.MISTRAL3: "ministral3",
    _A.FALCON_H1: "falcon_h1",
    _A.EXAONE: "exaone",
    _A.MINICPM3: "minicpm3",
    _A.HUNYUAN_DENSE: "hunyuan_v1_dense",
    _A.HUNYUAN_MOE: "hunyuan_v1_moe",
    _A.EXAONE_MOE: "exaone_moe",
    _A.JAIS2: "jais2",
    _A.MAMBA: "mamba",
    _A.MAMBA2: "mamba2",
    _A.NEMOTRON_H: "nemotron_h",
    _A.NEMOTRON_H_MOE: "nemotron_h",
    _A.STARCODER: "gpt_bigcode",
    _A.GPT2: "gpt2",
    _A.FALCON: "falcon",
    _A.JAMBA: "jamba",
    _A.DBRX: "dbrx",
    _A.BLOOM: "bloom",
    _A.MPT: "mpt",
    _A.GPTJ: "gptj",
    _A.AFMOE: "afmoe",
    _A.MIMO2: "mimo_v2_flash",
    _A.BITNET: "bitnet",
    _A.KIMI_LINEAR: "kimi_linear",
    _A.GLM_DSA: "glm_moe_dsa",  # GLM-5: DeepSeek-V2's latent attention and experts with the DSA indexer
    # InternLM2 / 2.5 (InternLM2Model: wqkv split into llama's q/k/v, q/k permuted): Llama's computation; its HF
    # class is remote code, so the export is LlamaForCausalLM
    _A.INTERNLM2: "llama",
    # MiniCPM 1/2/4 (MiniCPMModel): llama with muP's three scalars, which llama.cpp runs through Granite's graph
    _A.MINICPM: "granite",
}
# general.architecture (its name in the file) -> keel family.
ARCHITECTURES = {MODEL_ARCH_NAMES[arch]: family for arch, family in _FAMILIES.items()}
_ARCH_BY_NAME = {MODEL_ARCH_NAMES[arch]: arch for arch in _FAMILIES}
# llama.cpp's converter permutes q/k rows (rotary pairs adjacent) for LlamaModel and its subclasses that keep its
# tensor handling: llama (Mixtral included), granite, granitehybrid (its attention layers: undo_permute), arcee,
# mistral3 (Ministral3Model) and smollm3 (their NoPE layers too: the same permutation of q's and k's rows leaves
# their products as they were); OlmoModel permutes the weights only (its biases as in HF). Apertus (undo_permute
# False) keeps HF's rows.
_PERMUTED = {_A.LLAMA, _A.GRANITE, _A.GRANITE_MOE, _A.GRANITE_HYBRID, _A.SMOLLM3, _A.ARCEE, _A.OLMO, _A.MISTRAL3}
_PERMUTED |= {_A.NEMOTRON_H, _A.NEMOTRON_H_MOE}  # (NemotronHModel, on GraniteHybridModel: no position encoding)
# InternLM2Model permutes the q/k rows it splits out of wqkv; MiniCPMModel permutes q/k weights (not biases).
_PERMUTED |= {_A.INTERNLM2, _A.MINICPM}
_PERMUTED_WEIGHTS_ONLY = {_A.OLMO, _A.MINICPM}
# Gemma's converter adds 1 to every `*norm.weight` (llama.cpp's RMSNorm scales by w, Gemma's by 1 + w), and so does
# Nemotron's (its LayerNorm1P scales by 1 + w; llama.cpp's LayerNorm by w).
_NORM_PLUS_ONE = {_A.GEMMA, _A.GEMMA2, _A.GEMMA3, _A.NEMOTRON}
# Qwen3.5 and Qwen3-Next (Gated DeltaNet hybrids): the converter (Qwen3NextModel) adds 1 to every `*norm.weight` but the
# Gated DeltaNet's own (`linear_attn.norm`), stores -exp(A_log) as `ssm_a` and keeps q_proj (queries and gate per head)
# and Qwen3-Next's in_proj_ba as HF stores them; Qwen3.5's converter also reorders the value heads (_value_order).
_GATED_DELTANET = {_A.QWEN35, _A.QWEN35MOE, _A.QWEN3NEXT}
_VALUE_HEADS_TILED = {_A.QWEN35, _A.QWEN35MOE}
# The keel families of those files.
_QWEN_HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Families whose rotary covers the first rope.dimension_count channels of each head (partial rotary).
_PARTIAL_ROTARY = {"stablelm", "gpt_neox", "phi", "nemotron"}
# Families whose rope.dimension_count is the rotary width, never the head size (Phi-4-mini's 3/4 of each head too).
_ROTARY_WIDTH_KEY = _PARTIAL_ROTARY | {"phi3", "glm", "glm4", "glm4_moe", "deepseek_v2", "deepseek_v3", "minimax_m2"}
_ROTARY_WIDTH_KEY |= {"mimo_v2_flash", "kimi_linear", "glm_moe_dsa"}
_ROTARY_WIDTH_KEY |= {"minicpm3", "gemma4", "gptj", *_QWEN_HYBRID}
# Families with LayerNorms: their eps is attention.layer_norm_epsilon, not layer_norm_rms_epsilon.
_LAYER_NORM = {"stablelm", "gpt_neox", "starcoder2", "cohere", "cohere2", "phi", "olmo", "nemotron", "jais2"}
_LAYER_NORM |= {"gpt_bigcode", "gpt2", "falcon", "dbrx", "bloom", "mpt", "gptj"}
# llama.cpp's Gemma: the layer count it takes for the 27B model, whose softmax scale is
# (hidden / heads)^-1/2 instead of head_dim^-1/2 (llama-model.cpp, after gemma_pytorch's config).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# What llama.cpp hard-codes for Gemma where the file says nothing: Gemma 2's window (4096), Gemma 3's
# pattern (five sliding layers, then a global one) and the RoPE base of its sliding layers.
_GEMMA2_WINDOW = 4096
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA_FINAL_CAP = 30.0  # llama.cpp's final_logit_softcapping where a Gemma 3n / 4 file has none
# What llama.cpp hard-codes for EXAONE 4's 64-layer (32B) model: a window of 4096 (one global layer in four).
_EXAONE4_SWA_LAYERS = 64
_EXAONE4_WINDOW = 4096
# Families whose vocabulary is the embedding's rows: Gemma 3's converter drops rows past the tokenizer's; Granite
# 4.0-H's, Mamba's, Mamba 2's and Nemotron-H's pad the token list (to a multiple of 8, 8, 16 and 8), not the embedding.
# Gemma 3n's pads the embedding (and the per-layer table) with zero rows to the vocabulary's size; GPT-J's embedding
# has rows past its tokenizer's (50400 for 50257 tokens).
_EMBEDDING_ROWS = ("gemma3", "gemma3n", "gemma4", "gptj", "granitemoehybrid", "mamba", "mamba2", "nemotron_h")
# llama.cpp's Qwen3.5 / Qwen3-Next layer kinds without the key: every fourth layer full attention.
_FULL_ATTENTION_INTERVAL = 4

_T = GGMLQuantizationType
SUPPORTED_TYPES = (
    *(_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1),
    *(_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.IQ4_NL, _T.MXFP4),
    *(_T.TQ1_0, _T.TQ2_0),  # BitNet's ternary blocks, dequantized at load (gguf's own dequantize)
)

# The one key keel reads that gguf-py does not name: older files' linear RoPE factor (llama.cpp still
# reads it as LLM_KV_ROPE_SCALE_LINEAR; newer converters write rope.scaling.type/factor).
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"
# And one gguf 0.19 does not name yet: GLM-5's indexer per layer (true: "full", false: "shared"), which llama.cpp's
# converter writes from indexer_types since gguf-py gained `add_indexer_types` (older files: the tensors tell).
INDEXER_TYPES = "{arch}.attention.indexer.types"
_K, _KA, _KR, _KT = Keys.LLM, Keys.Attention, Keys.Rope, Keys.Tokenizer
# Every metadata key keel reads here (gguf_tokenizer reads the tokenizer.* ones it needs besides): a test
# checks that each is one of gguf's Keys (but ROPE_SCALE_LINEAR) and that no key is spelled out in this file.
KEYS_READ = (
    Keys.General.ARCHITECTURE,
    *(_K.VOCAB_SIZE, _K.CONTEXT_LENGTH, _K.EMBEDDING_LENGTH, _K.BLOCK_COUNT, _K.FEED_FORWARD_LENGTH),
    *(_K.EXPERT_COUNT, _K.EXPERT_USED_COUNT, _K.EXPERT_FEED_FORWARD_LENGTH, _K.EXPERT_SHARED_FEED_FORWARD_LENGTH),
    *(_K.EXPERT_WEIGHTS_NORM, _K.EMBEDDING_SCALE, _K.RESIDUAL_SCALE, _K.LOGIT_SCALE),
    *(_K.EXPERT_SHARED_COUNT, _K.EXPERT_WEIGHTS_SCALE, _K.EXPERT_GATING_FUNC, _K.LEADING_DENSE_BLOCK_COUNT),
    *(_K.EXPERT_GROUP_COUNT, _K.EXPERT_GROUP_USED_COUNT, _K.NEXTN_PREDICT_LAYERS, _K.INTERLEAVE_MOE_LAYER_STEP),
    *(_K.ATTN_LOGIT_SOFTCAPPING, _K.FINAL_LOGIT_SOFTCAPPING, _K.USE_PARALLEL_RESIDUAL),
    *(_KA.HEAD_COUNT, _KA.HEAD_COUNT_KV, _KA.KEY_LENGTH, _KA.LAYERNORM_RMS_EPS, _KA.LAYERNORM_EPS, _KA.SCALE),
    *(_KA.KEY_LENGTH_MLA, _KA.VALUE_LENGTH, _KA.VALUE_LENGTH_MLA, _KA.Q_LORA_RANK, _KA.KV_LORA_RANK),
    *(_KA.SLIDING_WINDOW, _KA.SLIDING_WINDOW_PATTERN, _K.FULL_ATTENTION_INTERVAL, _KA.CLAMP_KQV, _KA.TEMPERATURE_SCALE),
    _KA.MAX_ALIBI_BIAS,
    *(_K.ALTUP_ACTIVE_IDX, _K.ALTUP_NUM_INPUTS, _K.EMBD_LENGTH_PER_LAYER_INP, _K.ACTIVATION_SPARSITY_SCALE),
    *(_KA.SHARED_KV_LAYERS, _KA.KEY_LENGTH_SWA, _KR.DIMENSION_COUNT_SWA),
    *(Keys.xIELU.ALPHA_P, Keys.xIELU.ALPHA_N, Keys.xIELU.BETA, Keys.xIELU.EPS),
    Keys.ShortConv.L_CACHE,
    Keys.KDA.HEAD_DIM,
    Keys.SSM.DT_B_C_RMS,
    *(Keys.SSM.CONV_KERNEL, Keys.SSM.INNER_SIZE, Keys.SSM.STATE_SIZE, Keys.SSM.TIME_STEP_RANK, Keys.SSM.GROUP_COUNT),
    *(_KR.DIMENSION_COUNT, _KR.FREQ_BASE, _KR.FREQ_BASE_SWA, _KR.SCALING_TYPE, _KR.SCALING_FACTOR),
    *(_KR.SCALING_ORIG_CTX_LEN, _KR.SCALING_FINETUNED),
    *(_KR.SCALING_YARN_BETA_FAST, _KR.SCALING_YARN_BETA_SLOW, _KR.SCALING_YARN_ATTN_FACTOR, _KR.SCALING_ATTN_FACTOR),
    _KR.SCALING_YARN_LOG_MUL,
    *(Keys.Attention.Indexer.HEAD_COUNT, Keys.Attention.Indexer.KEY_LENGTH, Keys.Attention.Indexer.TOP_K),
    ROPE_SCALE_LINEAR,
    INDEXER_TYPES,
    *(_KT.LIST, _KT.BOS_ID, _KT.EOS_ID, _KT.EOT_ID, _KT.EOM_ID, _KT.PAD_ID),
)


# Granite's four scalars: (llama.cpp's key, the config.json key, keel's field); Granite and Granite MoE files alike.
_GRANITE_SCALARS = (
    (_K.EMBEDDING_SCALE, "embedding_multiplier", "embedding_multiplier"),
    (_K.RESIDUAL_SCALE, "residual_multiplier", "residual_multiplier"),
    (_KA.SCALE, "attention_multiplier", "attention_scale"),
    (_K.LOGIT_SCALE, "logits_scaling", "logits_scaling"),
)


def _tensor(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """llama.cpp's name of a tensor (gguf's TENSOR_NAMES), e.g. `blk.0.attn_q.bias`."""
    return f"{TENSOR_NAMES[kind].format(bid=layer)}.{suffix}"


_TOKEN_EMBD, _OUTPUT = _tensor(MODEL_TENSOR.TOKEN_EMBD), _tensor(MODEL_TENSOR.OUTPUT)
_ROPE_FREQS = _tensor(MODEL_TENSOR.ROPE_FREQS)
# Older Mixtral GGUFs store experts one by one: the dense FFN's name and the expert's index
# (blk.N.ffn_gate.E.weight); keel.weights.names reads the hub form.
_OLD_EXPERT = {
    kind: re.compile("^" + re.escape(TENSOR_NAMES[kind]).replace(re.escape("{bid}"), r"(\d+)") + r"\.(\d+)\.weight$")
    for kind in (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)
}
_MIXTRAL_EXPERT = {MODEL_TENSOR.FFN_GATE: "w1", MODEL_TENSOR.FFN_UP: "w3", MODEL_TENSOR.FFN_DOWN: "w2"}


def open_gguf(path: Path) -> Checkpoint:
    """Open a .gguf file as a keel Checkpoint (config, HF-named tensors, tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    try:
        reader = GGUFFile(path)
    except ForeignTypeError as e:
        raise WeightsError(f"{path}: {e}, which keel cannot read") from None
    except Exception as e:  # ValueError (truncated, bad magic), UnicodeDecodeError, an unknown type id, ...
        raise WeightsError(f"{path}: not a readable GGUF file, truncated or corrupt ({_one_line(e)})") from None
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    try:
        config, provenance = _config_from_metadata(meta, tensors, path)
    except (TypeError, ValueError, IndexError) as e:  # a key of the wrong type or shape
        raise ConfigError(f"{path}: malformed GGUF metadata ({_one_line(e)})") from None
    tensor_reader = GGUFTensorReader(path, reader, config)
    tokenizer = tokenizer_from_gguf(meta.get, config.eos_token_id, path)
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    bitnet = dict(BITNET_LAYERS) if config.architecture == "bitnet" else None
    return Checkpoint(path, "gguf", config, tensor_reader, tokenizer, provenance, sizes, bitnet=bitnet)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class _Metadata:
    """Typed access to GGUF key/values, with errors that name the file and key."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value


def _f32(value: float) -> float:
    """GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-5, not 9.99e-06)."""
    return float(str(np.float32(value)))


# ------------------------------------------------------------------------------------------ config
class _Fields:
    """One file's `<arch>.*` metadata read into config fields, recording where each field came from:
    "read" (metadata), "inferred" (tensor names and shapes) or "default" (the family default).
    Keys are gguf's templates (`Keys.LLM.CONTEXT_LENGTH`), formatted with the file's architecture."""

    def __init__(self, meta: _Metadata, arch: str, family: str) -> None:
        self.meta, self.arch = meta, arch
        self.defaults = FAMILY_DEFAULTS[family]
        self.provenance = {name: "default" for name in ModelConfig.__dataclass_fields__}

    def name(self, key: str) -> str:
        return key.format(arch=self.arch)

    def key(self, key: str, default: Any = None) -> Any:
        return self.meta.get(self.name(key), default)

    def require(self, key: str) -> Any:
        return self.meta.require(self.name(key))

    def read(self, field: str, value: Any, how: str = "read") -> Any:
        self.provenance[field] = how
        return value

    def pick(self, field: str, value: Any, convert: Callable[[Any], Any]) -> Any:
        """The metadata value (provenance "read"), or the family default when the key is absent."""
        if value is not None:
            return self.read(field, convert(value))
        if field in self.defaults:
            return copy.copy(self.defaults[field])
        spec = ModelConfig.__dataclass_fields__[field]
        if spec.default_factory is not dataclasses.MISSING:
            return spec.default_factory()
        return 0 if spec.default is dataclasses.MISSING else spec.default


def _config_from_metadata(
    meta: _Metadata, tensors: dict[str, GGUFTensor], path: Path
) -> tuple[ModelConfig, dict[str, str]]:
    arch = _architecture(meta, path)
    num_experts = int(meta.get(_K.EXPERT_COUNT.format(arch=arch), 0) or 0)
    family = "mixtral" if arch == MODEL_ARCH_NAMES[_A.LLAMA] and num_experts else ARCHITECTURES[arch]
    if arch == MODEL_ARCH_NAMES[_A.DEEPSEEK2]:
        family = _deepseek2_family(meta, arch)
    if family == "granitemoe" and _tensor(MODEL_TENSOR.FFN_DOWN_SHEXP, 0) in tensors:
        family = "granitemoeshared"  # llama.cpp's granitemoe architecture holds both (its shared expert is optional)
    f = _Fields(meta, arch, family)
    hidden, num_heads, kv_heads, head_dim = _attention_shape(f, family, path)
    # (GraniteHybridModel pads the token list, and vocab_size with it, to a multiple of 8; not the embedding.)
    vocab = _vocab_size(f, tensors, path, embedding_first=family in _EMBEDDING_ROWS)
    rope_theta = f.pick("rope_theta", f.key(_KR.FREQ_BASE), _f32)
    # (Gemma 4's rope_freqs hold its full-attention layers' proportional RoPE: _gemma4_fields)
    rope_tensors = {k: v for k, v in tensors.items() if k != _ROPE_FREQS} if family == "gemma4" else tensors
    scaling = _rope_scaling(f, rope_tensors, head_dim, rope_theta, path)
    has = lambda kind, suffix="weight": _tensor(kind, 0, suffix) in tensors  # noqa: E731
    # GLM-4.5's files count the multi-token-prediction layers after the last in block_count; keel reads none.
    num_layers = int(f.require(_K.BLOCK_COUNT)) - int(f.key(_K.NEXTN_PREDICT_LAYERS, 0) or 0)
    feed_forward = f.key(_K.FEED_FORWARD_LENGTH)
    if isinstance(feed_forward, list) and family == "gemma4":  # the KV-sharing layers' twice as wide: the first's
        feed_forward = feed_forward[0]
    if isinstance(feed_forward, list):  # per layer (Nemotron-H's: 0 but in its MLP layers): the family reads it
        feed_forward = max(feed_forward)
    moe: dict[str, Any] = {}
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_next"):
        moe = _moe_fields(f, family, tensors, num_layers, num_experts, path)
    elif feed_forward is None:
        raise ConfigError(f"{path}: GGUF metadata key {f.name(_K.FEED_FORWARD_LENGTH)!r} is missing")
    eos_ids = _eos_ids(meta)
    fields = dict(
        architecture=f.read("architecture", family),
        vocab_size=vocab,
        hidden_size=hidden,
        # All-sparse MoE files have no dense width; the family default is then unused.
        intermediate_size=f.pick("intermediate_size", feed_forward, int),
        num_layers=f.read("num_layers", num_layers),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.pick("rms_norm_eps", _norm_eps(f, family), _f32),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=f.pick("max_position_embeddings", f.key(_K.CONTEXT_LENGTH), int),
        # No activation key: llama.cpp's per architecture, the family's default (Arcee's relu2, Apertus's xielu)
        hidden_act=HIDDEN_ACTS[FAMILY_DEFAULTS[family].get("hidden_act", "silu")],
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        tie_word_embeddings=f.read("tie_word_embeddings", _OUTPUT not in tensors, "inferred"),
        qkv_bias=f.read("qkv_bias", has(MODEL_TENSOR.ATTN_Q, "bias") or has(MODEL_TENSOR.ATTN_QKV, "bias"), "inferred"),
        o_bias=f.read("o_bias", has(MODEL_TENSOR.ATTN_OUT, "bias"), "inferred"),
        mlp_bias=f.read("mlp_bias", has(MODEL_TENSOR.FFN_UP, "bias"), "inferred"),
        qk_norm=f.read("qk_norm", has(MODEL_TENSOR.ATTN_Q_NORM), "inferred"),
        bos_token_id=f.pick("bos_token_id", meta.get(_KT.BOS_ID), int),
        eos_token_id=f.pick("eos_token_id", eos_ids, list),
        pad_token_id=f.pick("pad_token_id", meta.get(_KT.PAD_ID), int),
        dtype=f.read("dtype", _checkpoint_dtype(tensors), "inferred"),
        **moe,
    )
    fields.update(_family_fields(f, family, fields, tensors, path))
    try:
        config = ModelConfig(**fields)
    except ConfigError as e:  # ModelConfig.validate does not know the file
        raise ConfigError(f"{path}: {e}") from None
    return config, f.provenance


def _norm_eps(f: _Fields, family: str) -> Any:
    """The norms' eps: `attention.layer_norm_epsilon` for LayerNorm families, else `layer_norm_rms_epsilon`. EXAONE 3's
    converter wrote its layer_norm_epsilon as the RMS key (which llama.cpp reads); written as TextModel's from
    config.json, it lands under the LayerNorm key instead."""
    if family in _LAYER_NORM:
        return f.key(_KA.LAYERNORM_EPS)
    eps = f.key(_KA.LAYERNORM_RMS_EPS)
    return f.key(_KA.LAYERNORM_EPS) if eps is None and family == "exaone" else eps


def _architecture(meta: _Metadata, path: Path) -> str:
    """general.architecture, when keel reads it from GGUF."""
    arch = meta.get(Keys.General.ARCHITECTURE)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def _deepseek2_family(meta: _Metadata, arch: str) -> str:
    """llama.cpp's `deepseek2` holds DeepSeek-V2 / V2.5 (softmax gating, or no gating key: their older files) and
    DeepSeek-V3 / R1 and kin (sigmoid gating), as llama.cpp tells them apart."""
    gating = meta.get(_K.EXPERT_GATING_FUNC.format(arch=arch))
    return "deepseek_v3" if gating is not None and int(gating) == int(ExpertGatingFuncType.SIGMOID) else "deepseek_v2"


def _family_fields(
    f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path
) -> dict[str, Any]:
    """The config fields of the family beyond the Llama block: Granite's multipliers, Phi-3's sliding
    window, and what a keel.families module sets for its family (OLMo 2's norm placement and q/k norms)."""
    own: dict[str, Any] = {}
    if family == "granite" and f.arch == MODEL_ARCH_NAMES[_A.MINICPM]:
        own = _minicpm_fields(f, common, tensors, path)
    elif family == "granite":
        # The converter writes each only when config.json has it; absent, transformers' default 1.0 holds.
        own = {
            field: f.read(field, _f32(f.key(key)), "read") if f.key(key) else 1.0 for key, _, field in _GRANITE_SCALARS
        }
    if family in ("phi3", "phimoe"):  # Phi3MiniModel's and its subclass PhiMoeModel's
        own.update(_phi3_longrope(f, common, tensors, path))
        window = int(f.key(_KA.SLIDING_WINDOW, 0) or 0)  # 0: none (Phi-4's files)
        own["sliding_window"] = f.read("sliding_window", window, "read") if window else None
    if family == "glm":
        _check_chatglm(common, tensors, path)
    if family in ("glm4_moe", "dots1", "deepseek_v2", "deepseek_v3", "exaone_moe", "kimi_linear", "glm_moe_dsa"):
        own.update(_deepseek_moe_fields(f, family, common, tensors, path))
    if family in ("deepseek_v2", "deepseek_v3", "kimi_linear", "glm_moe_dsa"):
        own.update(_mla_fields(f, common, tensors, path))
    if family == "minicpm3":
        # latent attention as DeepSeek-V2's older files (kv_b_proj whole); LongRoPE's factors as Phi-3's tensors
        own.update(_mla_fields(f, common, tensors, path, value=_minicpm3_value_width(f, common)))
        own.update(_phi3_longrope(f, common, tensors, path))
    log_mul = f.key(_KR.SCALING_YARN_LOG_MUL)
    if family == "ministral3" and common["rope_scaling"].type == "yarn" and log_mul is not None:
        # Ministral3Model writes mscale_all_dim itself; mscale is taken equal to it (no key), as the releases have
        # them (their YaRN then puts no factor on cos/sin)
        mscale = _f32(log_mul)
        own["rope_scaling"] = dataclasses.replace(common["rope_scaling"], mscale=mscale, mscale_all_dim=mscale)
    if family in FAMILIES:
        # The family file reads its config.json keys: from GGUF, those the metadata and tensors give.
        hf, read = _family_hf_config(f, family, common, tensors)
        for field, value in FAMILIES[family].config_fields(hf, str(path)).items():
            own[field] = f.read(field, value, "read" if field in read else "inferred")
        if family == "gemma4":
            own.update(_gemma4_rope(f, common, own, tensors, path))
        if family == "gemma3n":  # the sliding layers' RoPE base (absent: llama.cpp's 10000, unscaled)
            local = f.key(_KR.FREQ_BASE_SWA)
            own["sliding_rope_theta"] = f.read("sliding_rope_theta", _f32(local)) if local else _GEMMA3_LOCAL_THETA
        if family == "mimo_v2_flash" and "sliding_attention" in own["layer_types"]:  # the sliding layers' base
            local = hf["rope_parameters"]["sliding_attention"]["rope_theta"]
            own["sliding_rope_theta"] = f.read(
                "sliding_rope_theta", local, "read" if f.key(_KR.FREQ_BASE_SWA) else "default"
            )
        if family == "gpt_oss" and common["rope_scaling"].type == "yarn":
            # GPT-OSS's YaRN leaves the correction range unrounded (transformers' truncate false, the model's own;
            # llama.cpp rounds it for every model).
            own["rope_scaling"] = dataclasses.replace(common["rope_scaling"], truncate=False)
    return own


def _check_chatglm(common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path) -> None:
    """What a `chatglm` file could hold beyond the block llama.cpp runs (and GLM's): output or MLP biases (ChatGLM's
    add_bias_linear false; llama.cpp loads none) and gate and up apart (llama.cpp reads them fused in `ffn_up`)."""
    for field, kind in (("o_bias", MODEL_TENSOR.ATTN_OUT), ("mlp_bias", MODEL_TENSOR.FFN_UP)):
        if common[field]:
            raise ConfigError(f"{path}: {field} ({_tensor(kind, 0, 'bias')}) is not supported for chatglm")
    if _tensor(MODEL_TENSOR.FFN_GATE, 0) in tensors:
        raise ConfigError(f"{path}: a separate {_tensor(MODEL_TENSOR.FFN_GATE, 0)} is not supported for chatglm")


def _deepseek_moe_fields(
    f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path
) -> dict[str, Any]:
    """The experts of DeepSeek-V3, GLM-4.5 and dots.llm1 as their converters (DeepseekV2Model, Glm4MoeModel,
    Dots1Model) write them: DeepSeek-V3's router (sigmoid gating, the selection bias as `exp_probs_b`, groups where
    the file has the keys, else one), shared experts, the first layers dense; DeepSeek-V2's float32 softmax router
    (keel.config's `_deepseek_v2_router`) for a `deepseek2` file with softmax gating."""
    gating = f.key(_K.EXPERT_GATING_FUNC)
    if family != "deepseek_v2" and gating is not None and int(gating) != int(ExpertGatingFuncType.SIGMOID):
        raise ConfigError(f"{path}: expert gating function {gating} is not supported here (sigmoid only)")
    width = int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH))
    read, layers = f.read, range(common["num_layers"])
    return {
        "num_experts": read("num_experts", int(f.require(_K.EXPERT_COUNT))),
        "num_experts_per_tok": read("num_experts_per_tok", int(f.require(_K.EXPERT_USED_COUNT))),
        "moe_intermediate_size": read("moe_intermediate_size", width),
        "shared_expert_intermediate_size": read(
            "shared_expert_intermediate_size", width * int(f.key(_K.EXPERT_SHARED_COUNT, 0) or 0)
        ),
        "shared_expert_gated": False,
        "mlp_only_layers": read("mlp_only_layers", list(range(int(f.key(_K.LEADING_DENSE_BLOCK_COUNT, 0) or 0)))),
        "router_scoring": "sigmoid",
        "router_bias": read(
            "router_bias", any(_tensor(MODEL_TENSOR.FFN_EXP_PROBS_B, i, "bias") in tensors for i in layers)
        ),
        "n_group": read("n_group", int(f.key(_K.EXPERT_GROUP_COUNT, 1) or 1)),
        "topk_group": read("topk_group", int(f.key(_K.EXPERT_GROUP_USED_COUNT, 1) or 1)),
        "routed_scaling_factor": read("routed_scaling_factor", _f32(f.key(_K.EXPERT_WEIGHTS_SCALE, 1.0))),
        "norm_topk_prob": read("norm_topk_prob", bool(f.key(_K.EXPERT_WEIGHTS_NORM, True))),
        **(DEEPSEEK_V2_ROUTER if family == "deepseek_v2" else {}),
    }


def _mla_fields(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path, value: int | None = None
) -> dict[str, Any]:
    """Multi-head latent attention as llama.cpp's DeepseekV2Model writes it. Current files store it in MQA form (one
    KV head of kv_lora_rank + rope width; the query/key and value widths as `key_length_mla` / `value_length_mla`;
    kv_b_proj split into `attn_k_b`, transposed, and `attn_v_b`); older ones one KV head per query head, the widths
    as `key_length` / `value_length`, and `attn_kv_b` whole. Either way keel's KV heads are the query heads. The
    rotary width is `rope.dimension_count`, on interleaved pairs (llama.cpp stores HF's rows); the converter writes
    0.1 x mscale_all_dim as `rope.scaling.yarn_log_multiplier`, and DeepSeek's mscale equals it (as llama.cpp
    takes it). `value`: the value width where the file has no key for it."""
    read = f.read
    rope = int(f.require(_KR.DIMENSION_COUNT))
    value = f.key(_KA.VALUE_LENGTH_MLA, f.key(_KA.VALUE_LENGTH, value))
    if value is None:
        raise ConfigError(f"{path}: GGUF metadata key {f.name(_KA.VALUE_LENGTH)!r} is missing")
    # (any layer's: Kimi Linear's first latent-attention layer need not be the first)
    low_rank_q = any(_tensor(MODEL_TENSOR.ATTN_Q_A, i) in tensors for i in range(common["num_layers"]))
    out: dict[str, Any] = {
        "num_kv_heads": read("num_kv_heads", common["num_heads"], "inferred"),
        "q_lora_rank": read("q_lora_rank", int(f.require(_KA.Q_LORA_RANK))) if low_rank_q else None,
        "kv_lora_rank": read("kv_lora_rank", int(f.require(_KA.KV_LORA_RANK))),
        "qk_rope_head_dim": read("qk_rope_head_dim", rope),
        "qk_nope_head_dim": read("qk_nope_head_dim", common["head_dim"] - rope),
        "v_head_dim": read("v_head_dim", int(value)),
        "rope_interleave": True,
    }
    log_mul = f.key(_KR.SCALING_YARN_LOG_MUL)
    if common["rope_scaling"].type == "yarn" and log_mul is not None:
        mscale = float(f"{_f32(log_mul) / 0.1:.6g}")  # to the digits a float32 of 0.1 x mscale keeps
        out["rope_scaling"] = dataclasses.replace(common["rope_scaling"], mscale=mscale, mscale_all_dim=mscale)
    return out


# MiniCPM's scalars where an older file has no keys (the releases' scale_emb 12, scale_depth 1.4 and dim_model_base
# 256): the embedding's factor, the residual's over sqrt(layers), and the logits' divisor hidden / 256 (llama.cpp's
# default logit_scale is 256 / hidden, which its Granite graph divides by too: the inverse; keel keeps the releases).
_MINICPM_EMBEDDING_SCALE, _MINICPM_SCALE_DEPTH, _MINICPM_DIM_BASE = 12.0, 1.4, 256


def _minicpm_fields(f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path) -> dict[str, Any]:
    """MiniCPM (`minicpm`) as Granite: llama.cpp builds it with Granite's graph, the embedding times
    `embedding_scale` (scale_emb), each block's output times `residual_scale` (scale_depth / sqrt(layers)), the
    logits over `logit_scale` (hidden / dim_model_base) and the softmax scale 1/sqrt(head size) (no attention.scale
    key: GraniteModel's attention_multiplier); LongRoPE's factors as MiniCPM3's. MiniCPM-MoE is refused."""
    if int(f.key(_K.EXPERT_COUNT, 0) or 0):
        raise ConfigError(f"{path}: MiniCPM with experts ({f.name(_K.EXPERT_COUNT)}) is not supported")
    layers, hidden = common["num_layers"], common["hidden_size"]
    defaults = {
        "embedding_multiplier": _MINICPM_EMBEDDING_SCALE,
        "residual_multiplier": _MINICPM_SCALE_DEPTH / math.sqrt(layers),
        "logits_scaling": hidden / _MINICPM_DIM_BASE,
    }
    own: dict[str, Any] = {}
    for key, _, field in _GRANITE_SCALARS:
        if field == "attention_scale":
            if f.key(key) is not None:  # MiniCPMModel writes none, and llama.cpp does not read one for minicpm
                raise ConfigError(f"{path}: {f.name(key)} is not written for MiniCPM and not supported")
            own[field] = common["head_dim"] ** -0.5
        elif f.key(key) is not None:
            own[field] = f.read(field, _f32(f.key(key)))
        else:
            own[field] = defaults[field]
    kind = f.key(_KR.SCALING_TYPE)
    longrope = _phi3_longrope(f, common, tensors, path)
    if kind == "longrope" and not longrope:
        raise ConfigError(f"{path}: LongRoPE ({f.name(_KR.SCALING_TYPE)}) without its rope_factors tensors")
    return own | longrope


def _phi3_longrope(f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path) -> dict[str, Any]:
    """Phi-3's LongRoPE as its converter stores it: the factors as `rope_factors_long` / `rope_factors_short`
    tensors, the pre-training context and the cos/sin factor as rope.scaling keys (MiniCPM3's converter writes
    neither: llama.cpp's pre-training context is then the context length, switching to the long factors never, and
    its cos/sin factor 1, as transformers' for a factor of 1); {} without the tensors."""
    long_name, short_name = (_tensor(k) for k in (MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT))
    if long_name not in tensors and short_name not in tensors:
        return {}
    if long_name not in tensors or short_name not in tensors:
        raise ConfigError(f"{path}: LongRoPE needs both {long_name!r} and {short_name!r}")
    original = int(f.key(_KR.SCALING_ORIG_CTX_LEN) or common["max_position_embeddings"])
    attention = f.key(_KR.SCALING_ATTN_FACTOR)
    factors = {
        name: tuple(float(x) for x in _to_numpy(tensors[name], path).reshape(-1)) for name in (long_name, short_name)
    }
    scaling = RopeScaling(
        type="longrope",
        factor=common["max_position_embeddings"] / original,
        original_max_position_embeddings=original,
        attention_factor=None if attention is None else _f32(attention),
        short_factor=factors[short_name],
        long_factor=factors[long_name],
    )
    return {"rope_scaling": f.read("rope_scaling", scaling, "read")}


def _family_hf_config(
    f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """The config.json keys a keel.families module reads, as llama.cpp takes them from a GGUF file of the
    family, and the config fields that then come from metadata keys (provenance "read")."""
    has = lambda kind, suffix="weight": _tensor(kind, 0, suffix) in tensors  # noqa: E731
    layers, hidden, heads, head_dim = (common[k] for k in ("num_layers", "hidden_size", "num_heads", "head_dim"))
    hf: dict[str, Any] = dict(attention_bias=common["qkv_bias"], num_hidden_layers=layers, hidden_size=hidden)
    read: set[str] = set()
    if family in ("gemma2", "gemma3"):
        # llama.cpp's softmax scale (no key): (hidden / heads)^-1/2 for the 27B models, head_dim^-1/2 otherwise.
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[family] else head_dim
        hf.update(query_pre_attn_scalar=scalar, tie_word_embeddings=common["tie_word_embeddings"])
        for field, key in (
            ("final_logit_softcapping", _K.FINAL_LOGIT_SOFTCAPPING),
            ("attn_logit_softcapping", _K.ATTN_LOGIT_SOFTCAPPING),
        ):
            if f.key(key) is not None:  # absent: llama.cpp's default (Gemma 2: 30 and 50; Gemma 3: none)
                hf[field] = _f32(f.key(key))
                read.add(field)
        window = f.key(_KA.SLIDING_WINDOW)
        read |= {"sliding_window", "layer_types"} if window is not None else set()
    if family == "gemma2":
        hf.update(sliding_window=int(window) if window is not None else _GEMMA2_WINDOW)
    if family == "gemma3":
        hf.update(sliding_window=int(window) if window else None)  # absent or 0: every layer global
        hf.update(_sliding_pattern(f.key(_KA.SLIDING_WINDOW_PATTERN), _GEMMA3_PATTERN))
        local = f.key(_KR.FREQ_BASE_SWA)
        hf.update(rope_local_base_freq=_f32(local) if local is not None else _GEMMA3_LOCAL_THETA)
        read |= {"sliding_rope_theta"} if local is not None else set()
    if family in ("granitemoe", "granitemoeshared", "granitemoehybrid"):
        # GraniteModel's four scalars, each written only where config.json has it (1 where absent)
        for key, name, field in _GRANITE_SCALARS:
            if f.key(key):
                hf[name] = _f32(f.key(key))
                read.add(field)
    if family in ("granitemoe", "granitemoeshared"):  # GraniteMoeModel: LlamaModel's expert keys; the shared
        # expert's width under the key Qwen2-MoE's files use too
        if family == "granitemoeshared":  # absent: from the shared down projection, ggml shape [S, H]
            width = f.key(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH)
            down = tensors[_tensor(MODEL_TENSOR.FFN_DOWN_SHEXP, 0)]
            hf["shared_intermediate_size"] = int(width) if width is not None else int(down.shape[0])
            read |= {"shared_expert_intermediate_size"} if width is not None else set()
        hf.update(
            num_local_experts=int(f.require(_K.EXPERT_COUNT)),
            num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
            intermediate_size=common["intermediate_size"],  # the experts' width (feed_forward_length)
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"}
    if family == "llama4":
        # Llama4Model: the experts' width and the MoE step as keys, the dense width as feed_forward_length. llama.cpp
        # has no keys for the rest and fixes them: chunks of 8192 and a NoPE layer every fourth (a window key of 0:
        # neither, every layer global and rotating), the temperature's defaults, and the q/k norm for every model but
        # the 128-expert one (Maverick's config has none).
        experts = int(f.require(_K.EXPERT_COUNT))
        plain = f.key(_KA.SLIDING_WINDOW) is not None and int(f.key(_KA.SLIDING_WINDOW)) == 0
        hf.update(
            intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
            intermediate_size_mlp=common["intermediate_size"],
            num_local_experts=experts,
            num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
            interleave_moe_layer_step=int(f.key(_K.INTERLEAVE_MOE_LAYER_STEP, 1) or 1),
            use_qk_norm=experts != _LLAMA4_MAVERICK_EXPERTS,
            attention_chunk_size=None if plain else _LLAMA4_CHUNK,
            no_rope_layers=[1] * layers if plain else None,
        )
        read |= {"moe_intermediate_size", "intermediate_size", "num_experts", "num_experts_per_tok", "mlp_only_layers"}
    if family == "gemma":  # the tanh GELU, the head tied unless an output tensor is stored
        hf.update(tie_word_embeddings=common["tie_word_embeddings"])
    if family in _PARTIAL_ROTARY:
        rope_dims = f.key(_KR.DIMENSION_COUNT)
        factor = _rotary_factor(int(rope_dims), head_dim) if rope_dims is not None else None
        read |= {"partial_rotary_factor"} if factor is not None else set()
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
        read |= {"rope_theta"} if f.key(_KR.FREQ_BASE) is not None else set()
        hf.update(layer_norm_eps=common["rms_norm_eps"])
    if family == "stablelm":
        # The parallel residual has no norm before the MLP: as llama.cpp and transformers, from the tensors
        # (the converter's use_parallel_residual key defaults to true where config.json lacks it).
        hf.update(use_qkv_bias=common["qkv_bias"], use_parallel_residual=not has(MODEL_TENSOR.FFN_NORM))
        hf.update(qk_layernorm=has(MODEL_TENSOR.ATTN_Q_NORM))
        if factor is not None:
            hf.update(partial_rotary_factor=factor)
    if family in ("phi", "nemotron") and factor is not None:  # Phi2Model and NemotronModel write the rotary width
        hf.update(partial_rotary_factor=factor)
    if family == "phi3":  # Phi-4-mini rotates 3/4 of each head: Phi3MiniModel writes that width
        rope_dims = f.key(_KR.DIMENSION_COUNT)
        if rope_dims is not None:
            hf.update(partial_rotary_factor=_rotary_factor(int(rope_dims), head_dim))
            read.add("partial_rotary_factor")
    if family == "smollm3":  # llama.cpp: a NoPE layer every fourth (no key), no sliding window; biases by tensor
        hf.update(mlp_bias=common["mlp_bias"])
    if family in ("exaone4", "exaone_moe"):  # Exaone4Model's keys, and its subclass ExaoneMoEModel's
        # The converter writes the window and the per-layer pattern where config.json has them; llama.cpp
        # hard-codes both for EXAONE 4's 64-layer (32B) model, whose files may lack them.
        window, pattern = f.key(_KA.SLIDING_WINDOW), f.key(_KA.SLIDING_WINDOW_PATTERN)
        read |= {"sliding_window", "layer_types", "rope_layers"} if window is not None else set()
        if window is None and layers == _EXAONE4_SWA_LAYERS and family == "exaone4":
            window = _EXAONE4_WINDOW
        hf.update(sliding_window=int(window) if window else None, **_sliding_pattern(pattern))
        hf.update(tie_word_embeddings=common["tie_word_embeddings"])
    if family in ("cohere", "cohere2"):
        # logit_scale (llama.cpp's default 1 where absent); q/k norms per head where the tensors are (Command R+)
        scale = f.key(_K.LOGIT_SCALE)
        read |= {"logits_scaling"} if scale is not None else set()
        hf.update(logit_scale=_f32(scale) if scale is not None else 1.0, use_qk_norm=has(MODEL_TENSOR.ATTN_Q_NORM))
        hf.update(layer_norm_eps=common["rms_norm_eps"], tie_word_embeddings=common["tie_word_embeddings"])
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
    if family == "cohere2":  # the window key; llama.cpp's pattern key where written, else one global layer in four
        window, pattern = f.key(_KA.SLIDING_WINDOW), f.key(_KA.SLIDING_WINDOW_PATTERN)
        hf.update(sliding_window=int(window) if window else None, **_sliding_pattern(pattern))
        read |= {"sliding_window", "layer_types", "rope_layers"} if window is not None else set()
    if family == "starcoder2":  # biases by tensor; no window key (llama.cpp attends over the whole context)
        hf.update(use_bias=common["qkv_bias"], norm_epsilon=common["rms_norm_eps"])
        hf.update(tie_word_embeddings=common["tie_word_embeddings"])
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
    if family in ("lfm2", "lfm2_moe"):
        # LFM2Model and LFM2MoeModel: no layer_types key; the KV head count per layer is 0 for a convolution layer
        # (llama.cpp's recurrent layers). The MLP width as written (LFM2's adjusted, LFM2 MoE's dense one never is),
        # the kernel width as shortconv.l_cache; the convolutions' biases by tensor (the releases have none, and
        # llama.cpp reads none).
        if family == "lfm2" and _tensor(MODEL_TENSOR.DENSE_2_OUT) in tensors:  # LFM2-ColBert: for retrieval, no LM
            raise ConfigError(
                f"{f.meta.path}: an lfm2 file with {_tensor(MODEL_TENSOR.DENSE_2_OUT)!r} (LFM2-ColBert) "
                "is a retrieval model, not supported"
            )
        kv_heads = f.key(_KA.HEAD_COUNT_KV)
        per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
        if len(per_layer) != layers:
            raise ConfigError(f"{f.meta.path}: {f.name(_KA.HEAD_COUNT_KV)} lists {len(per_layer)} layers, not {layers}")
        kernel = f.key(Keys.ShortConv.L_CACHE)
        hf.update(
            layer_types=["full_attention" if n != 0 else "conv" for n in per_layer],
            norm_eps=common["rms_norm_eps"],
            intermediate_size=common["intermediate_size"],
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=common["tie_word_embeddings"],
            conv_bias=any(_tensor(MODEL_TENSOR.SHORTCONV_INPROJ, i, "bias") in tensors for i in range(layers)),
        )
        read |= {"intermediate_size"} | ({"rms_norm_eps"} if f.key(_KA.LAYERNORM_RMS_EPS) is not None else set())
        read |= {"layer_types"} if isinstance(kv_heads, list) else set()
        if kernel is not None:
            hf.update(conv_L_cache=int(kernel))
            read.add("short_conv_kernel")
    if family == "lfm2_moe":
        # LFM2MoeModel: the dense layers' width unadjusted (feed_forward_length), the experts' and the leading dense
        # count as keys (absent: llama.cpp's 0), the selection bias by tensor. No key for norm_topk_prob or
        # routed_scaling_factor: llama.cpp always renormalises the chosen scores and never scales them (the
        # releases' values), and so does keel.
        gating = f.key(_K.EXPERT_GATING_FUNC)
        if gating is not None and int(gating) != int(ExpertGatingFuncType.SIGMOID):
            raise ConfigError(
                f"{f.meta.path}: {f.name(_K.EXPERT_GATING_FUNC)} {gating} is not supported for lfm2moe (sigmoid only)"
            )
        dense = f.key(_K.LEADING_DENSE_BLOCK_COUNT)
        hf.update(
            num_experts=int(f.require(_K.EXPERT_COUNT)),
            num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
            num_dense_layers=int(dense or 0),
            use_expert_bias=any(_tensor(MODEL_TENSOR.FFN_EXP_PROBS_B, i, "bias") in tensors for i in range(layers)),
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size"}
        read |= {"mlp_only_layers"} if dense is not None else set()
    hf.update(_table_hf_config(f, family, common, tensors))
    read |= _TABLE_READ.get(family, set()) | ({"clip_qkv"} if family == "olmo" and f.key(_KA.CLAMP_KQV) else set())
    read |= {"rms_norm_eps"} if family == "jais2" and f.key(_KA.LAYERNORM_EPS) is not None else set()
    if family in ("ernie4_5", "ernie4_5_moe"):  # biases by tensor; the head tied where no output tensor
        hf.update(use_bias=common["qkv_bias"], tie_word_embeddings=common["tie_word_embeddings"])
    if family == "ernie4_5_moe":  # Ernie4_5MoeModel's keys (no end index: experts to the last layer)
        hf.update(
            moe_num_experts=int(f.require(_K.EXPERT_COUNT)),
            moe_k=int(f.require(_K.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
            moe_num_shared_experts=int(f.key(_K.EXPERT_SHARED_COUNT, 0) or 0),
            moe_layer_start_index=int(f.key(_K.LEADING_DENSE_BLOCK_COUNT, 1) or 0),
            moe_layer_interval=int(f.key(_K.INTERLEAVE_MOE_LAYER_STEP, 1) or 1),
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers"}
    if family in ("glm", "glm4", "glm4_moe"):  # the rotary width (half of each head); biases by tensor
        rope_dims = f.key(_KR.DIMENSION_COUNT)
        if rope_dims is not None:
            hf.update(partial_rotary_factor=_rotary_factor(int(rope_dims), head_dim))
            read.add("partial_rotary_factor")
    if family == "glm4_moe":  # q/k norms by tensor
        hf.update(use_qk_norm=common["qk_norm"])
    if family == "gpt_oss":  # the window (every other layer slides, as llama.cpp and transformers place them)
        window = f.key(_KA.SLIDING_WINDOW)
        read |= {"sliding_window", "layer_types"} if window is not None else set()
        hf.update(
            sliding_window=int(window) if window else None,
            num_local_experts=int(f.require(_K.EXPERT_COUNT)),
            num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
            intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"}
    if family == "granitemoehybrid":
        own, own_read = _granite_hybrid_hf_config(f, common, tensors)
        hf.update(own)
        read |= own_read
    if family == "falcon_h1":  # the multipliers folded into the weights (absent: 1); biases and the norm by tensor
        has_any = lambda kind, suffix: any(_tensor(kind, i, suffix) in tensors for i in range(layers))  # noqa: E731
        hf.update(
            _mamba2_hf_config(f, common, tensors),
            mamba_d_ssm=int(f.require(Keys.SSM.INNER_SIZE)),
            projectors_bias=has_any(MODEL_TENSOR.SSM_OUT, "bias"),
            mamba_rms_norm=has_any(MODEL_TENSOR.SSM_NORM, "weight"),
            mamba_norm_before_gate=False,  # llama.cpp gates, then norms
            mlp_bias=common["mlp_bias"],
            num_attention_heads=heads,
            head_dim=head_dim,
        )
        read |= {"mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"}
    if family == "jamba":
        hf.update(_jamba_hf_config(f, common, tensors))
        read |= {"layer_types", "mamba_d_inner", "mamba_dt_rank", "mamba_d_state", "mamba_d_conv", "num_experts"}
        read |= {"num_experts_per_tok"}
    if family == "dbrx":
        # DbrxModel: the nested keys of its config.json from its own (clamp_kqv always written: the releases' 8)
        clamp = f.key(_KA.CLAMP_KQV)
        hf.update(
            attn_config={
                "kv_n_heads": common["num_kv_heads"],
                "clip_qkv": None if clamp is None else _f32(clamp),
                "rope_theta": common["rope_theta"],
            },
            ffn_config={
                "ffn_hidden_size": common["intermediate_size"],
                "moe_num_experts": int(f.require(_K.EXPERT_COUNT)),
                "moe_top_k": int(f.require(_K.EXPERT_USED_COUNT)),
            },
            tie_word_embeddings=common["tie_word_embeddings"],  # (refused: DBRX has a head of its own)
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"}
        read |= {"clip_qkv"} if clamp is not None else set()
    if family in ("gpt_bigcode", "gpt2", "falcon"):
        hf.update(_classic_hf_config(f, family, common, tensors))
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
    if family in ("bloom", "mpt"):
        hf.update(_alibi_hf_config(f, family, common, tensors))
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
        read |= {"alibi_bias_max"} if family == "mpt" else set()
        read |= {"clip_qkv"} if family == "mpt" and f.key(_KA.CLAMP_KQV) is not None else set()
    if family in _OWN_HF_CONFIG:  # the family's keys and the fields they give, from a reader of its own
        own, own_read = _OWN_HF_CONFIG[family](f, common, tensors)
        hf.update(own)
        read |= own_read
    if family == "gptj":
        # GPTJModel: feed_forward_length always 4 x hidden (the MLP's width from `ffn_up`), the rotary width only where
        # partial, q/k rows as in HF (llama.cpp rotates their interleaved pairs, keel regroups them as for safetensors)
        rope_dims, up = f.key(_KR.DIMENSION_COUNT), tensors.get(_tensor(MODEL_TENSOR.FFN_UP, 0))
        hf.update(
            num_attention_heads=heads,
            rotary_dim=int(rope_dims) if rope_dims is not None else None,
            n_inner=int(up.shape[-1]) if up is not None else common["intermediate_size"],
        )
        read |= {"partial_rotary_factor"} if rope_dims is not None else set()
        read |= {"rms_norm_eps"} if f.key(_KA.LAYERNORM_EPS) is not None else set()
    if family in ("mamba", "mamba2"):
        hf.update(_mamba_hf_config(f, family, common, tensors))
        read |= {"mamba_d_state", "mamba_d_conv", "rms_norm_eps"}
        read |= {"mamba_d_inner", "mamba_dt_rank"} if family == "mamba" else {"mamba_n_heads", "mamba_d_head"}
        read |= {"mamba_n_groups"} if family == "mamba2" else set()
    if family in _QWEN_HYBRID:
        hf.update(_gated_deltanet_hf_config(f, common))
        read |= {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"}
        read |= {"linear_conv_kernel_dim"} | ({"layer_types"} if f.key(_K.FULL_ATTENTION_INTERVAL) else set())
        read |= {"partial_rotary_factor"} if f.key(_KR.DIMENSION_COUNT) is not None else set()
    if family == "gpt_neox":
        parallel = f.key(_K.USE_PARALLEL_RESIDUAL)
        if parallel is not None:
            hf.update(use_parallel_residual=bool(parallel))
            read.add("parallel_residual")
        hf.update(num_attention_heads=heads, rope_theta=common["rope_theta"])
        if factor is not None:
            hf.update(rotary_pct=factor)
    return hf, read


# llama.cpp's MiniCPM3 graph: muP's scalars as MiniCPM3-4B has them (its files hold none).
_MINICPM3_SCALARS = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}
# The config fields whose metadata keys _table_hf_config reads (provenance "read").
_TABLE_READ = {
    "olmoe": {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"},
    "phimoe": {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"},
    "minimax_m2": {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"},
    "hunyuan_v1_moe": {
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    },
}


def _minicpm3_value_width(f: _Fields, common: dict[str, Any]) -> int:
    """MiniCPM3's value width: MiniCPM3Model writes no key for it; llama.cpp's default, hidden / heads, as the config
    class's where config.json has none (MiniCPM3-4B's)."""
    return int(f.key(_KA.VALUE_LENGTH, common["hidden_size"] // common["num_heads"]))


def _table_hf_config(f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """The config.json keys of the families whose converters write TextModel's keys and little more: biases by
    tensor, the experts' counts as TextModel writes them (their width as feed_forward_length), and what llama.cpp
    fixes where the file has no key."""
    bias = dict(attention_bias=common["qkv_bias"], mlp_bias=common["mlp_bias"])
    experts = lambda key: dict(  # noqa: E731
        **{key: int(f.require(_K.EXPERT_COUNT))},
        num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
        intermediate_size=common["intermediate_size"],
    )
    if family == "olmo":  # OlmoModel: clip_qkv as clamp_kqv where config.json has it
        clamp = f.key(_KA.CLAMP_KQV)
        return dict(attention_bias=common["qkv_bias"], clip_qkv=None if clamp is None else _f32(clamp))
    if family == "olmoe":
        # OlmoeModel writes neither clip_qkv nor norm_topk_prob: llama.cpp clamps nothing and never renormalises the
        # chosen scores (OLMoE-1B-7B's null and false), and so does keel.
        return dict(**experts("num_experts"), attention_bias=common["qkv_bias"], norm_topk_prob=False, clip_qkv=None)
    if family == "phimoe":
        # PhiMoeModel (Phi3MiniModel's keys). No key for the router's jitter: the family default, the released
        # model's 0.01 (llama.cpp routes by a plain softmax over the top two instead of SparseMixer).
        head_bias = _tensor(MODEL_TENSOR.OUTPUT, None, "bias") in tensors
        return dict(**experts("num_local_experts"), attention_bias=common["qkv_bias"], lm_head_bias=head_bias)
    if family == "seed_oss":  # SeedOssModel: TextModel's keys only
        return dict(**bias, attention_out_bias=common["o_bias"])
    if family == "apertus":  # ApertusModel: xIELU's parameters as metadata lists, one value per layer
        for key in _XIELU:
            values = f.meta.get(key)
            if not isinstance(values, list) or len(values) != common["num_layers"]:
                raise ConfigError(f"{f.meta.path}: GGUF metadata key {key!r} must list one value per layer")
        return bias
    if family == "minicpm3":
        # MiniCPM3Model writes none of muP's scalars: llama.cpp's graph fixes them at the release's (scale_emb 12,
        # scale_depth 1.4, dim_model_base 256), and so does keel
        heads = common["num_heads"]
        return dict(
            num_attention_heads=heads,
            v_head_dim=_minicpm3_value_width(f, common),
            tie_word_embeddings=common["tie_word_embeddings"],
            **_MINICPM3_SCALARS,
        )
    if family == "hunyuan_v1_moe":
        # HunYuanMoEModel: the experts' counts and widths as keys (the config's per-layer lists, uniform, as their first
        # value; the shared MLP's width is intermediate_size), which the family checks as it checks config.json's
        return dict(
            num_experts=int(f.require(_K.EXPERT_COUNT)),
            moe_topk=int(f.require(_K.EXPERT_USED_COUNT)),
            intermediate_size=int(f.key(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH, common["intermediate_size"])),
            moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
            num_shared_expert=int(f.key(_K.EXPERT_SHARED_COUNT, 1)),
        )
    if family == "exaone_moe":
        # ExaoneMoEModel: DeepSeek-V3's expert keys (_deepseek_moe_fields); the dense layers by tensor (no router),
        # as leading_dense_block_count counts the first only (the family's mlp_layer_types may name others)
        width = int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH))
        routed = [_tensor(MODEL_TENSOR.FFN_GATE_INP, i) in tensors for i in range(common["num_layers"])]
        return dict(
            num_experts=int(f.require(_K.EXPERT_COUNT)),
            moe_intermediate_size=width,
            num_shared_experts=int(f.key(_K.EXPERT_SHARED_COUNT, 0) or 0),
            mlp_layer_types=["sparse" if r else "dense" for r in routed],
        )
    if family in ("arcee", "exaone"):  # ExaoneModel: TextModel's keys and the rotary width (the head size)
        return bias
    if family == "minimax_m2":
        # MiniMaxM2Model: the experts' width and the rotary width as keys, sigmoid gating; llama.cpp always
        # renormalises the chosen scores (the family's norm_topk_prob)
        gating = f.key(_K.EXPERT_GATING_FUNC)
        if gating is not None and int(gating) != int(ExpertGatingFuncType.SIGMOID):
            raise ConfigError(
                f"{f.meta.path}: {f.name(_K.EXPERT_GATING_FUNC)} {gating} is not supported (sigmoid only)"
            )
        width = int(f.key(_K.EXPERT_FEED_FORWARD_LENGTH, common["intermediate_size"]))
        return dict(
            **{**experts("num_local_experts"), "intermediate_size": width},
            head_dim=common["head_dim"],
            rotary_dim=int(f.key(_KR.DIMENSION_COUNT, common["head_dim"])),
        )
    if family == "ministral3":
        # Ministral3Model (LlamaModel): YaRN's keys, with mscale_all_dim as yarn_log_multiplier (not 0.1 x it, as
        # DeepSeek's) and Llama 4's temperature as attention.temperature_scale over the YaRN's pre-training context
        beta = f.key(_KA.TEMPERATURE_SCALE)
        original = f.key(_KR.SCALING_ORIG_CTX_LEN)
        rope = {} if beta is None else dict(llama_4_scaling_beta=_f32(beta), original_max_position_embeddings=original)
        return dict(rope_parameters=rope)
    if family == "jais2":  # Jais2Model: TextModel's keys (the eps as layer_norm_eps) and the rotary width
        return dict(**bias, layer_norm_eps=common["rms_norm_eps"])
    if family == "nemotron":  # NemotronModel: the norms written plus 1 (taken off on load), their eps as layer_norm_eps
        return dict(**bias, norm_eps=common["rms_norm_eps"])
    return {}


def _gated_deltanet_hf_config(f: _Fields, common: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's and Qwen3-Next's config.json keys as Qwen3NextModel writes them: the Gated DeltaNet's shape as
    `ssm.*` keys (key heads as the group count, value heads as the time-step rank, the key head size as the state
    size, all value heads' width as the inner size), the layer kinds as `full_attention_interval` (absent: llama.cpp's
    4), the rotary width; and the experts as read (_moe_fields)."""
    value_heads = int(f.require(Keys.SSM.TIME_STEP_RANK))
    interval = f.key(_K.FULL_ATTENTION_INTERVAL)
    rope_dims = f.key(_KR.DIMENSION_COUNT)
    hf: dict[str, Any] = dict(
        linear_num_key_heads=int(f.require(Keys.SSM.GROUP_COUNT)),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=int(f.require(Keys.SSM.STATE_SIZE)),
        linear_value_head_dim=int(f.require(Keys.SSM.INNER_SIZE)) // value_heads,
        linear_conv_kernel_dim=int(f.require(Keys.SSM.CONV_KERNEL)),
        full_attention_interval=int(interval) if interval else _FULL_ATTENTION_INTERVAL,
    )
    if rope_dims is not None:
        hf["partial_rotary_factor"] = _rotary_factor(int(rope_dims), common["head_dim"])
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    if common.get("num_experts"):
        hf.update({key: common[key] for key in (*moe, "norm_topk_prob", "intermediate_size", "mlp_only_layers")})
    return hf


def _granite_hybrid_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """Granite 4.0-H's config.json keys as GraniteHybridModel (on Mamba2Model and GraniteMoeModel) writes them: the
    layer kinds as the KV head count per layer (0 for a mamba layer); the mixer's shape as ssm.* keys (its heads as
    the time-step rank, all heads' width as the inner size); the experts as Granite MoE's (none: expert_count 0 or
    absent, the shared MLP then stored as the dense ffn_*), the shared MLP's width as expert_shared_feed_forward_length
    (absent: from its down projection); biases by tensor. No position encoding: the converter writes
    rope.scaling.finetuned false for every hybrid (llama.cpp then rotates nothing, whatever position_embedding_type
    was); true marks Bamba's files, refused here."""
    path, layers = f.meta.path, common["num_layers"]
    if f.key(_KR.SCALING_FINETUNED):
        raise ConfigError(
            f"{path}: a granitehybrid file with {f.name(_KR.SCALING_FINETUNED)} true (rotary attention: "
            "BambaForCausalLM's) is not supported"
        )
    kv_heads = f.require(_KA.HEAD_COUNT_KV)
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(per_layer) != layers:
        raise ConfigError(f"{path}: {f.name(_KA.HEAD_COUNT_KV)} lists {len(per_layer)} layers, not {layers}")
    experts = int(f.key(_K.EXPERT_COUNT, 0) or 0)
    width = f.key(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH)
    if width is None:  # ggml shape [S, H]
        down = tensors.get(_tensor(MODEL_TENSOR.FFN_DOWN_SHEXP if experts else MODEL_TENSOR.FFN_DOWN, 0))
        if down is None:
            raise ConfigError(
                f"{path}: cannot tell the shared MLP's width (no {f.name(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH)})"
            )
        width = down.shape[0]
    hf: dict[str, Any] = dict(
        _mamba2_hf_config(f, common, tensors),
        layer_types=["attention" if n else "mamba" for n in per_layer],
        position_embedding_type=None,
        num_local_experts=experts,
        intermediate_size=common["intermediate_size"],  # the experts' width (feed_forward_length)
        shared_intermediate_size=int(width),
    )
    read = {"layer_types", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"}
    if experts:
        hf["num_experts_per_tok"] = int(f.require(_K.EXPERT_USED_COUNT))
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"}
    return hf, read


def _mamba2_hf_config(f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """A Mamba 2 mixer's config.json keys as Mamba2Model writes them: its heads as the time-step rank, all heads'
    width as the inner size, the groups, state size and kernel as ssm.* keys; its biases by tensor."""
    heads, inner = int(f.require(Keys.SSM.TIME_STEP_RANK)), int(f.require(Keys.SSM.INNER_SIZE))
    layers = range(common["num_layers"])
    any_layer = lambda kind, suffix: any(_tensor(kind, i, suffix) in tensors for i in layers)  # noqa: E731
    return dict(
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_expand=inner // common["hidden_size"],
        mamba_n_groups=int(f.require(Keys.SSM.GROUP_COUNT)),
        mamba_d_state=int(f.require(Keys.SSM.STATE_SIZE)),
        mamba_d_conv=int(f.require(Keys.SSM.CONV_KERNEL)),
        mamba_conv_bias=any_layer(MODEL_TENSOR.SSM_CONV1D, "bias"),
        mamba_proj_bias=any_layer(MODEL_TENSOR.SSM_IN, "bias"),
    )


def _jamba_hf_config(f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """Jamba's config.json keys as JambaModel writes them: the attention layers as the per-layer KV head count (0 for
    a Mamba layer), the expert layers by tensor (no key: those with a router), each as every k-th layer from an offset
    (as the family's keys give them; other patterns refused), the Mamba 1 mixer's width, state, kernel and step rank
    as ssm.* keys, the experts' counts; the biases by tensor."""
    from keel.families.jamba import _period

    path, layers, hidden = f.meta.path, common["num_layers"], common["hidden_size"]
    kv_heads = f.require(_KA.HEAD_COUNT_KV)
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(per_layer) != layers:
        raise ConfigError(f"{path}: {f.name(_KA.HEAD_COUNT_KV)} lists {len(per_layer)} layers, not {layers}")
    routed = [_tensor(MODEL_TENSOR.FFN_GATE_INP, i) in tensors for i in range(layers)]
    any_layer = lambda kind, suffix: any(_tensor(kind, i, suffix) in tensors for i in range(layers))  # noqa: E731
    try:
        attn_period, attn_offset = _period([bool(n) for n in per_layer])
        expert_period, expert_offset = _period(routed) if any(routed) else (2, 1)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return dict(
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        expert_layer_period=expert_period,
        expert_layer_offset=expert_offset,
        num_experts=int(f.key(_K.EXPERT_COUNT, 1) or 1) if any(routed) else 1,
        num_experts_per_tok=int(f.key(_K.EXPERT_USED_COUNT, 2) or 2),
        intermediate_size=common["intermediate_size"],
        num_key_value_heads=common["num_kv_heads"],
        mamba_expand=int(f.require(Keys.SSM.INNER_SIZE)) // hidden,
        mamba_dt_rank=int(f.require(Keys.SSM.TIME_STEP_RANK)),
        mamba_d_state=int(f.require(Keys.SSM.STATE_SIZE)),
        mamba_d_conv=int(f.require(Keys.SSM.CONV_KERNEL)),
        mamba_conv_bias=any_layer(MODEL_TENSOR.SSM_CONV1D, "bias"),
        mamba_proj_bias=any_layer(MODEL_TENSOR.SSM_IN, "bias"),
        rms_norm_eps=common["rms_norm_eps"],
    )


def _classic_hf_config(
    f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> dict[str, Any]:
    """GPT-BigCode's, GPT-2's and Falcon's config.json keys as StarCoderModel, GPT2Model and FalconModel write them:
    the LayerNorms' eps, the heads (StarCoderModel's KV head count always 1; GPT-2 none: all), q/k/v fused in
    `attn_qkv` as all q, then k, then v (GPT2Model's Conv1D weights transposed to Linear's, FalconModel's groups
    regrouped), learned positions as `position_embd` (GPT-2, GPT-BigCode). Each writes feed_forward_length as
    4 x hidden whatever the model's: the MLP's width from `ffn_up`; biases by tensor; nothing of the softmax scale
    (GPT-2's per-layer one, GPT-BigCode's scale_attn_weights: llama.cpp's 1/sqrt(head size)). Falcon: its block
    parallel (llama.cpp runs no other), with two norms where `attn_norm_2` is stored (new_decoder_architecture),
    rotary (FalconModel writes nothing of ALiBi: llama.cpp rotates every Falcon). A GPT-BigCode file whose `attn_qkv`
    holds as many keys as queries (multi_query false: StarCoderModel still writes one KV head, and llama.cpp reads
    the rows as one) is refused."""
    path, heads, head_dim = f.meta.path, common["num_heads"], common["head_dim"]
    qkv, up = tensors.get(_tensor(MODEL_TENSOR.ATTN_QKV, 0)), tensors.get(_tensor(MODEL_TENSOR.FFN_UP, 0))
    if qkv is None or up is None:
        raise ConfigError(
            f"{path}: {_tensor(MODEL_TENSOR.ATTN_QKV, 0)!r} and {_tensor(MODEL_TENSOR.FFN_UP, 0)!r} needed"
        )
    rows, kv_heads = int(qkv.shape[1]), common["num_kv_heads"]  # ggml shape [H, rows]
    if rows != (heads + 2 * kv_heads) * head_dim:
        raise ConfigError(
            f"{path}: {_tensor(MODEL_TENSOR.ATTN_QKV, 0)!r} has {rows} rows, not {heads} query and {kv_heads} "
            f"key/value heads of {head_dim} (KV heads other than {f.name(_KA.HEAD_COUNT_KV)} says: GPT-BigCode without "
            "multi_query, as StarCoderModel writes it, is not supported)"
        )
    hf: dict[str, Any] = dict(
        layer_norm_epsilon=common["rms_norm_eps"],
        tie_word_embeddings=common["tie_word_embeddings"],
        num_attention_heads=heads,
    )
    width = int(up.shape[1])
    if family == "falcon":
        two_norms = _tensor(MODEL_TENSOR.ATTN_NORM_2, 0) in tensors
        return dict(
            hf,
            new_decoder_architecture=two_norms or kv_heads not in (1, heads),
            num_kv_heads=kv_heads,
            multi_query=kv_heads == 1,
            parallel_attn=True,
            num_ln_in_parallel_attn=2 if two_norms else 1,
            bias=common["qkv_bias"],
            ffn_hidden_size=width,
            alibi=False,
        )
    return dict(hf, n_inner=width, multi_query=kv_heads == 1)


def _alibi_hf_config(f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """BLOOM's and MPT's config.json keys as BloomModel and MPTModel write them: the LayerNorms' eps, the heads, q/k/v
    fused in `attn_qkv` as all q, then k, then v (BloomModel regroups its per-head rows; MPT's Wqkv is stored so).
    BLOOM: its MLP 4 x hidden, the head as stored (BloomModel writes the embedding again as `output` where there is
    no head: the same logits). MPT: `max_alibi_bias` (0: no ALiBi, refused by the family), `clamp_kqv` where set,
    nothing of softmax_scale (llama.cpp's 1/sqrt(head size)) and feed_forward_length 4 x d_model whatever the
    model's (the MLP's width from `ffn_up`); a file whose norms have biases, or q/k norms (qk_ln), or fewer KV heads
    than heads, is refused by the family's names."""
    heads = common["num_heads"]
    hf: dict[str, Any] = dict(num_attention_heads=heads, layer_norm_epsilon=common["rms_norm_eps"])
    if family == "bloom":
        return dict(hf, tie_word_embeddings=common["tie_word_embeddings"])
    up = tensors.get(_tensor(MODEL_TENSOR.FFN_UP, 0))
    if up is None:
        raise ConfigError(f"{f.meta.path}: {_tensor(MODEL_TENSOR.FFN_UP, 0)!r} needed")
    clamp = f.key(_KA.CLAMP_KQV)
    alibi_max = _f32(f.require(_KA.MAX_ALIBI_BIAS))
    attn_config = {
        "alibi": alibi_max > 0,
        "alibi_bias_max": alibi_max,
        "clip_qkv": None if clamp is None else _f32(clamp),
        "qk_ln": _tensor(MODEL_TENSOR.ATTN_Q_NORM, 0) in tensors,
        "attn_type": "multihead_attention" if common["num_kv_heads"] == heads else "grouped_query_attention",
    }
    return dict(
        hf,
        attn_config=attn_config,
        expansion_ratio=int(up.shape[1]) // common["hidden_size"],
        no_bias=_tensor(MODEL_TENSOR.ATTN_NORM, 0, "bias") not in tensors and not common["qkv_bias"],
    )


def _gemma3n_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """Gemma 3n's config.json keys as Gemma3NModel (on Gemma3Model) writes them: the MLP widths per layer (the family
    refuses different ones), the window and the per-layer pattern (absent: llama.cpp's one global layer in five, the
    family's default), the final soft-cap where written, AltUp's copies and active one, the per-layer inputs' width,
    the KV-sharing layers, and the sparsity as the normal quantile of each layer's target (its CDF taken back here;
    -inf: a dense layer). By tensor: LAuReL's rank (`laurel_l`), AltUp's output scale (`altup_correct_scale`: HF stores
    the parameter whatever altup_correct_scale says, and llama.cpp always applies it, the releases' true) and the
    per-layer table's rows (the converter pads HF's table with zero rows to the vocabulary: ids past HF's table read
    zeros, as llama.cpp runs them, where transformers reads its row 0)."""
    layers = common["num_layers"]
    window, pattern = f.key(_KA.SLIDING_WINDOW), f.key(_KA.SLIDING_WINDOW_PATTERN)
    cap, scales = f.key(_K.FINAL_LOGIT_SOFTCAPPING), f.key(_K.ACTIVATION_SPARSITY_SCALE)
    table = tensors.get(_tensor(MODEL_TENSOR.PER_LAYER_TOKEN_EMBD))
    laurel = tensors.get(_tensor(MODEL_TENSOR.LAUREL_L, 0))
    if scales is not None and not isinstance(scales, list):
        scales = [scales] * layers
    widths = f.require(_K.FEED_FORWARD_LENGTH)
    if isinstance(widths, list) and len(set(widths)) != 1:
        raise ConfigError(
            f"{f.meta.path}: {f.name(_K.FEED_FORWARD_LENGTH)}: MLPs of different widths per layer are not supported"
        )
    hf: dict[str, Any] = dict(
        tie_word_embeddings=common["tie_word_embeddings"],
        hidden_size_per_layer_input=int(f.require(_K.EMBD_LENGTH_PER_LAYER_INP)),
        vocab_size_per_layer_input=int(table.shape[-1]) if table is not None else 0,
        num_kv_shared_layers=int(f.require(_KA.SHARED_KV_LAYERS)),
        altup_num_inputs=int(f.require(_K.ALTUP_NUM_INPUTS)),
        altup_active_idx=int(f.require(_K.ALTUP_ACTIVE_IDX)),
        altup_correct_scale=_tensor(MODEL_TENSOR.ALTUP_CORRECT_SCALE, 0) in tensors,
        laurel_rank=int(laurel.shape[-1]) if laurel is not None else 0,
        activation_sparsity_pattern=[0.0] * layers if scales is None else [_normal_cdf(s) for s in scales],
    )
    read = {"per_layer_input_size", "kv_shared_layers", "altup_num_inputs", "altup_active_idx", "intermediate_size"}
    read |= {"activation_sparsity"} if scales is not None else set()
    if window is not None:
        hf["sliding_window"] = int(window)
        read.add("sliding_window")
    if isinstance(pattern, list):
        hf["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        read.add("layer_types")
    if cap is not None:
        hf["final_logit_softcapping"] = _f32(cap)
        read.add("final_logit_softcapping")
    return hf, read


# llama.cpp's AFMoE: one global layer (no position encoding) in four, whatever config.json said (no key).
_AFMOE_GLOBAL_EVERY = 4


def _afmoe_hf_config(f: _Fields, common: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """AFMoE's config.json keys as AfmoeModel (on LlamaModel, q/k as in HF) writes them: the experts' counts and width,
    the shared experts' count, route_scale as `expert_weights_scale`, the dense layers as `leading_dense_block_count`,
    the window. llama.cpp fixes the rest: one global layer in four (no key; a file without a window, every layer
    global and 3 in 4 still rotating, is refused), the embedding times sqrt(hidden) (mup_enabled, the releases'),
    sigmoid gating where no key names another (others refused) and the top k renormalised where
    `expert_weights_norm` is true or absent (transformers' AFMoE always renormalises; false is refused)."""
    path = f.meta.path
    window, gating, norm = f.key(_KA.SLIDING_WINDOW), f.key(_K.EXPERT_GATING_FUNC), f.key(_K.EXPERT_WEIGHTS_NORM)
    if not window:
        raise ConfigError(f"{path}: an afmoe file without {f.name(_KA.SLIDING_WINDOW)} is not supported")
    if gating is not None and int(gating) != int(ExpertGatingFuncType.SIGMOID):
        raise ConfigError(f"{path}: {f.name(_K.EXPERT_GATING_FUNC)} {gating} is not supported for afmoe (sigmoid only)")
    if norm is not None and not norm:
        raise ConfigError(f"{path}: {f.name(_K.EXPERT_WEIGHTS_NORM)} false (route_norm) is not supported for afmoe")
    scale = f.key(_K.EXPERT_WEIGHTS_SCALE)
    hf = dict(
        num_experts=int(f.require(_K.EXPERT_COUNT)),
        num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
        moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
        num_shared_experts=int(f.key(_K.EXPERT_SHARED_COUNT, 0) or 0),
        route_scale=_f32(scale) if scale is not None else 1.0,
        num_dense_layers=int(f.require(_K.LEADING_DENSE_BLOCK_COUNT)),
        sliding_window=int(window),
        global_attn_every_n_layers=_AFMOE_GLOBAL_EVERY,
        mup_enabled=True,
        tie_word_embeddings=common["tie_word_embeddings"],
    )
    read = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"}
    read |= {"mlp_only_layers", "sliding_window"} | ({"routed_scaling_factor"} if scale is not None else set())
    return hf, read


# MiMoV2FlashConfig's attention_value_scale (the release's), which llama.cpp's converter does not write
_MIMO2_VALUE_SCALE = 0.707


def _mimo2_full_kv_heads(f: _Fields, kv_heads: list[Any], path: Path) -> int:
    """MimoV2Model's `head_count_kv` per layer (the sliding layers' swa_num_key_value_heads, the full layers'
    num_key_value_heads) as the full layers' count, which keel.families.mimo_v2_flash doubles for the sliding layers:
    sliding layers with another multiple are refused by name."""
    sliding = f.key(_KA.SLIDING_WINDOW_PATTERN)
    if not isinstance(sliding, list) or len(sliding) != len(kv_heads):
        raise ConfigError(f"{path}: {f.name(_KA.SLIDING_WINDOW_PATTERN)} must list one entry per layer for mimo2")
    full = {int(n) for n, slides in zip(kv_heads, sliding, strict=True) if not slides}
    swa = {int(n) for n, slides in zip(kv_heads, sliding, strict=True) if slides}
    if len(full) > 1 or len(swa) > 1:
        raise ConfigError(f"{path}: {f.name(_KA.HEAD_COUNT_KV)}: KV heads differing within a kind are not supported")
    if full and swa and swa != {2 * n for n in full}:
        raise ConfigError(
            f"{path}: {f.name(_KA.HEAD_COUNT_KV)}: sliding layers' {swa.pop()} KV heads other than twice the full "
            f"layers' {full.pop()} are not supported"
        )
    return f.read("num_kv_heads", full.pop() if full else swa.pop() // 2)


def _mimo2_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """MiMo-V2-Flash's config.json keys as MimoV2Model writes them (and llama.cpp's `mimo2` graph runs them): the
    value width as `attention.value_length`, the KV heads per layer, the window and which layers slide (the pattern,
    1 = sliding), one rotary width for both kinds (`rope.dimension_count`), each kind's base (`rope.freq_base`,
    `rope.freq_base_swa`), the experts' counts and width, groups where written. llama.cpp fixes the rest: sigmoid
    gating renormalised, no routed scale (the release's null), sinks in the sliding layers (their `attn_sinks`), the
    dense layers those without a router. The value scale: `attention.output_scale` where a file has it (the same
    product before o_proj), else MiMoV2FlashConfig's default 0.707 (the release's; llama.cpp's graph runs the values
    unscaled, transformers and vLLM scale them). A file saying otherwise (another
    gating, weights not renormalised, a routed scale, sinks in a full layer or a sliding layer without them) is
    refused by name."""
    path, layers = f.meta.path, common["num_layers"]
    gating, norm, scale = (f.key(k) for k in (_K.EXPERT_GATING_FUNC, _K.EXPERT_WEIGHTS_NORM, _K.EXPERT_WEIGHTS_SCALE))
    if gating is not None and int(gating) != int(ExpertGatingFuncType.SIGMOID):
        raise ConfigError(f"{path}: {f.name(_K.EXPERT_GATING_FUNC)} {gating} is not supported for mimo2 (sigmoid only)")
    if norm is not None and not norm:
        raise ConfigError(f"{path}: {f.name(_K.EXPERT_WEIGHTS_NORM)} false is not supported for mimo2")
    if scale is not None and _f32(scale) != 1.0:
        raise ConfigError(f"{path}: {f.name(_K.EXPERT_WEIGHTS_SCALE)} {scale} is not supported for mimo2 (none)")
    pattern = f.key(_KA.SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ConfigError(f"{path}: {f.name(_KA.SLIDING_WINDOW_PATTERN)} must list one entry per layer for mimo2")
    kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
    for i, kind in enumerate(kinds):
        if (_tensor(MODEL_TENSOR.ATTN_SINKS, i) in tensors) != (kind == "sliding_attention"):
            what = "a full-attention layer with" if kind == "full_attention" else "a sliding layer without"
            raise ConfigError(f"{path}: {what} {_tensor(MODEL_TENSOR.ATTN_SINKS, i)} is not supported for mimo2")
    head_dim = common["head_dim"]
    share = _rotary_factor(int(f.require(_KR.DIMENSION_COUNT)), head_dim)
    local = f.key(_KR.FREQ_BASE_SWA)
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": common["rope_theta"], "partial_rotary_factor": share}
    }
    if "sliding_attention" in kinds:  # (a file without sliding layers: one kind, as the family reads one)
        base = _f32(local) if local is not None else 10_000.0  # llama.cpp's default base for SWA
        rope["sliding_attention"] = {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": share}
    output_scale = f.key(_KA.OUTPUT_SCALE)
    window = f.key(_KA.SLIDING_WINDOW)
    hf = dict(
        head_dim=head_dim,
        v_head_dim=int(f.key(_KA.VALUE_LENGTH, head_dim)),
        attention_value_scale=_f32(output_scale) if output_scale is not None else _MIMO2_VALUE_SCALE,
        num_key_value_heads=common["num_kv_heads"],
        sliding_window=int(window) if window else None,
        layer_types=kinds,
        rope_parameters=rope,
        n_routed_experts=int(f.require(_K.EXPERT_COUNT)),
        num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
        moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
        n_group=int(f.key(_K.EXPERT_GROUP_COUNT, 1) or 1),
        topk_group=int(f.key(_K.EXPERT_GROUP_USED_COUNT, 1) or 1),
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        mlp_layer_types=[
            "sparse" if _tensor(MODEL_TENSOR.FFN_GATE_INP, i) in tensors else "dense" for i in range(layers)
        ],
    )
    read = {"v_head_dim", "num_kv_heads", "global_num_kv_heads", "layer_types", "partial_rotary_factor"}
    read |= {"sliding_partial_rotary_factor", "num_experts", "num_experts_per_tok", "moe_intermediate_size"}
    read |= {"sliding_window"} if window else set()
    read |= {"sliding_rope_theta"} if local is not None else set()
    read |= {"attention_value_scale"} if output_scale is not None else set()
    read |= {"n_group"} if f.key(_K.EXPERT_GROUP_COUNT) is not None else set()
    read |= {"topk_group"} if f.key(_K.EXPERT_GROUP_USED_COUNT) is not None else set()
    return hf, read


def _gemma4_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """Gemma 4's config.json keys as Gemma4Model (on Gemma3Model) writes them: the window and the per-layer pattern,
    the final soft-cap where written (absent: llama.cpp's 30, though the converter writes none for a model without
    one: such a model is not told apart), the full-attention layers' head width (`attention.key_length`; the sliding
    layers' is `key_length_swa`) and KV heads (`attention.head_count_kv` per layer), the per-layer inputs' width and
    the KV-sharing layers, the MLP widths per layer (the KV-sharing layers' twice as wide: use_double_wide_mlp), and
    the experts' counts and width. By tensor: values equal to the keys' projection where a full-attention layer has no
    `attn_v` (attention_k_eq_v) and the per-layer table's rows."""
    path, layers = f.meta.path, common["num_layers"]
    window, pattern = f.key(_KA.SLIDING_WINDOW), f.key(_KA.SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ConfigError(f"{path}: {f.name(_KA.SLIDING_WINDOW_PATTERN)} must list one value per layer ({layers})")
    full = [i for i, slides in enumerate(pattern) if not slides]
    kv_heads = f.key(_KA.HEAD_COUNT_KV)
    full_kv = {int(kv_heads[i]) for i in full} if isinstance(kv_heads, list) else {common["num_kv_heads"]}
    if len(full_kv) > 1:
        raise ConfigError(f"{path}: {f.name(_KA.HEAD_COUNT_KV)}: full-attention layers of different KV head counts")
    widths = f.require(_K.FEED_FORWARD_LENGTH)
    widths = widths if isinstance(widths, list) else [widths] * layers
    shared = int(f.key(_KA.SHARED_KV_LAYERS, 0) or 0)
    double = widths != [widths[0]] * layers
    if double and widths != [widths[0]] * (layers - shared) + [2 * widths[0]] * shared:
        raise ConfigError(
            f"{path}: {f.name(_K.FEED_FORWARD_LENGTH)}: MLP widths per layer other than use_double_wide_mlp's "
            "(the KV-sharing layers' twice as wide) are not supported"
        )
    table = tensors.get(_tensor(MODEL_TENSOR.PER_LAYER_TOKEN_EMBD))
    k_eq_v = bool(full) and all(_tensor(MODEL_TENSOR.ATTN_V, i) not in tensors for i in full)
    hf: dict[str, Any] = dict(
        tie_word_embeddings=common["tie_word_embeddings"],
        layer_types=["sliding_attention" if slides else "full_attention" for slides in pattern],
        sliding_window=int(window) if window else None,
        global_head_dim=int(f.key(_KA.KEY_LENGTH, common["head_dim"])),
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=int(f.key(_K.EMBD_LENGTH_PER_LAYER_INP, 0) or 0),
        vocab_size_per_layer_input=int(table.shape[-1]) if table is not None else common["vocab_size"],
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double,
        intermediate_size=int(widths[0]),
        # (absent: llama.cpp's default cap, 30; the converter writes none for a model without one)
        final_logit_softcapping=_f32(f.key(_K.FINAL_LOGIT_SOFTCAPPING, _GEMMA_FINAL_CAP)),
    )
    if k_eq_v:
        hf["num_global_key_value_heads"] = full_kv.pop()
    elif full_kv and full_kv != {common["num_kv_heads"]}:
        raise ConfigError(
            f"{path}: full-attention layers with their own KV head count and their own values (attn_v) are not "
            "supported (transformers' Gemma 4 gives them their own count with attention_k_eq_v only)"
        )
    read = {"layer_types", "sliding_window", "global_head_dim", "global_num_kv_heads", "kv_shared_layers"}
    read |= {"per_layer_input_size", "kv_shared_mlp_factor", "intermediate_size"}
    read |= {"final_logit_softcapping"} if f.key(_K.FINAL_LOGIT_SOFTCAPPING) else set()
    experts = f.key(_K.EXPERT_COUNT)
    if experts:
        hf.update(
            enable_moe_block=True,
            num_experts=int(experts),
            top_k_experts=int(f.require(_K.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"}
    return hf, read


def _gemma4_rope(
    f: _Fields, common: dict[str, Any], own: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path
) -> dict[str, Any]:
    """Gemma 4's RoPE as Gemma4Model writes it: the full-attention layers' proportional RoPE as `rope_freqs` (1 for
    each turning frequency, 1e30, i.e. none, for the rest: the turning share is theirs over the half head) on
    `rope.freq_base`; the sliding layers' base as `rope.freq_base_swa` (absent: llama.cpp's 10000) over the whole
    head (`rope.dimension_count_swa` less than the head: refused)."""
    head_dim = common["head_dim"]
    rotary = f.key(_KR.DIMENSION_COUNT_SWA)
    if rotary is not None and int(rotary) != head_dim:
        raise ConfigError(
            f"{path}: {f.name(_KR.DIMENSION_COUNT_SWA)} {rotary}: partial rotary in the sliding layers is not supported"
        )
    out: dict[str, Any] = {}
    freqs = tensors.get(_ROPE_FREQS)
    if freqs is not None:
        factors = _to_numpy(freqs, path).reshape(-1)
        turning = int(np.sum(factors == 1.0))
        if not np.all(factors[:turning] == 1.0) or not np.all(factors[turning:] >= 1e29):
            raise ConfigError(f"{path}: {_ROPE_FREQS} is not proportional RoPE's (ones, then 1e30): not supported")
        share = turning / len(factors)
        out["rope_scaling"] = f.read("rope_scaling", RopeScaling(type="proportional", rotated_share=share), "inferred")
    local = f.key(_KR.FREQ_BASE_SWA)
    out["sliding_rope_theta"] = f.read("sliding_rope_theta", _f32(local)) if local else _GEMMA3_LOCAL_THETA
    return out


def _normal_cdf(quantile: float) -> float:
    """The target sparsity whose standard normal quantile Gemma3NModel wrote (its float32 rounding undone)."""
    return _f32(0.5 * math.erfc(-float(quantile) / math.sqrt(2.0)))


def _nemotron_h_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """Nemotron-H's config.json keys as NemotronHModel (on GraniteHybridModel) writes them: the layer kinds from the
    per-layer KV head counts (attention where not 0) and feed-forward lengths (an MLP where not 0: Llama's ungated one
    in a `nemotron_h` file, experts in a `nemotron_h_moe` one, whose converter writes 0 for any dense layer: such a
    file, which llama.cpp reads as a Mamba layer, is refused), the rest Mamba 2 mixers (as Granite 4.0-H's: the heads
    as the time-step rank); the head size as key_length, the norms' eps as either eps key (TextModel writes
    config.json's layer_norm_epsilon as the LayerNorm one); the experts' keys (DeepSeek-V3's sigmoid router with the
    selection bias by tensor; the groups' top k, which no key holds where the file has one group). No key for
    time_step_min: the family default, the releases' 0.001. The multi-token-prediction block past block_count less
    nextn_predict_layers is not read."""
    path, layers, moe = f.meta.path, common["num_layers"], f.arch == MODEL_ARCH_NAMES[_A.NEMOTRON_H_MOE]
    per_layer = {}
    for key in (_KA.HEAD_COUNT_KV, _K.FEED_FORWARD_LENGTH):
        value = f.require(key)
        per_layer[key] = (value if isinstance(value, list) else [value] * layers)[:layers]
        if len(per_layer[key]) != layers:
            raise ConfigError(f"{path}: {f.name(key)} lists {len(per_layer[key])} layers, not {layers}")
    kinds = []
    for i, (kv, ff) in enumerate(zip(per_layer[_KA.HEAD_COUNT_KV], per_layer[_K.FEED_FORWARD_LENGTH], strict=True)):
        kind = "full_attention" if kv else ("moe" if moe else "mlp") if ff else "linear_attention"
        if kind == "linear_attention" and _tensor(MODEL_TENSOR.SSM_IN, i) not in tensors:
            raise ConfigError(f"{path}: layer {i} (no attention, no feed-forward length: a Mamba layer) has no ssm_in")
        kinds.append(kind)
    widths = {int(n) for n in per_layer[_K.FEED_FORWARD_LENGTH] if n}
    if len(widths) > 1:
        raise ConfigError(f"{path}: per-layer {f.name(_K.FEED_FORWARD_LENGTH)} {sorted(widths)} is not supported")
    mamba = _mamba2_hf_config(f, common, tensors)
    eps = f.key(_KA.LAYERNORM_RMS_EPS, f.key(_KA.LAYERNORM_EPS))
    layer_any = lambda kind, suffix: any(_tensor(kind, i, suffix) in tensors for i in range(layers))  # noqa: E731
    hf: dict[str, Any] = dict(
        layers_block_type=kinds,
        head_dim=common["head_dim"],
        num_attention_heads=common["num_heads"],
        num_key_value_heads=common["num_kv_heads"],
        intermediate_size=min(widths, default=0) or None,
        mlp_bias=layer_any(MODEL_TENSOR.FFN_UP, "bias") or layer_any(MODEL_TENSOR.FFN_UP_SHEXP, "bias"),
        layer_norm_epsilon=None if eps is None else _f32(eps),
        mamba_num_heads=mamba["mamba_n_heads"],
        mamba_head_dim=mamba["mamba_d_head"],
        n_groups=mamba["mamba_n_groups"],
        ssm_state_size=mamba["mamba_d_state"],
        conv_kernel=mamba["mamba_d_conv"],
        use_conv_bias=mamba["mamba_conv_bias"],
        use_bias=mamba["mamba_proj_bias"],
    )
    read = {"layer_types", "mlp_layers", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state"}
    read |= {"mamba_d_conv", "intermediate_size"} | ({"rms_norm_eps"} if eps is not None else set())
    if moe:
        groups, used = int(f.key(_K.EXPERT_GROUP_COUNT, 1) or 1), f.key(_K.EXPERT_GROUP_USED_COUNT)
        if groups > 1 and used is None:
            raise ConfigError(
                f"{path}: {f.name(_K.EXPERT_GROUP_COUNT)} {groups} without {f.name(_K.EXPERT_GROUP_USED_COUNT)} "
                "is not supported (the groups' top k)"
            )
        hf.update(
            n_routed_experts=int(f.require(_K.EXPERT_COUNT)),
            num_experts_per_tok=int(f.require(_K.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(f.require(_K.EXPERT_FEED_FORWARD_LENGTH)),
            moe_shared_expert_intermediate_size=int(f.require(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH)),
            norm_topk_prob=bool(f.require(_K.EXPERT_WEIGHTS_NORM)),
            routed_scaling_factor=_f32(f.require(_K.EXPERT_WEIGHTS_SCALE)),
            n_group=groups,
            topk_group=int(used or 1),
        )
        read |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"}
        read |= {"norm_topk_prob", "routed_scaling_factor", "n_group"}
    return hf, read


# Families whose config.json keys a reader of their own builds from the file: (its keys, the fields they give).
_OWN_HF_CONFIG: dict[
    str, Callable[[_Fields, dict[str, Any], dict[str, GGUFTensor]], tuple[dict[str, Any], set[str]]]
] = {
    "afmoe": lambda f, common, tensors: _afmoe_hf_config(f, common),
    "mimo_v2_flash": _mimo2_hf_config,
    "gemma4": _gemma4_hf_config,
    "gemma3n": _gemma3n_hf_config,
    "nemotron_h": _nemotron_h_hf_config,
    "kimi_linear": lambda f, common, tensors: _kimi_linear_hf_config(f, common, tensors),
    "glm_moe_dsa": lambda f, common, tensors: _glm_dsa_hf_config(f, common, tensors),
}


def _glm_dsa_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """GLM-5's config.json keys as GlmMoeDsaModel (on DeepseekV2Model) writes them: the latent attention's and the
    experts' keys (_mla_fields, _deepseek_moe_fields; the multi-token-prediction layers counted in block_count and
    unread), the indexer's heads, width and top-k under `attention.indexer.*`, its tensors as HF's (no rotary
    permutation). Each layer's indexer, "full" or "shared" (the layer reuses the last full one's selection and has no
    indexer tensors of its own), from `attention.indexer.types` where the file has it, else from which layers hold
    indexer tensors; the two must agree. The dense layers by tensor (no router), as for K-EXAONE."""
    path, layers = f.meta.path, common["num_layers"]
    idx = Keys.Attention.Indexer
    own = [_tensor(MODEL_TENSOR.INDEXER_ATTN_K, i) in tensors for i in range(layers)]
    written = f.key(INDEXER_TYPES)
    if written is not None and (not isinstance(written, list) or len(written) != layers):
        raise ConfigError(f"{path}: {f.name(INDEXER_TYPES)} must list each of the {layers} layers' indexer")
    full = own if written is None else [bool(v) for v in written]
    if full != own:
        raise ConfigError(
            f"{path}: {f.name(INDEXER_TYPES)} {full} disagrees with the layers holding indexer tensors {own}"
        )
    rope, kv_rank, key_width = (f.require(k) for k in (_KR.DIMENSION_COUNT, _KA.KV_LORA_RANK, _KA.KEY_LENGTH))
    if int(key_width) != int(kv_rank) + int(rope):  # GlmMoeDsaModel writes qk_rope_head_dim x partial_rotary_factor
        raise ConfigError(
            f"{path}: {f.name(_KR.DIMENSION_COUNT)} {rope} is not the keys' rotary width "
            f"({f.name(_KA.KEY_LENGTH)} - kv_lora_rank = {int(key_width) - int(kv_rank)}): partial rotary not supported"
        )
    low_rank_q = _tensor(MODEL_TENSOR.ATTN_Q_A, 0) in tensors
    routed = [_tensor(MODEL_TENSOR.FFN_GATE_INP, i) in tensors for i in range(layers)]
    hf = dict(
        attention_bias=common["o_bias"],
        q_lora_rank=int(f.require(_KA.Q_LORA_RANK)) if low_rank_q else None,
        index_n_heads=int(f.require(idx.HEAD_COUNT)),
        index_head_dim=int(f.require(idx.KEY_LENGTH)),
        index_topk=int(f.require(idx.TOP_K)),
        indexer_types=["full" if own_indexer else "shared" for own_indexer in full],
        mlp_layer_types=["sparse" if r else "dense" for r in routed],
    )
    read = {"index_n_heads", "index_head_dim", "index_topk"} | ({"indexer_types"} if written is not None else set())
    return hf, read


def _kimi_linear_hf_config(
    f: _Fields, common: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, Any], set[str]]:
    """Kimi Linear's config.json keys as KimiLinearModel writes them: the layer kinds by the per-layer KV head count
    (0 for a KDA layer, 1 for a latent-attention one in MQA form), the KDA head size as `kda.head_dim` and the short
    convolutions' kernel as `ssm.conv_kernel`, the dense layers first (`leading_dense_block_count`). No key holds the
    KDA head count (llama.cpp takes `head_count`): read from the first KDA layer's `ssm_a` ([1, 1, H, 1])."""
    path = f.meta.path
    kv_heads = f.require(_KA.HEAD_COUNT_KV)
    if not isinstance(kv_heads, list) or len(kv_heads) != common["num_layers"]:
        raise ConfigError(f"{path}: {f.name(_KA.HEAD_COUNT_KV)} must list each layer's count (0: a KDA layer)")
    kinds = ["full_attention" if n else "linear_attention" for n in kv_heads]
    linear = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    heads = common["num_heads"]
    if linear:
        a = tensors.get(_tensor(MODEL_TENSOR.SSM_A, linear[0]).removesuffix(".weight"))
        if a is None:
            raise ConfigError(f"{path}: tensor {_tensor(MODEL_TENSOR.SSM_A, linear[0])!r} is missing")
        heads = int(np.prod(_hf_shape(a)))
    dense = int(f.key(_K.LEADING_DENSE_BLOCK_COUNT, 0) or 0)
    hf = dict(
        layer_types=kinds,
        linear_num_heads=heads,
        linear_head_dim=int(f.require(Keys.KDA.HEAD_DIM)),
        linear_conv_kernel_dim=int(f.require(Keys.SSM.CONV_KERNEL)),
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(common["num_layers"])],
    )
    return hf, {"layer_types", "linear_head_dim", "linear_conv_kernel_dim"}


def _mamba_hf_config(f: _Fields, family: str, common: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """Mamba's and Mamba 2's config.json keys as MambaModel and Mamba2Model write them (no attention: head_count 0):
    the mixer's width as ssm.inner_size, its state, kernel (and Mamba 2's groups) as ssm.* keys, Mamba's step rank and
    Mamba 2's heads as ssm.time_step_rank (inner / head_dim), the norms' eps as the RMS key; the biases by tensor (one
    key for both projections: the input one's). No key for Mamba 2's time_step_limit: llama.cpp clamps no step, as
    Mamba2Config's default (0, inf). A Mamba file with ssm.dt_b_c_rms true (Falcon Mamba's: its step, B and C
    normed with the norms' eps, which transformers takes from mixer_rms_eps) is refused."""
    path, hidden = f.meta.path, common["hidden_size"]
    inner = int(f.require(Keys.SSM.INNER_SIZE))
    layers = range(common["num_layers"])
    any_layer = lambda kind, suffix: any(_tensor(kind, i, suffix) in tensors for i in layers)  # noqa: E731
    hf: dict[str, Any] = dict(
        state_size=int(f.require(Keys.SSM.STATE_SIZE)),
        conv_kernel=int(f.require(Keys.SSM.CONV_KERNEL)),
        use_conv_bias=any_layer(MODEL_TENSOR.SSM_CONV1D, "bias"),
        use_bias=any_layer(MODEL_TENSOR.SSM_IN, "bias"),
        layer_norm_epsilon=common["rms_norm_eps"],
        tie_word_embeddings=common["tie_word_embeddings"],
    )
    if family == "mamba":
        if f.key(Keys.SSM.DT_B_C_RMS):
            raise ConfigError(
                f"{path}: a mamba file with {f.name(Keys.SSM.DT_B_C_RMS)} true (Falcon Mamba's) is not supported"
            )
        return dict(hf, expand=inner / hidden, time_step_rank=int(f.require(Keys.SSM.TIME_STEP_RANK)))
    heads = int(f.require(Keys.SSM.TIME_STEP_RANK))
    return dict(
        hf,
        num_heads=heads,
        head_dim=inner // heads,
        expand=inner / hidden,
        n_groups=int(f.require(Keys.SSM.GROUP_COUNT)),
    )


def _sliding_pattern(pattern: Any, default: int | None = None) -> dict[str, Any]:
    """`attention.sliding_window_pattern` as the config.json keys a family reads: a list (per layer, true where it
    slides) as `layer_types`, a number (one global layer in that many) or else `default` as
    `sliding_window_pattern`; nothing where both are None (the family's own default)."""
    if isinstance(pattern, list):
        return {"layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}
    every = pattern if pattern is not None else default
    return {} if every is None else {"sliding_window_pattern": int(every)}


def _rotary_factor(rope_dims: int, head_dim: int) -> float:
    """The partial_rotary_factor whose int(head_dim * factor) (transformers' and keel's rounding) is rope_dims."""
    factor = rope_dims / head_dim
    while int(head_dim * factor) < rope_dims:  # e.g. 30 / 88 * 88 == 29.999...
        factor = math.nextafter(factor, 1.0)
    return factor


def _attention_shape(f: _Fields, family: str, path: Path) -> tuple[int, int, int, int]:
    """(hidden size, attention heads, KV heads, head dim), their provenance recorded. rope.dimension_count
    is the head size for llama (no key_length), the rotary width for the partial-rotary families."""
    hidden = f.read("hidden_size", int(f.require(_K.EMBEDDING_LENGTH)))
    heads = _per_layer_constant(f.require(_KA.HEAD_COUNT), f.name(_KA.HEAD_COUNT), path)
    num_heads = f.read("num_heads", heads)
    kv_heads = f.key(_KA.HEAD_COUNT_KV)
    if family in ("lfm2", "lfm2_moe", "granitemoehybrid", "nemotron_h", "jamba", "kimi_linear") and isinstance(
        kv_heads, list
    ):
        # LFM2Model and GraniteHybridModel (NemotronHModel on it too) write 0 for their other layers (how they mark
        # them): the attention layers' count is the one keel needs (none at all: any will do).
        kv_heads = [n for n in kv_heads if n] or [num_heads]
    if family == "gemma4" and isinstance(kv_heads, list):  # Gemma4Model: per layer, the full-attention layers' own
        sliding = f.key(_KA.SLIDING_WINDOW_PATTERN)
        if isinstance(sliding, list) and len(sliding) == len(kv_heads):
            kv_heads = [n for n, slides in zip(kv_heads, sliding, strict=True) if slides] or kv_heads
    if family == "mimo_v2_flash" and isinstance(kv_heads, list):  # MimoV2Model: per layer; the full layers' count
        kv_heads = _mimo2_full_kv_heads(f, kv_heads, path)
    if kv_heads is None:
        kv_heads = f.read("num_kv_heads", num_heads, "default")
    else:
        kv_heads = f.read("num_kv_heads", _per_layer_constant(kv_heads, f.name(_KA.HEAD_COUNT_KV), path))
    rope_dims = f.key(_KR.DIMENSION_COUNT)
    if f.key(_KA.KEY_LENGTH_MLA) is not None:  # DeepSeek's MQA form: the query/key width of latent attention
        head_dim = f.read("head_dim", int(f.key(_KA.KEY_LENGTH_MLA)))
    elif family == "gemma4" and f.key(_KA.KEY_LENGTH_SWA) is not None:  # the sliding layers' (key_length: global)
        head_dim = f.read("head_dim", int(f.key(_KA.KEY_LENGTH_SWA)))
    elif f.key(_KA.KEY_LENGTH) is not None:
        head_dim = f.read("head_dim", int(f.key(_KA.KEY_LENGTH)))
    elif rope_dims is not None and family not in _ROTARY_WIDTH_KEY:  # llama.cpp writes the head size here for llama
        head_dim = f.read("head_dim", int(rope_dims))
    elif num_heads:
        head_dim = f.read("head_dim", hidden // num_heads, "inferred")
    else:  # Mamba's and Mamba 2's head_count 0 (no attention): the family's placeholders (keel.families.mamba)
        head_dim = 0
    if rope_dims is not None and int(rope_dims) != head_dim and family not in _ROTARY_WIDTH_KEY:
        raise ConfigError(
            f"{path}: partial rotary embeddings are not supported "
            f"(rope.dimension_count={rope_dims}, head_dim={head_dim})"
        )
    return hidden, num_heads, kv_heads, head_dim


def _vocab_size(f: _Fields, tensors: dict[str, GGUFTensor], path: Path, embedding_first: bool = False) -> int:
    """From vocab_size, else the token list, else the embedding's rows (first, for Gemma 3: its converter
    drops the embedding rows past the tokenizer's vocabulary)."""
    embed = tensors.get(_TOKEN_EMBD)
    tokens = f.meta.get(_KT.LIST)
    if embedding_first and embed is not None:
        return f.read("vocab_size", int(embed.shape[-1]), "inferred")
    if f.key(_K.VOCAB_SIZE) is not None:
        return f.read("vocab_size", int(f.key(_K.VOCAB_SIZE)))
    if tokens is not None:
        return f.read("vocab_size", len(tokens))
    if embed is not None:
        return f.read("vocab_size", int(embed.shape[-1]), "inferred")
    raise ConfigError(f"{path}: cannot tell the vocabulary size (no vocab_size, token list or token_embd)")


def _eos_ids(meta: _Metadata) -> list[int] | None:
    """llama.cpp stops generation at any of these; keel's eos list plays that role."""
    eos = [meta.get(key) for key in (_KT.EOS_ID, _KT.EOT_ID, _KT.EOM_ID)]
    return list(dict.fromkeys(int(i) for i in eos if i is not None)) or None


def _per_layer_constant(value: Any, key: str, path: Path) -> int:
    """Head counts may be stored per layer (an array); keel needs one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{path}: per-layer {key} {sorted(set(value))} is not supported (needs one value)")
        value = value[0]
    return int(value)


def _moe_fields(
    f: _Fields,
    family: str,
    tensors: dict[str, GGUFTensor],
    num_layers: int,
    num_experts: int,
    path: Path,
) -> dict[str, Any]:
    width = f.key(_K.FEED_FORWARD_LENGTH if family == "mixtral" else _K.EXPERT_FEED_FORWARD_LENGTH)
    how = "read"
    if width is None:  # from the stacked down projection: ggml shape [I, H, E]
        downs = (tensors.get(_tensor(MODEL_TENSOR.FFN_DOWN_EXP, i)) for i in range(num_layers))
        down = next((t for t in downs if t is not None), None)
        if down is None:
            raise ConfigError(f"{path}: cannot tell the expert width (no {f.name(_K.EXPERT_FEED_FORWARD_LENGTH)})")
        width, how = int(down.shape[0]), "inferred"
    # A layer without a router is dense (Qwen-MoE's mlp_only_layers).
    dense = [i for i in range(num_layers) if _tensor(MODEL_TENSOR.FFN_GATE_INP, i) not in tensors]
    # llama.cpp normalises the top-k weights for Mixtral, Qwen3-MoE, Qwen3.5 MoE and Qwen3-Next, not for Qwen2-MoE.
    norm = f.key(_K.EXPERT_WEIGHTS_NORM)
    gated_shared = family in ("qwen2_moe", "qwen3_5_moe", "qwen3_next")  # Qwen2-MoE's sigmoid-gated shared expert
    shared = int(f.key(_K.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0) or 0) if gated_shared else 0
    read = f.read
    return {
        "num_experts": read("num_experts", num_experts),
        "num_experts_per_tok": read("num_experts_per_tok", int(f.require(_K.EXPERT_USED_COUNT))),
        "moe_intermediate_size": read("moe_intermediate_size", int(width), how),
        "norm_topk_prob": read("norm_topk_prob", bool(norm), "read") if norm is not None else family != "qwen2_moe",
        "shared_expert_intermediate_size": read("shared_expert_intermediate_size", shared) if gated_shared else 0,
        "mlp_only_layers": read("mlp_only_layers", dense, "inferred"),
    }


def _rope_scaling(f: _Fields, tensors: dict[str, GGUFTensor], head_dim: int, theta: float, path: Path) -> RopeScaling:
    kind = f.key(_KR.SCALING_TYPE)
    factor = f.key(_KR.SCALING_FACTOR, f.key(ROPE_SCALE_LINEAR))
    if kind in (None, "none") and f.key(ROPE_SCALE_LINEAR) is not None:
        kind = "linear"  # older files: only rope.scale_linear
    if kind == "linear" and factor is not None and _f32(factor) != 1.0:
        f.provenance["rope_scaling"] = "read"
        return RopeScaling(type="linear", factor=_f32(factor))
    if kind == "yarn" and factor is not None:
        f.provenance["rope_scaling"] = "read"
        attention = f.key(_KR.SCALING_YARN_ATTN_FACTOR)
        return RopeScaling(
            type="yarn",
            factor=_f32(factor),
            original_max_position_embeddings=int(f.require(_KR.SCALING_ORIG_CTX_LEN)),
            beta_fast=_f32(f.key(_KR.SCALING_YARN_BETA_FAST, 32.0)),
            beta_slow=_f32(f.key(_KR.SCALING_YARN_BETA_SLOW, 1.0)),
            attention_factor=None if attention is None else _f32(attention),
        )
    if kind == "longrope" and f.arch == MODEL_ARCH_NAMES[_A.MINICPM]:
        return RopeScaling()  # the factors are tensors, read with the family (_minicpm_fields)
    if kind not in (None, "none", "linear"):
        raise ConfigError(f"{path}: rope scaling type {kind!r} is not supported (supported: linear, llama3, yarn)")
    freqs = tensors.get(_ROPE_FREQS)
    if freqs is None:
        return RopeScaling()
    # Llama 3.x: the converter stores per-frequency divisors instead of the rope_scaling parameters.
    scaling = _llama3_from_rope_freqs(_to_numpy(freqs, path), head_dim, theta, f)
    if scaling is None:
        raise ConfigError(
            f"{path}: {_ROPE_FREQS} does not match llama3 rope scaling; custom rope factors are not supported"
        )
    f.provenance["rope_scaling"] = "inferred"
    return scaling


def _llama3_from_rope_freqs(freqs: np.ndarray, head_dim: int, theta: float, f: _Fields) -> RopeScaling | None:
    """The llama3 RopeScaling whose frequencies equal base / rope_freqs, or None."""
    from keel.model.layers import rope_inv_freq

    freqs = freqs.astype(np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        return None
    if np.allclose(freqs, 1.0):
        return RopeScaling()
    base = rope_inv_freq(head_dim, theta, RopeScaling()).double().numpy()
    target = base / freqs
    # The file keeps only the resulting divisors. Llama 3.1 / 3.2 / 3.3 all use low_freq_factor 1,
    # high_freq_factor 4 and an original context of 8192, Llama 4 Scout both factors 1 (a step, no smooth band);
    # the factor is the largest divisor. Accept a reading only if it reproduces every stored frequency.
    original = int(f.key(_KR.SCALING_ORIG_CTX_LEN) or 8192)
    for low, high in ((1.0, 4.0), (1.0, 1.0)):
        candidate = RopeScaling("llama3", float(freqs.max()), low, high, original)
        got = rope_inv_freq(head_dim, theta, candidate).double().numpy()
        if np.allclose(got, target, rtol=1e-4, atol=0):
            return candidate
    return None


def _checkpoint_dtype(tensors: dict[str, GGUFTensor]) -> str:
    """bfloat16/float16 when every matrix is stored so; float32 otherwise (keel dequantizes to float32)."""
    kinds = {t.tensor_type for t in tensors.values() if len(t.shape) >= 2}
    if kinds == {_T.BF16}:
        return "bfloat16"
    if kinds == {_T.F16}:
        return "float16"
    return "float32"


# ----------------------------------------------------------------------------------------- tensors
def _hf_shape(t: GGUFTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the innermost dimension first


Rows = tuple[int, int] | None


def _check_type(t: GGUFTensor, path: Path) -> None:
    if t.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(s.name for s in SUPPORTED_TYPES)
        raise WeightsError(
            f"{path}: tensor {t.name!r} has ggml type {t.tensor_type.name}, which keel cannot read "
            f"(supported: {supported})"
        )


def _raw(t: GGUFTensor, rows: Rows) -> tuple[np.ndarray, tuple[int, ...]]:
    """The tensor's stored data (values, or bytes of blocks, one row per HF row) and HF shape, or only
    rows [start, stop) of its first (outermost) dimension."""
    shape = _hf_shape(t)
    if rows is None:
        return t.data, shape
    return t.data[rows[0] : rows[1]], (rows[1] - rows[0], *shape[1:])


def _to_numpy(t: GGUFTensor, path: Path, rows: Rows = None) -> np.ndarray:
    """Dequantize one GGUF tensor (or rows of it) to float32 in numpy (HF / row-major) shape."""
    _check_type(t, path)
    data, shape = _raw(t, rows)
    try:
        return dequantize(np.ascontiguousarray(data), t.tensor_type).reshape(shape)
    except Exception as e:
        raise WeightsError(f"{path}: cannot read tensor {t.name!r} ({_one_line(e)})") from None


def _unpermute(heads: int) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Undo llama.cpp's q/k row permutation (its rotary pairs adjacent rows; HF pairs row i with i + d/2)."""

    def apply(arrays: list[np.ndarray]) -> np.ndarray:
        w = arrays[0]
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    apply.heads = heads  # type: ignore[attr-defined]  # a row shard un-permutes its own heads (get_shard)
    return apply


def _regrouped(parts: dict[str, Rows], rows: int) -> bool:
    """Whether a family's layout reads this tensor as one tensor (itself, or renamed: GPT-J's) with all its rows in
    another order (GLM-4's, Cohere's and GPT-J's q/k, keel.families.rope.interleaved_qk_layout), which a GGUF file
    stores as the HF checkpoint does."""
    if len(parts) != 1:
        return False
    spans = next(iter(parts.values()))
    return isinstance(spans, list) and len(spans) > 1 and sum(stop - start for start, stop in spans) == rows


def _columns_in_order(order: tuple[int, ...]) -> Callable[[list[np.ndarray]], np.ndarray]:
    """The tensor's columns in `order` (Command R+'s per-head q/k norm weights [heads, head_dim], each head's channels
    regrouped as its q/k rows are: keel.families.parts.Columns)."""

    def apply(arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0][:, list(order)]

    apply.moves_rows = False  # type: ignore[attr-defined]  # columns: no integer blocks, sharded whole
    return apply


def _rows_in_order(order: np.ndarray) -> Callable[[list[np.ndarray]], np.ndarray]:
    """The tensor's rows in `order` (a row shard takes its own rows of the order: get_shard)."""

    def apply(arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0][order]

    apply.order = order  # type: ignore[attr-defined]
    return apply


@dataclass(frozen=True)
class _Entry:
    """One HF tensor: the GGUF tensors it is made of, its HF shape and how to combine them; `rows`:
    it is those rows of its one source (a part of a fused tensor, e.g. Phi-3's q in attn_qkv)."""

    sources: tuple[GGUFTensor, ...]
    shape: tuple[int, ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]
    rows: Rows = None


def _single(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0]


# Apertus's xIELU parameters: llama.cpp's metadata key (one value per layer, as stored in HF) -> HF's mlp.act_fn name.
_XIELU = {Keys.xIELU.ALPHA_P: "alpha_p", Keys.xIELU.ALPHA_N: "alpha_n", Keys.xIELU.BETA: "beta", Keys.xIELU.EPS: "eps"}


def _constant(value: float, shape: tuple[int, ...]) -> Callable[[list[np.ndarray]], np.ndarray]:
    """A tensor made from a metadata value (no GGUF tensor behind it)."""
    return lambda arrays: np.full(shape, value, dtype=np.float32)


def _kv_b_from_split(arrays: list[np.ndarray]) -> np.ndarray:
    """HF's kv_b_proj [heads x (nope + v), rank] from llama.cpp's `attn_k_b` [heads, rank, nope] (transposed by the
    converter) and `attn_v_b` [heads, v, rank]."""
    k_b, v_b = arrays
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return kv.reshape(-1, kv.shape[-1])


_kv_b_from_split.moves_rows = False  # type: ignore[attr-defined]  # it transposes: no integer blocks (get_blocks)


def _index(i: int) -> Callable[[list[np.ndarray]], np.ndarray]:
    """One matrix of a stack (Gemma 3n's AltUp projections)."""
    apply = lambda arrays: arrays[0][i]  # noqa: E731
    apply.moves_rows = False  # type: ignore[attr-defined]  # (read whole, then indexed: no integer blocks)
    return apply


# Gemma 3n's stacked AltUp projections -> HF's ModuleList under model. (`altup_projections.{i}.weight`).
_ALTUP_STACKED = {
    MODEL_TENSOR.ALTUP_PROJ: "altup_projections",
    MODEL_TENSOR.ALTUP_UNEMBD_PROJ: "altup_unembed_projections",
}


# Gemma 4's tensors that Gemma4Model names apart from TensorNameMap's `.weight`/`.bias` (router.scale and
# router.per_expert_scale as `.scale` of the router and of the down experts), under keel's names.
_GEMMA4_TENSORS = {
    (MODEL_TENSOR.LAYER_OUT_SCALE, "weight"): "layer_scalar",
    (MODEL_TENSOR.FFN_GATE_UP_EXP, "weight"): "mlp.experts.gate_up_proj",
    (MODEL_TENSOR.FFN_DOWN_EXP, "weight"): "mlp.experts.down_proj",
    (MODEL_TENSOR.FFN_DOWN_EXP, "scale"): "mlp.gate.expert_scale",
    (MODEL_TENSOR.FFN_GATE_INP, "scale"): "mlp.gate.input_scale",
}


def _unsqueezed(arrays: list[np.ndarray]) -> np.ndarray:
    """A depthwise convolution's [C, K] weight as torch's Conv1d holds it: [C, 1, K]."""
    return arrays[0].reshape(arrays[0].shape[0], 1, -1)


def _minus_one(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] - np.float32(1)


def _norm_offset(arch: MODEL_ARCH, hf: str) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Gemma's, Qwen3.5's and Qwen3-Next's norm weights as HF stores them: the converter added 1 to each
    `*norm.weight` (llama.cpp's RMSNorm has no 1 + w); keel, like transformers, scales by 1 + w (norm_weight_offset).
    The Gated DeltaNet's own norm, which scales by w and is stored as is, is read by _gated_deltanet."""
    plus_one = arch in _NORM_PLUS_ONE or arch in _GATED_DELTANET
    return _minus_one if plus_one and hf.endswith("norm.weight") else _single


def _stored(
    config: ModelConfig, arch: MODEL_ARCH, hf: str, kind: MODEL_TENSOR, suffix: str
) -> Callable[[list[np.ndarray]], np.ndarray]:
    """How a whole stored tensor becomes HF's: q/k rows un-permuted (LlamaModel's subclasses), norms less 1."""
    permuted = arch in _PERMUTED and (suffix == "weight" or arch not in _PERMUTED_WEIGHTS_ONLY)
    if permuted and kind == MODEL_TENSOR.ATTN_Q:
        return _unpermute(config.num_heads)
    if permuted and kind == MODEL_TENSOR.ATTN_K:
        return _unpermute(config.num_kv_heads)
    return _norm_offset(arch, hf)


# A Gated DeltaNet layer's llama.cpp tensors -> keel's (and Qwen3.5's HF) names under self_attn. (Qwen3-Next's converter
# splits its in_proj_qkvz into attn_qkv, rows [q; k; v] as keel's in_proj_qkv, and attn_gate: its z.)
_DELTANET_TENSORS = {
    MODEL_TENSOR.ATTN_QKV: "in_proj_qkv.weight",
    MODEL_TENSOR.ATTN_GATE: "in_proj_z.weight",
    MODEL_TENSOR.SSM_BETA: "in_proj_b.weight",
    MODEL_TENSOR.SSM_ALPHA: "in_proj_a.weight",
    MODEL_TENSOR.SSM_CONV1D: "conv1d.weight",
    MODEL_TENSOR.SSM_DT: "dt_bias",  # stored as `ssm_dt.bias` (the converter's dt_proj.bias)
    MODEL_TENSOR.SSM_A: "A_log",  # stored as -exp(A_log), without a suffix
    MODEL_TENSOR.SSM_NORM: "norm.weight",
    MODEL_TENSOR.SSM_OUT: "out_proj.weight",
}


# A Kimi Delta Attention layer's llama.cpp tensors that keel does not find by TensorNameMap's names (the rest, q/k/v,
# f_a/f_b, b, g_a/g_b, o_norm and o_proj, are HF's names mapped): KimiLinearModel stores each short convolution
# [C, 1, K] as [1, C, 1, K], A_log [1, 1, H, 1] as -exp(A_log) (no suffix), dt_bias as `ssm_dt.bias`.
_KDA_TENSORS = {
    MODEL_TENSOR.SSM_CONV1D_Q: "q_conv1d",
    MODEL_TENSOR.SSM_CONV1D_K: "k_conv1d",
    MODEL_TENSOR.SSM_CONV1D_V: "v_conv1d",
    MODEL_TENSOR.SSM_A: "A_log",
    MODEL_TENSOR.SSM_DT: "dt_bias",
}


def _kda(
    config: ModelConfig, kind: MODEL_TENSOR, suffix: str, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """A KDA tensor's keel name (under self_attn), HF shape and how to make it from the stored one."""
    if kind == MODEL_TENSOR.SSM_A:
        return "A_log", shape, _log_of_negated
    if kind == MODEL_TENSOR.SSM_DT:
        return "dt_bias", (math.prod(shape),), _flattened
    channels, kernel = math.prod(shape[:-1]), shape[-1]
    conv = lambda arrays: arrays[0].reshape(channels, 1, kernel)  # noqa: E731
    conv.moves_rows = False  # type: ignore[attr-defined]  # reshaped: no integer blocks (get_blocks)
    return f"{_KDA_TENSORS[kind]}.{suffix}", (channels, 1, kernel), conv


# BitNet's sub-norms under keel's (and transformers') names, and its ternary projections (llama.cpp's build_bitnet
# multiplies each one's output by its optional `.scale` tensor).
_BITNET_SUB_NORMS = {
    MODEL_TENSOR.ATTN_SUB_NORM: "self_attn.attn_sub_norm",
    MODEL_TENSOR.FFN_SUB_NORM: "mlp.ffn_sub_norm",
}
_BITNET_TERNARY = {MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_OUT}
_BITNET_TERNARY |= {MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN}
# How keel.quant.bitnet runs a `bitnet` file's projections: AutoBitLinear's offline form, y = (x' W^T) * weight_scale
# with x' the activations rounded to int8 per token (BitNet's own), W as stored; the head (the embedding) in float.
BITNET_LAYERS = {"linear_class": "autobitlinear", "quantization_mode": "offline", "modules_to_not_convert": ["lm_head"]}


# A Mamba 2 layer's llama.cpp tensors -> keel's names under the mixer's module (`_MAMBA2_MIXER`).
_MAMBA2_TENSORS = {
    MODEL_TENSOR.SSM_IN: "in_proj",
    MODEL_TENSOR.SSM_CONV1D: "conv1d",
    MODEL_TENSOR.SSM_DT: "dt_bias",  # stored as `ssm_dt.bias` (the converter's dt_proj.bias)
    MODEL_TENSOR.SSM_A: "A_log",  # stored as -exp(A_log), [n, 1], without a suffix
    MODEL_TENSOR.SSM_D: "D",  # stored as [n, 1], without a suffix
    MODEL_TENSOR.SSM_NORM: "norm",  # stored as [groups, inner / groups]
    MODEL_TENSOR.SSM_OUT: "out_proj",
}


# Where keel holds the Mamba 2 mixer: Granite 4.0-H's and Mamba 2's is the layer's token mixer, Falcon-H1's beside its
# attention.
_MAMBA2_MIXER = {_A.GRANITE_HYBRID: "self_attn", _A.MAMBA2: "self_attn", _A.FALCON_H1: "mamba"}
_MAMBA2_MIXER |= {_A.NEMOTRON_H: "self_attn", _A.NEMOTRON_H_MOE: "self_attn"}
# A Mamba 1 layer's llama.cpp tensors -> keel's names under self_attn (MambaModel: `ssm_a`, `ssm_d` without a suffix).
_MAMBA1_TENSORS = {
    MODEL_TENSOR.SSM_IN: "in_proj",
    MODEL_TENSOR.SSM_CONV1D: "conv1d",
    MODEL_TENSOR.SSM_X: "x_proj",
    MODEL_TENSOR.SSM_DT: "dt_proj",
    MODEL_TENSOR.SSM_A: "A_log",  # stored as -exp(A_log), [inner, state]
    MODEL_TENSOR.SSM_D: "D",
    MODEL_TENSOR.SSM_OUT: "out_proj",
    MODEL_TENSOR.SSM_DT_NORM: "dt_layernorm",  # Jamba's RMS norms of the step, B and C
    MODEL_TENSOR.SSM_B_NORM: "b_layernorm",
    MODEL_TENSOR.SSM_C_NORM: "c_layernorm",
}


def _flattened(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0].reshape(-1)


def _a_log(arrays: list[np.ndarray]) -> np.ndarray:
    return np.log(-arrays[0]).reshape(-1)


_flattened.moves_rows = _a_log.moves_rows = False  # type: ignore[attr-defined]  # reshaped: no integer blocks


def _mamba2(
    kind: MODEL_TENSOR, suffix: str, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """A Mamba 2 tensor's keel name (under its mixer), HF shape and how to make it from the stored one, undoing
    Mamba2Model.modify_tensors: A_log from -exp(A_log), A and D flattened from [n, 1], the gated norm from
    [groups, inner / groups], conv1d's [C, K] unsqueezed to HF's [C, 1, K]."""
    if kind == MODEL_TENSOR.SSM_A:
        return "A_log", (math.prod(shape),), _a_log
    if kind in (MODEL_TENSOR.SSM_D, MODEL_TENSOR.SSM_DT):
        return _MAMBA2_TENSORS[kind], (math.prod(shape),), _flattened
    name = f"{_MAMBA2_TENSORS[kind]}.{suffix}"
    if kind == MODEL_TENSOR.SSM_NORM:
        return name, (math.prod(shape),), _flattened
    if kind == MODEL_TENSOR.SSM_CONV1D and suffix == "weight":
        return name, (shape[0], 1, shape[-1]), _unsqueezed
    return name, shape, _single


def _mamba1(
    kind: MODEL_TENSOR, suffix: str, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """A Mamba 1 tensor's keel name (under self_attn), HF shape and how to make it from the stored one, undoing
    MambaModel.modify_tensors: A_log from -exp(A_log), conv1d's [C, K] unsqueezed to HF's [C, 1, K]."""
    name = _MAMBA1_TENSORS[kind] + (f".{suffix}" if suffix else "")
    if kind == MODEL_TENSOR.SSM_A:
        return name, shape, _log_of_negated
    if kind == MODEL_TENSOR.SSM_CONV1D and suffix == "weight":
        return name, (shape[0], 1, shape[-1]), _unsqueezed
    return name, shape, _single


def _log_of_negated(arrays: list[np.ndarray]) -> np.ndarray:
    return np.log(-arrays[0])


def _value_order(config: ModelConfig, arch: MODEL_ARCH, size: int) -> np.ndarray:
    """The stored rows (or columns) of the value heads, `size` each, in HF's order. HF groups the value heads by the
    key head they share ([K0 v0, K0 v1, ..., K1 v0, ...]); Qwen3.5's converter stores them tiled ([K0 v0, K1 v0, ...,
    K0 v1, ...], as llama.cpp broadcasts the key heads) where the counts differ, Qwen3-Next's as HF does."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    heads = np.arange(values)
    if arch in _VALUE_HEADS_TILED:
        heads = np.array([j * keys + g for g in range(keys) for j in range(values // keys)], dtype=np.int64)
    return (heads[:, None] * size + np.arange(size)).reshape(-1)


def _linear_layer(config: ModelConfig, layer: int | None) -> bool:
    return layer is not None and config.layer_types[layer] == "linear_attention"


def _gathered(order: np.ndarray) -> Callable[[list[np.ndarray]], np.ndarray]:
    return _single if np.array_equal(order, np.arange(len(order))) else _rows_in_order(order)


def _gated_deltanet(
    config: ModelConfig, arch: MODEL_ARCH, kind: MODEL_TENSOR, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """A Gated DeltaNet tensor's HF shape and how to make it from the stored one: value heads back in HF's order
    (_value_order), A_log from -exp(A_log), conv1d's [C, K] unsqueezed to HF's [C, 1, K]."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    if kind == MODEL_TENSOR.ATTN_QKV:  # queries and keys as stored, the values after them
        keys = 2 * config.linear_num_key_heads * dk
        return shape, _gathered(np.concatenate([np.arange(keys), keys + _value_order(config, arch, dv)]))
    if kind == MODEL_TENSOR.ATTN_GATE:
        return shape, _gathered(_value_order(config, arch, dv))
    if kind in (MODEL_TENSOR.SSM_BETA, MODEL_TENSOR.SSM_ALPHA, MODEL_TENSOR.SSM_DT):
        return shape, _gathered(_value_order(config, arch, 1))
    if kind == MODEL_TENSOR.SSM_A:
        order = _value_order(config, arch, 1)
        return shape, lambda arrays: np.log(-arrays[0])[order]
    if kind == MODEL_TENSOR.SSM_CONV1D:  # channels [q; k; v], like attn_qkv's rows
        keys = 2 * config.linear_num_key_heads * dk
        order = np.concatenate([np.arange(keys), keys + _value_order(config, arch, dv)])
        conv = lambda arrays: arrays[0][order].reshape(shape[0], 1, shape[1])  # noqa: E731
        conv.moves_rows = False  # type: ignore[attr-defined]  # reshaped: no integer blocks (get_blocks)
        return (shape[0], 1, shape[1]), conv
    if kind == MODEL_TENSOR.SSM_OUT:  # the value heads are its input columns
        order = _value_order(config, arch, dv)
        columns = lambda arrays: arrays[0][:, order]  # noqa: E731
        columns.moves_rows = False  # type: ignore[attr-defined]  # columns: no integer blocks, sharded whole
        return shape, _single if np.array_equal(order, np.arange(len(order))) else columns
    return shape, _single  # the gated norm (no 1 + w)


def hf_names_by_gguf(config: ModelConfig, arch: MODEL_ARCH) -> dict[str, str]:
    """llama.cpp tensor name -> the HF name it was converted from, both without `.weight`/`.bias`
    (`blk.0.attn_q` -> `model.layers.0.self_attn.q_proj`), for a checkpoint of `config`.

    gguf's TensorNameMap (the table llama.cpp's converter names tensors by) run forward over the HF
    names such a checkpoint holds: the names keel reads and, for a family that stores them fused or
    renamed (keel.families), the stored ones, which win where both map to one llama.cpp name (Phi-3's
    gate_up_proj and up_proj are both `ffn_up`; its files hold the fused one). Stacked experts have no
    HF name of their own and are placed by their llama.cpp kind (GGUFTensorReader)."""
    key = (repr(config), arch)
    if key not in _NAMES_CACHE:  # the skeleton costs ~10 ms a layer: once per config and process
        if len(_NAMES_CACHE) >= 16:
            _NAMES_CACHE.clear()
        _NAMES_CACHE[key] = _hf_names_by_gguf(config, arch)
    return _NAMES_CACHE[key]


_NAMES_CACHE: dict[tuple[str, MODEL_ARCH], dict[str, str]] = {}


def _hf_names_by_gguf(config: ModelConfig, arch: MODEL_ARCH) -> dict[str, str]:
    from keel.model.transformer import Transformer
    from keel.weights.names import hf_source

    with torch.device("meta"):  # names only; no memory
        skeleton = Transformer(config)
    read = {n for key in skeleton.state_dict() for n in hf_source(config, key, set()).names}
    stored = {name for name, parts in checkpoint_layout(config).items() if parts.keys() & read}
    bases = [hf.rsplit(".", 1)[0] for hf in [*sorted(read), *sorted(stored)]]
    out: dict[str, str] = {}
    # The architecture's own table, then llama's for what it does not list (the dense layers of a
    # Qwen-MoE file with mlp_only_layers), never over a name the own table gave.
    for table in (get_tensor_name_map(arch, config.num_layers), get_tensor_name_map(_A.LLAMA, config.num_layers)):
        found = {}
        for base in bases:
            name = table.get_name(base)
            if name is not None and name not in out:
                found[name] = base
        out.update(found)
        bases = [base for base in bases if base not in out.values()]
    return out


def _kinds(arch: MODEL_ARCH, num_layers: int) -> dict[str, tuple[MODEL_TENSOR, int | None]]:
    """llama.cpp tensor name (without suffix) -> (its kind, its layer) for the architecture's tensors."""
    out: dict[str, tuple[MODEL_TENSOR, int | None]] = {}
    for kind in dict.fromkeys([*MODEL_TENSORS[arch], *MODEL_TENSORS[_A.LLAMA]]):  # as hf_names_by_gguf
        template = TENSOR_NAMES[kind]
        layers = range(num_layers) if "{bid}" in template else [None]
        out.update({template.format(bid=layer): (kind, layer) for layer in layers})
    return out


class GGUFTensorReader:
    """GGUF tensors under HF names in HF layout, dequantized to float32 on `get()`; integer-block
    tensors also as integer blocks (`get_blocks()`), for the integer kernels."""

    def __init__(self, path: Path, reader: GGUFFile, config: ModelConfig) -> None:
        self.path = path
        self._reader: GGUFFile | None = reader
        self._entries: dict[str, _Entry] = {}
        arch = _ARCH_BY_NAME[reader.fields[Keys.General.ARCHITECTURE]]
        moe = "block_sparse_moe" if config.architecture in MIXTRAL_NAMED else "mlp"
        names = hf_names_by_gguf(config, arch)
        kinds = _kinds(arch, config.num_layers)
        layout = checkpoint_layout(config)
        tensors = {t.name: t for t in reader.tensors}
        for name, t in tensors.items():
            base, _, suffix = name.rpartition(".")
            if name in kinds:  # a tensor named without a suffix (Qwen3.5's and Qwen3-Next's ssm_a)
                base, suffix = name, ""
            kind, layer = kinds.get(base, (None, None))
            shape = _hf_shape(t)
            if kind is None:
                self._add_old_expert(name, t)
            elif arch == _A.GEMMA4 and (kind, suffix) in _GEMMA4_TENSORS:  # HF names without `.weight`, the router's
                self._add(f"model.layers.{layer}.{_GEMMA4_TENSORS[kind, suffix]}", (t,), shape, _single)
            elif kind == MODEL_TENSOR.FFN_DOWN_EXP:  # GPT-OSS's experts have biases: [E, H]
                stacked_name = "down_proj" if suffix == "weight" else "down_proj_bias"
                self._add(f"model.layers.{layer}.{moe}.experts.{stacked_name}", (t,), shape, _single)
            elif kind == MODEL_TENSOR.FFN_GATE_EXP:
                up = tensors.get(_tensor(MODEL_TENSOR.FFN_UP_EXP, layer, suffix))
                if up is None:
                    raise WeightsError(f"{path}: tensor {_tensor(MODEL_TENSOR.FFN_UP_EXP, layer, suffix)!r} is missing")
                # HF-v5 stacked layout: [E, 2I, H], gate rows first, then up (biases: [E, 2I]).
                stacked = (shape[0], shape[1] + _hf_shape(up)[1], *shape[2:])
                concat = lambda arrays: np.concatenate(arrays, axis=1)  # noqa: E731
                stacked_name = "gate_up_proj" if suffix == "weight" else "gate_up_proj_bias"
                self._add(f"model.layers.{layer}.{moe}.experts.{stacked_name}", (t, up), stacked, concat)
            elif kind == MODEL_TENSOR.FFN_UP_EXP and _tensor(MODEL_TENSOR.FFN_GATE_EXP, layer, suffix) not in tensors:
                # ungated experts (Nemotron-H's): keel's stacked gate_up_proj holds their up rows alone
                self._add(f"model.layers.{layer}.{moe}.experts.gate_up_proj", (t,), shape, _single)
            elif kind == MODEL_TENSOR.FFN_EXP_PROBS_B:  # the router's selection bias (DeepSeek's, GLM-4.5's)
                self._add(f"model.layers.{layer}.{moe}.gate.e_score_correction_bias", (t,), shape, _single)
            elif kind == MODEL_TENSOR.ATTN_K_B:  # DeepSeek's kv_b_proj, split by current converters (_mla_fields)
                v_b = tensors.get(_tensor(MODEL_TENSOR.ATTN_V_B, layer))
                if v_b is None:
                    raise WeightsError(f"{path}: tensor {_tensor(MODEL_TENSOR.ATTN_V_B, layer)!r} is missing")
                heads, rank, nope = shape
                whole = (heads * (nope + _hf_shape(v_b)[1]), rank)
                self._add(f"model.layers.{layer}.self_attn.kv_b_proj.weight", (t, v_b), whole, _kv_b_from_split)
            elif kind in _ALTUP_STACKED:  # Gemma 3n: the converter stacks AltUp's projections, one per other copy
                for i in range(shape[0]):
                    self._add(f"model.{_ALTUP_STACKED[kind]}.{i}.weight", (t,), shape[1:], _index(i))
            elif kind == MODEL_TENSOR.ALTUP_CORRECT_SCALE:  # (HF's parameter has no `.weight`; the file's has)
                self._add(f"model.layers.{layer}.altup.correct_output_scale", (t,), shape, _single)
            elif kind == MODEL_TENSOR.ATTN_SINKS:  # GPT-OSS: HF's `self_attn.sinks` has no `.weight`
                self._add(f"model.layers.{layer}.self_attn.sinks", (t,), shape, _single)
            elif kind in _MAMBA1_TENSORS and arch in (_A.MAMBA, _A.JAMBA):
                keel_name, hf_shape, combine = _mamba1(kind, suffix, shape)
                self._add(f"model.layers.{layer}.self_attn.{keel_name}", (t,), hf_shape, combine)
            elif kind in _MAMBA2_TENSORS and arch in _MAMBA2_MIXER:
                keel_name, hf_shape, combine = _mamba2(kind, suffix, shape)
                self._add(f"model.layers.{layer}.{_MAMBA2_MIXER[arch]}.{keel_name}", (t,), hf_shape, combine)
            elif kind in _DELTANET_TENSORS and arch in _GATED_DELTANET and _linear_layer(config, layer):
                hf_shape, combine = _gated_deltanet(config, arch, kind, shape)
                self._add(f"model.layers.{layer}.self_attn.{_DELTANET_TENSORS[kind]}", (t,), hf_shape, combine)
            elif arch == _A.KIMI_LINEAR and kind in _KDA_TENSORS and _linear_layer(config, layer):
                keel_name, hf_shape, combine = _kda(config, kind, suffix, shape)
                self._add(f"model.layers.{layer}.self_attn.{keel_name}", (t,), hf_shape, combine)
            elif arch == _A.BITNET and kind in _BITNET_SUB_NORMS:  # (TensorNameMap knows older releases' names)
                self._add(f"model.layers.{layer}.{_BITNET_SUB_NORMS[kind]}.weight", (t,), shape, _single)
            elif arch == _A.BITNET and suffix == "scale" and base in names:  # [1], multiplied in after the product
                self._add(f"{names[base]}.weight_scale", (t,), (1,), _flattened)
            elif kind == MODEL_TENSOR.ATTN_QKV and arch == _A.CHATGLM:
                self._add_chatglm_qkv(config, layout, layer, suffix, t, shape)
            elif base in names:
                # (Falcon-H1's converter names its MLP norm `ffn_norm`, without `.weight`)
                hf = f"{names[base]}.{suffix or 'weight'}"
                if kind == MODEL_TENSOR.FFN_GATE_INP_SHEXP:  # stored as [H]; HF's shared_expert_gate is Linear(H, 1)
                    row = lambda arrays: arrays[0].reshape(1, -1)  # noqa: E731
                    self._add(hf, (t,), (1, shape[-1]), row)
                elif kind == MODEL_TENSOR.SHORTCONV_CONV and suffix == "weight":
                    # LFM2Model squeezes the depthwise Conv1d's [C, 1, K] to [C, K] (llama.cpp's ssm_conv is 2-D).
                    for part in layout.get(hf, {hf: None}):
                        self._add(part, (t,), (shape[0], 1, shape[-1]), _unsqueezed)
                elif hf in layout and isinstance(layout[hf].get(hf), Columns):  # per-head q/k norms (Command R+)
                    self._add(hf, (t,), shape, _columns_in_order(layout[hf][hf].order))
                elif hf in layout and _regrouped(layout[hf], shape[0]):  # q/k rows regrouped (interleaved pairs)
                    ((part, spans),) = layout[hf].items()
                    order = np.concatenate([np.arange(a, b) for a, b in spans])
                    self._add(part, (t,), shape, _rows_in_order(order))
                elif hf in layout:  # the family's fused or renamed tensor: the parts keel reads
                    start = 0
                    for part, rows in layout[hf].items():
                        if isinstance(rows, Transposed):  # GPT2Model stores HF's Conv1D weights transposed: Linear's
                            rows = rows.rows
                        if rows is not None and len(rows) != 1 and arch in _GATED_DELTANET:
                            # stored as HF stores it: each head's queries then gate in q_proj, Qwen3-Next's
                            # in_proj_ba (and in_proj_qkvz, older files' ssm_in) grouped by key head
                            order = np.concatenate([np.arange(a, b) for a, b in rows])
                            self._add(part, (t,), (len(order), *shape[1:]), _rows_in_order(order))
                            continue
                        if rows is not None and len(rows) != 1 and arch not in (_A.GPTNEOX, _A.FALCON, _A.BLOOM):
                            raise WeightsError(f"{path}: tensor {name!r} holds interleaved parts; not read from GGUF")
                        if rows is not None and len(rows) != 1:
                            # GPT-NeoX's and BLOOM's q/k/v, interleaved per head in HF's query_key_value, and
                            # Falcon's, grouped by KV head: the converters store all of q, then k, then v
                            # (FalconModel's "jploski" layout), so each part is one run of rows.
                            rows = [(start, start + sum(stop - first for first, stop in rows))]
                        span = None if rows is None else rows[0]
                        start = start if span is None else span[1]
                        part_shape = shape if span is None else (span[1] - span[0], *shape[1:])
                        # (a renamed q/k, Nemotron-H's, un-permuted as its own)
                        combine = _stored(config, arch, hf, kind, suffix) if span is None else _norm_offset(arch, hf)
                        self._add(part, (t,), part_shape, combine, span)
                else:
                    self._add(hf, (t,), shape, _stored(config, arch, hf, kind, suffix))
            # else: rope_freqs (read into the config), up experts (with the gate's) and tensors keel has no use for
        if arch == _A.BITNET:  # no `.scale` tensor (the converter folds the scale into the weights): 1
            for base, hf in names.items():
                if kinds.get(base, (None,))[0] in _BITNET_TERNARY and f"{hf}.weight_scale" not in self._entries:
                    self._add(f"{hf}.weight_scale", (), (1,), _constant(1.0, (1,)))
        if arch == _A.APERTUS:  # xIELU's parameters, per layer in metadata (ApertusModel): tensors of their own in HF
            for key, param in _XIELU.items():
                for layer, value in enumerate(reader.fields[key]):
                    shape = (1,) if param.startswith("alpha") else ()
                    self._add(f"model.layers.{layer}.mlp.act_fn.{param}", (), shape, _constant(value, shape))

    def _add_chatglm_qkv(
        self, config: ModelConfig, layout: dict[str, Any], layer: int | None, suffix: str, t: GGUFTensor, shape
    ) -> None:
        """ChatGLM's query_key_value (`attn_qkv`, rows [all q; all k; all v], as llama.cpp views them) read as GLM's
        q_proj, k_proj and v_proj: each its run of rows, q's and k's in the family's regrouped order."""
        widths = {"q_proj": config.num_heads * config.head_dim, "k_proj": config.num_kv_heads * config.head_dim}
        widths["v_proj"] = widths["k_proj"]
        if sum(widths.values()) != shape[0]:
            raise WeightsError(f"{self.path}: tensor {t.name!r} has {shape[0]} rows, not q, k and v's {widths}")
        start = 0
        for part, width in widths.items():
            hf = f"model.layers.{layer}.self_attn.{part}.{suffix}"
            span = (start, start + width)
            spans = layout.get(hf, {}).get(hf)
            if spans:  # q/k rows regrouped (interleaved pairs), within the part's own rows
                order = np.concatenate([np.arange(a, b) for a, b in spans])
                self._add(hf, (t,), (width, *shape[1:]), _rows_in_order(order), span)
            else:
                self._add(hf, (t,), (width, *shape[1:]), _single, span)
            start += width

    def _add_old_expert(self, name: str, t: GGUFTensor) -> None:
        for kind, pattern in _OLD_EXPERT.items():
            if match := pattern.match(name):
                layer, expert = match.groups()
                hf = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT[kind]}.weight"
                self._add(hf, (t,), _hf_shape(t), _single)

    def _add(
        self, name: str, sources: tuple[GGUFTensor, ...], shape: tuple[int, ...], combine, rows: Rows = None
    ) -> None:
        self._entries[name] = _Entry(sources, shape, combine, rows)

    def names(self) -> set[str]:
        return set(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise WeightsError(f"{self.path}: tensor {name!r} not found in the checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        """The ggml storage type (F32, Q4_K, ...) of the tensor's first GGUF source (F32 for one from metadata)."""
        sources = self._entry(name).sources
        return sources[0].tensor_type.name if sources else _T.F32.name

    def gguf_names(self, name: str) -> list[str]:
        """The llama.cpp tensor names behind an HF name."""
        return [t.name for t in self._entry(name).sources]

    def get(self, name: str) -> Tensor:
        if self._reader is None:
            raise WeightsError(f"{self.path}: the checkpoint is closed")
        entry = self._entry(name)
        arrays = [_to_numpy(t, self.path, entry.rows) for t in entry.sources]
        try:
            array = entry.combine(arrays)
        except ValueError as e:  # e.g. a q/k row count that does not split into the config's heads
            raise WeightsError(f"{self.path}: cannot form tensor {name!r} ({_one_line(e)})") from None
        # F32 tensors are read-only views of the memory map and permuted ones are strided: copy those.
        if not (array.flags.writeable and array.flags.c_contiguous and array.dtype == np.float32):
            array = np.array(array, dtype=np.float32, order="C", copy=True)
        return torch.from_numpy(array)

    def get_shard(self, name: str, shard: Shard | None) -> Tensor:
        """A parallel rank's slice (keel.weights.shard.Shard; None: all) of a 2-D tensor, dequantizing
        only the rows it covers, and of those rows only the blocks it covers when its columns start and end
        on a block boundary (else whole rows, then cut). q/k rows are cut at head boundaries, so a row
        shard is un-permuted head by head like the whole tensor."""
        entry = self._entry(name)
        if shard is None:
            return self.get(name)
        if len(entry.sources) != 1 or len(entry.shape) != 2 or not getattr(entry.combine, "moves_rows", True):
            return narrow(self.get(name), shard)  # stacked experts, columns reordered: read whole, then cut
        t = entry.sources[0]
        _check_type(t, self.path)
        rows, cols = entry.shape
        data, _ = _raw(t, entry.rows)
        raw = np.asarray(data).reshape(rows, -1)  # one row per HF row: bytes of blocks, or values
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        start, stop = shard.start, shard.stop
        cut_after = None
        order = getattr(entry.combine, "order", None)
        if shard.dim == 0:
            part, width = (raw[start:stop] if order is None else raw[order[start:stop]]), cols
        elif start % block == 0 and stop % block == 0:
            if raw.dtype == np.uint8:  # raw bytes: type_size of them per block of `block` values
                lo, hi = start // block * type_size, stop // block * type_size
            else:  # float values
                lo, hi = start, stop
            part, width = raw[:, lo:hi], stop - start
        else:
            part, width, cut_after = raw, cols, (start, stop)
        try:
            array = dequantize(np.ascontiguousarray(part), t.tensor_type).reshape(part.shape[0], width)
        except Exception as e:
            raise WeightsError(f"{self.path}: cannot read a slice of tensor {t.name!r} ({_one_line(e)})") from None
        if cut_after is not None:
            array = array[:, cut_after[0] : cut_after[1]]
        heads = getattr(entry.combine, "heads", None)
        if heads is not None and shard.dim == 0:
            array = _unpermute(heads * (stop - start) // rows)([array])
        elif heads is not None or (order is not None and shard.dim != 0):  # a column shard keeps every row
            array = entry.combine([array])
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))

    def get_blocks(self, name: str) -> QuantBlocks | None:
        """The tensor as integer codes and group scales (keel.weights.gguf_blocks), or None when any of
        its GGUF sources has no integer form or they differ in kind or group (then it loads as float
        through `get()`). The combination (llama q/k un-permute, gate+up concatenation, a fused tensor's
        rows) moves whole rows, so it applies to codes and scales alike."""
        if self._reader is None:
            raise WeightsError(f"{self.path}: the checkpoint is closed")
        entry = self._entry(name)
        specs = [BLOCK_TYPES.get(t.tensor_type) for t in entry.sources]
        if not getattr(entry.combine, "moves_rows", True) or None in specs or len({s.form for s in specs}) != 1:  # type: ignore[union-attr]
            return None
        spec = specs[0]
        parts = [decode_blocks(t.tensor_type, *_raw(t, entry.rows)) for t in entry.sources]
        try:
            codes = entry.combine([p[0] for p in parts])
            scales = entry.combine([p[1] for p in parts])
            mins = entry.combine([p[2] for p in parts]) if parts[0][2] is not None else None
        except ValueError as e:
            raise WeightsError(f"{self.path}: cannot form tensor {name!r} ({_one_line(e)})") from None
        if tuple(codes.shape) != entry.shape:
            raise WeightsError(
                f"{self.path}: tensor {name!r} decodes to {list(codes.shape)}, expected {list(entry.shape)}"
            )
        own = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return QuantBlocks(
            spec.kind,
            spec.group,
            tuple(t.tensor_type.name for t in entry.sources),
            own(codes),
            own(scales),
            None if mins is None else own(mins),
        )

    def close(self) -> None:
        # Dropping the file (and the tensor views) releases the memory map.
        self._reader = None
        self._entries = {}
