"""The decoder stack: one definition for training, prefill and decode, dense or MoE.

Module names follow the HF layout (`embed_tokens`, `layers.N.self_attn.q_proj`, ...) minus the
`model.` prefix, so checkpoints map with few renames. Layers live in a ModuleDict keyed by
their global index, and `embed_tokens`, `norm` and `lm_head` may be None, so that a pipeline
stage is the same class with some parts removed (the torchtitan convention).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.altup import SQRT2, AltUp, Laurel, merge, spread
from keel.model.attention import Attention, AttentionMetadata, KVCache, query_scale
from keel.model.fused_layer import fused_forward, fused_layers
from keel.model.kda import KimiDeltaAttention
from keel.model.layers import (
    HeadNorm,
    LowRankGatedRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositions,
    SwiGLU,
    activation,
    block_norm,
    building_on_meta,
)
from keel.model.lightning import LightningAttention
from keel.model.linear_attention import GatedDeltaNet
from keel.model.mamba import Mamba2Mixer
from keel.model.mamba1 import Mamba1Mixer
from keel.model.mla import MLAttention
from keel.model.moa import MixtureOfAttention
from keel.model.moe import MoE
from keel.model.rglru import RGLRUBlock
from keel.model.short_conv import ShortConv

# Recurrent layers by their `layer_types` kind (keel.model.recurrent): a state per sequence instead of K/V.
RECURRENT_MIXERS: dict[str, type[nn.Module]] = {
    "linear_attention": GatedDeltaNet,
    "conv": ShortConv,
    "mamba": Mamba2Mixer,
    "mamba1": Mamba1Mixer,
    "lightning": LightningAttention,
    "rglru": RGLRUBlock,
}


def token_mixer(config: ModelConfig, layer: int) -> nn.Module:
    """A layer's token mixer (keel's `self_attn`): its recurrent kind's module, else attention (multi-head latent
    attention where the config has it)."""
    recurrent = RECURRENT_MIXERS.get(config.layer_types[layer])
    if recurrent is GatedDeltaNet and config.linear_variant == "kda":
        recurrent = KimiDeltaAttention
    if recurrent is not None:
        return recurrent(config, layer)
    if config.mixture_of_attention:  # JetMoE's attention experts
        return MixtureOfAttention(config, layer)
    return MLAttention(config, layer) if config.is_mla else Attention(config, layer)


class DecoderLayer(nn.Module):
    """A token mixer and an MLP, each in its residual branch with its norms; a layer may have one of the two alone
    (`ModelConfig.has_mixer` / `has_mlp`: Nemotron-H), whose absent sublayer and its norms are None."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, placement = config.hidden_size, config.layer_norm_placement(layer)
        pre, post = placement != "post", placement in ("post", "sandwich")
        mixer, mlp = config.has_mixer(layer), config.has_mlp(layer)
        # Before each sublayer (input_layernorm, post_attention_layernorm: HF's Llama names), after each on its
        # output (attn_output_norm, mlp_output_norm), or both: config.norm_placement (the layer's own:
        # layer_norm_placement). OPT-350m's post_residual: the same two norms, each after its sublayer's residual add.
        self.norm_after_residual = placement == "post_residual"
        self.input_layernorm: nn.Module | None = block_norm(config, h) if pre and mixer else None
        self.self_attn: nn.Module | None = token_mixer(config, layer) if mixer else None
        self.post_attention_layernorm: nn.Module | None = (
            block_norm(config, h) if pre and mlp and config.post_attention_norm else None
        )
        if config.gated_norm_rank:  # A.X-K2: the input norm gated in every layer, the experts' input norm too
            rank = config.gated_norm_rank
            self.input_layernorm = LowRankGatedRMSNorm(h, config.rms_norm_eps, rank)
            if config.is_moe_layer(layer):
                self.post_attention_layernorm = LowRankGatedRMSNorm(h, config.rms_norm_eps, rank)
        self.attn_output_norm: nn.Module | None = block_norm(config, h) if post and mixer else None
        self.mlp_output_norm: nn.Module | None = block_norm(config, h) if post and mlp else None
        # Falcon-H1's "hybrid" layers: a Mamba 2 mixer beside the attention, on the same normed input
        self.mamba: Mamba2Mixer | None = Mamba2Mixer(config, layer) if config.layer_types[layer] == "hybrid" else None
        self.branch_multipliers = (
            config.attention_in_multiplier,
            config.attention_out_multiplier,
            config.mamba_in_multiplier,
            config.mamba_out_multiplier,
        )
        self.residual_multiplier = config.residual_multiplier  # Granite: sublayer outputs scaled before the add
        # MiniMax: (alpha, beta) of the mixer's and the MLP's residual adds, whose residual is the normed input
        self.normed_residual: tuple[tuple[float, float], tuple[float, float]] | None = None
        if config.normed_residual:
            mixer_kind = "lightning" if config.layer_types[layer] == "lightning" else "attn"
            self.normed_residual = (
                (getattr(config, f"{mixer_kind}_residual_alpha"), getattr(config, f"{mixer_kind}_residual_beta")),
                (config.mlp_residual_alpha, config.mlp_residual_beta),
            )
        self.parallel_residual = config.parallel_residual
        self.mlp: nn.Module | None = None
        if mlp:
            self.mlp = (
                MoE(config)
                if config.is_moe_layer(layer)
                else SwiGLU(
                    config.hidden_size,
                    config.layer_intermediate_size(layer),
                    config.mlp_bias,
                    config.hidden_act,
                    config.mlp_gated,
                    config.mlp_gate_multiplier,
                    config.mlp_down_multiplier,
                    config.layer_activation_sparsity(layer),
                    config.rms_norm_eps if config.ffn_sub_norm else None,
                    config.adapter_rank if config.shared_hybrid(layer) else 0,
                )
            )
        # Zamba 2's hybrid layers: a copy of a shared transformer block (its attention's norm over the stream and the
        # embedding side by side), its output projected back (`shared_linear`) and added to the input of the
        # layer's Mamba 2 mixer (`mamba`, normed by `mamba_layernorm`)
        self.shared_linear: nn.Linear | None = None
        self.mamba_layernorm: nn.Module | None = None
        if config.shared_hybrid(layer):
            self.input_layernorm = block_norm(config, 2 * h)
            self.shared_linear = nn.Linear(h, h, bias=False)
            self.mamba_layernorm = block_norm(config, h)
        if isinstance(self.mlp, MoE) and self.mlp.shared_input_norm is not None:
            self.post_attention_layernorm = None  # Gemma 4: the MoE block norms its branches' inputs itself
        # Gemma 4 E2B/E4B: a residual branch after the MLP that gates the layer's per-layer input
        self.layer = layer
        self.per_layer_input_gate: nn.Linear | None = None
        if config.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(h, config.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(config.per_layer_input_size, h, bias=False)
            self.post_per_layer_input_norm = block_norm(config, h)
            self.per_layer_act = activation(config.hidden_act)
        # Gemma 3n: LAuReL's branch beside the attention; AltUp's prediction and correction of the stream's copies
        self.laurel: Laurel | None = Laurel(config) if config.laurel_rank else None
        self.altup: AltUp | None = AltUp(config) if config.altup_num_inputs else None
        # Gemma 4: the layer's output, residual stream included, times a stored scalar
        self.layer_scalar: Tensor | None
        if config.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        fused = fused_forward(self, x, meta)  # serving on keel's CPU kernels: the layer in one call
        if fused is not None:
            return fused
        if self.altup is not None:
            return self._altup_forward(x, meta)
        out = self._block(x, meta)
        if self.per_layer_input_gate is not None:
            out = out + self._per_layer_branch(out, meta)
        # in the activations' dtype, as transformers holds the buffer in the model's (keel's loads keep float32)
        return out if self.layer_scalar is None else out * self.layer_scalar.to(out.dtype)

    def _per_layer_branch(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """The per-layer input branch (per_layer_input_size): x gated, times the layer's input, projected, normed."""
        gated = self.per_layer_act(self.per_layer_input_gate(x)) * meta.per_layer_inputs[:, :, self.layer]
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))

    def _altup_forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """x [n, B, S, H]: the copies predicted, the sublayers on the active one, all corrected; the per-layer input
        branch reads the corrected active copy and joins the copies after the first (transformers' order)."""
        altup = self.altup
        predictions = altup.predict(x)
        corrected = altup.correct(predictions, self._block(predictions[altup.active], meta))
        if self.per_layer_input_gate is None:
            return corrected
        branch = self._per_layer_branch(altup.scale_output(corrected[altup.active]), meta)
        return torch.cat([corrected[:1], corrected[1:] + branch])

    def _block(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if self.shared_linear is not None:  # Zamba 2: the shared block (no residuals), then the mixer on x plus it
            out = self.self_attn(self.input_layernorm(torch.cat((x, meta.embeddings), dim=-1)), meta)
            out = self.shared_linear(self.mlp(self.post_attention_layernorm(out)))
            return x + self.mamba(self.mamba_layernorm(x + out), meta)
        if self.mamba is not None:  # Falcon-H1: attention and the mixer side by side, each with its multipliers
            h = self.input_layernorm(x)
            attn_in, attn_out, mamba_in, mamba_out = self.branch_multipliers
            mixed = self.self_attn(h * attn_in, meta) * attn_out + self.mamba(h * mamba_in, meta) * mamba_out
            x = x + mixed
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.normed_residual is not None:  # MiniMax: x = alpha norm(x) + beta sublayer(norm(x)), twice
            (a1, b1), (a2, b2) = self.normed_residual
            h = self.input_layernorm(x)
            x = h * a1 + self.self_attn(h, meta) * b1
            h = self.post_attention_layernorm(x)
            return h * a2 + self.mlp(h) * b2
        m = self.residual_multiplier  # on every block shape: each sublayer's output (after its output norm)
        if self.norm_after_residual:  # OPT-350m: x = norm(x + sublayer(x)), attention then the MLP
            out = self.self_attn(x, meta)
            x = self.input_layernorm(x + (out if m == 1.0 else out * m))
            out = self.mlp(x)
            return self.post_attention_layernorm(x + (out if m == 1.0 else out * m))
        if self.parallel_residual:  # both sublayers read the block's input (GPT-NeoX, StableLM's option)
            normed = self.input_layernorm(x)
            mlp_in = normed if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
            if m != 1.0:
                return x + self.self_attn(normed, meta) * m + self.mlp(mlp_in) * m
            return x + self.self_attn(normed, meta) + self.mlp(mlp_in)
        if self.self_attn is not None:
            h = x if self.input_layernorm is None else self.input_layernorm(x)
            out = self.self_attn(h, meta)
            if self.attn_output_norm is not None:  # norms on the sublayers' outputs (OLMo 2; Gemma's sandwich)
                out = self.attn_output_norm(out)
            x = x + (out if m == 1.0 else out * m)
            if self.laurel is not None:  # Gemma 3n: LAuReL's branch on the attention's normed input
                x = (x + self.laurel(h)) / SQRT2
        if self.mlp is not None:
            h = x if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
            out = self.mlp(h)
            if self.mlp_output_norm is not None:
                out = self.mlp_output_norm(out)
            x = x + (out if m == 1.0 else out * m)
        return x


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding; on the meta device without its N(0, 1) initialisation (`building_on_meta`)."""
    if building_on_meta():
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        width = config.embedding_size or config.hidden_size  # the embedding's and the head's
        self.embed_tokens: nn.Embedding | None = _embedding(config.vocab_size, width)
        # OPT-350m's projections between a narrower embedding and the model (config.embedding_size): project_in goes
        # with embed_tokens, project_out with the head
        self.project_in: nn.Linear | None = None
        self.project_out: nn.Linear | None = None
        if config.embedding_size:
            self.project_in = nn.Linear(width, config.hidden_size, bias=False)
            self.project_out = nn.Linear(config.hidden_size, width, bias=False)
        # GPT-2's learned absolute positions (config.position_embedding): a table added to the token embedding, held
        # with embed_tokens (a pipeline's first stage); its layers do not rotate.
        # XGLM's fixed sinusoidal ones take its place, computed each forward (no weights).
        self.embed_positions: nn.Embedding | SinusoidalPositions | None = None
        if config.learned_positions:
            self.embed_positions = _embedding(config.learned_positions, config.hidden_size)
        elif config.position_embedding == "sinusoidal":
            self.embed_positions = SinusoidalPositions(config.hidden_size, config.position_padding_idx)
        # NanoChat's norm of the embedding (weightless: no parameter to share with `norm`); it goes with embed_tokens.
        self.embedding_norm: nn.Module | None = None
        if config.embedding_norm:
            self.embedding_norm = block_norm(config, config.hidden_size)
        # Gemma 4 E2B/E4B's per-layer inputs (config.per_layer_input_size), held with embed_tokens
        self.embed_tokens_per_layer: nn.Embedding | None = None
        if config.per_layer_input_size:
            # (its own name: `width` is still the head's, below)
            per_layer_width = config.num_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = _embedding(config.ple_vocab_size, per_layer_width)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, per_layer_width, bias=False)
            self.per_layer_projection_norm = block_norm(config, config.per_layer_input_size)
        # Gemma 3n's AltUp: the projections making the stream's copies from the embedding and merging them back
        self.altup_projections: nn.ModuleList | None = None
        self.altup_unembed_projections: nn.ModuleList | None = None
        if config.altup_num_inputs:
            h, copies = config.hidden_size, range(config.altup_num_inputs - 1)
            self.altup_projections = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in copies)
            self.altup_unembed_projections = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in copies)
        self.rotary = RotaryEmbedding(config)
        # no layer rotating (learned positions: GPT-2, OPT): no rotary table to compute each forward
        self.rotates = any(config.layer_rotates(i) for i in range(config.num_layers))
        self.sliding_rotary = RotaryEmbedding(config, sliding=True) if config.sliding_rope_theta is not None else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_layers)})
        # (without a final norm, an identity: None marks a pipeline stage without the head)
        self.norm: nn.Module | None = (
            block_norm(config, config.hidden_size, config.final_norm_eps) if config.final_norm else nn.Identity()
        )
        self.lm_head: nn.Linear | None = nn.Linear(width, config.vocab_size, bias=config.lm_head_bias)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call again after loading)."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            if self.lm_head.weight is not self.embed_tokens.weight:  # FSDP keeps its own tie: leave it be
                self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self, device: torch.device | str = "cpu") -> None:
        """Recompute non-persistent buffers, e.g. after building on the meta device."""
        self.rotary.reset_buffers(torch.device(device))
        if self.sliding_rotary is not None:
            self.sliding_rotary.reset_buffers(torch.device(device))

    def fix_rope_context(self, max_model_len: int) -> None:
        """LongRoPE: one set of frequencies for every position from now on, the long one where sequences may pass
        the pre-training context (`max_model_len` beyond it), so that all keys a serving cache holds are rotated
        alike (llama.cpp chooses by its context size too); without it, each forward chooses as transformers does
        (keel.model.layers.RotaryEmbedding). Other RoPE kinds: no change."""
        for rotary in (self.rotary, self.sliding_rotary):
            if rotary is not None and rotary.longrope:
                rotary.long_context = max_model_len > rotary.scaling.original_max_position_embeddings

    def _per_layer_inputs(self, tokens: Tensor, embedded: Tensor) -> Tensor:
        """[B, S, layers, P]: the tokens' rows of the per-layer table (times P^1/2) and the embedding's projection
        (times hidden_size^-1/2, normed per layer), summed and times 2^-1/2 (transformers' get_per_layer_inputs and
        project_per_layer_inputs)."""
        c = self.config
        shape = (*tokens.shape, c.num_layers, c.per_layer_input_size)
        # ids past the table (Gemma 3n's image and audio tokens) read its row 0, as transformers' Gemma 3n does
        tokens = torch.where(tokens < c.ple_vocab_size, tokens, 0)
        table = (self.embed_tokens_per_layer(tokens) * c.per_layer_input_size**0.5).reshape(shape)
        projected = self.per_layer_model_projection(embedded) * c.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + table) * 2**-0.5

    @property
    def dtype(self) -> torch.dtype:
        # A model with every weight quantized (OLMo's, which has no norm weights) has no float parameter: its
        # quantized embedding's compute dtype is the model's.
        param = next(self.parameters(), None)
        return param.dtype if param is not None else self.embed_tokens.compute_dtype

    @property
    def device(self) -> torch.device:
        param = next(self.parameters(), None)
        return param.device if param is not None else next(self.buffers()).device

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        *,
        last_only: bool = False,
        select: Tensor | None = None,
    ) -> Tensor:
        """tokens [B, S] ids (or [B, S, H] hidden states on a later pipeline stage) -> logits [B, S, V].

        positions [B, S]: absolute positions (default 0..S-1). cache: a KVCache for incremental
        decoding. last_only: compute logits only for the last position (generation). select: indices
        into the flattened B*S tokens whose logits are wanted (a packed serving batch) -> [N, V].
        """
        b, s = tokens.shape[:2]  # token ids [B, S], or a later stage's hidden states [B, S, H]
        if positions is None and cache is None:
            meta = AttentionMetadata.for_sequence(b, s, device=tokens.device)
        else:
            if positions is None:
                raise ValueError("positions are required with a KV cache")
            meta = AttentionMetadata(positions=positions, cache=cache)
        if self.embed_tokens is not None:
            h = self.embed_tokens(tokens)
            if self.config.embedding_multiplier != 1.0:  # Granite
                h = h * self.config.embedding_multiplier
            if self.project_in is not None:  # OPT-350m: to the model's width, before the positions join
                h = self.project_in(h)
            if self.embed_positions is not None:  # learned absolute positions (GPT-2), or sinusoidal ones (XGLM)
                h = h + self.embed_positions(meta.positions + self.config.position_offset).to(h.dtype)
            if self.embedding_norm is not None:
                h = self.embedding_norm(h)
            if self.embed_tokens_per_layer is not None:
                meta.per_layer_inputs = self._per_layer_inputs(tokens, h)
            if self.config.hybrid_block == "shared":  # Zamba 2's hybrid layers read the embedding beside the stream
                meta.embeddings = h
        else:
            h = tokens
        if self.altup_projections is not None:  # Gemma 3n: the stream's copies [n, B, S, H] through the layers
            h = spread(h, self.altup_projections)
        if self.rotates:
            meta.rope = self.rotary(meta.positions, h.dtype)
        if self.sliding_rotary is not None:
            meta.sliding_rope = self.sliding_rotary(meta.positions, h.dtype)
        beta = self.config.query_scale_beta
        if beta:
            c = self.config
            meta.query_scale = query_scale(meta.positions + c.query_scale_offset, beta, c.query_scale_length, h.dtype)
        fused = fused_layers(self.layers, h, meta)  # serving on keel's CPU kernels: one call
        if fused is not None:
            h = fused
        else:
            for layer in self.layers.values():
                h = layer(h, meta)
        if self.norm is None:
            return h
        # the positions wanted, before AltUp's merge (per token: the copies [n, B, S, H] of those positions alone)
        if last_only:
            h = h[..., -1:, :]
        elif select is not None:
            h = h.reshape(*h.shape[:-3], -1, h.shape[-1]).index_select(-2, select)
        if self.altup_unembed_projections is not None:
            h = merge(h, self.altup_unembed_projections)
        h = self.norm(h)
        if self.lm_head is None:
            return h
        if self.project_out is not None:  # OPT-350m: to the head's width
            h = self.project_out(h)
        logits = self.lm_head(h)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """A randomly initialised model (tests, training from scratch)."""
    with torch.device(device):
        model = Transformer(config)
    init_weights(model)
    if dtype is not None:
        model.to(dtype)
    return model


@torch.no_grad()
def init_weights(model: Transformer, std: float = 0.02) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm | nn.LayerNorm | HeadNorm):
            nn.init.constant_(module.weight, 1.0 - getattr(module, "offset", 0.0))
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, AltUp):
            nn.init.zeros_(module.correct_output_scale)  # transformers' start: the per-layer branch reads nothing
        elif isinstance(module, DecoderLayer) and module.layer_scalar is not None:
            module.layer_scalar.fill_(1.0)
        elif isinstance(module, MoE):
            nn.init.normal_(module.router.weight, std=std)
            for scale in (module.router.input_scale, module.router.expert_scale):
                if scale is not None:
                    nn.init.ones_(scale)
            nn.init.normal_(module.experts.gate_up_proj, std=std)
            nn.init.normal_(module.experts.down_proj, std=std)
            for bias in (
                module.router.bias,
                module.experts.gate_up_proj_bias,
                module.experts.down_proj_bias,
                module.output_bias,
            ):
                if bias is not None:
                    nn.init.zeros_(bias)
        elif isinstance(module, MixtureOfAttention):  # JetMoE's attention experts (before Attention's sinks)
            for weight in (module.router.weight, module.q_experts, module.o_experts):
                nn.init.normal_(weight, std=std)
            if module.output_bias is not None:
                nn.init.zeros_(module.output_bias)
        elif isinstance(module, Attention) and module.sinks is not None:
            nn.init.normal_(module.sinks, std=std)  # GPT-OSS's sinks start as transformers initialises them
