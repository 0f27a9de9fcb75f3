"""Batched sampling for the serving engine, after vLLM v1's sampler.

One call samples one token for every row of a batch: per-row parameters become tensors once per
call, and every step (penalties, min_tokens, temperature, top-k, top-p, min-p, the draw) is one
vectorised op over the batch. Nothing here reads a tensor back to the host, so the step stays
sync-free until the caller reads the token ids.

Seeded requests: each carries its own `torch.Generator` (made once per request by
`request_generator`, passed again at every step). The draw is an exponential race
(argmax of p / q with q ~ Exp(1), which picks token i with probability p_i); a seeded row draws
its q from its own generator, so its tokens never depend on which other requests share the batch.

On a CPU where keel's kernels run, the filters and the draw of float32 logits are one operator
(`keel::sample_rows`, keel/kernels/csrc/ops_sample.cpp): the same filters, applied by selecting each
row's candidates instead of sorting its vocabulary, and the draw by inverting the kept distribution's
CDF with one uniform number per row (a seeded row's from its own generator). Same distribution, and
still batch-independent for seeded rows, but not the exponential race's tokens for a given seed; at
64 rows of a 49k vocabulary the torch path spent ~0.5 s of CPU a step on top-k/top-p
(docs/BENCHMARKS.md).

Logprobs are vLLM's default "raw" logprobs: log_softmax of the model's logits, before penalties,
temperature and filters. They describe the model, not the sampling transform, and are the same
whatever the request's sampling parameters (what OpenAI clients expect from `logprobs`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel import kernels
from keel.errors import KeelError
from keel.serve.constraints import apply_constraints, has_constraints
from keel.serve.staging import to_device
from keel.serve.structured.params import StructuredOutputsParams

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """Which outputs `LLMEngine.step()` returns for a request, vLLM's: every step's whole output so far
    (CUMULATIVE), every step's new text and tokens only (DELTA), or only the finished output (FINAL_ONLY,
    what `keel.LLM.generate` asks for: no per-step copies of a long output, no per-step objects)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters; names and defaults as vLLM's `SamplingParams`."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token; 0: only the sampled token's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Token constraints (keel.serve.constraints), vLLM's names: a bias added to each listed token's
    # logit, the only tokens that may be sampled, words that may not be generated (token sequences
    # filled in by the engine from the tokenizer), and a grammar the output must match.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # The OpenAI API accepts a single string (or null) for `stop`.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def reads_own_tokens(self) -> bool:
        """Whether drawing a token reads the request's previous tokens on the host (penalties, min_tokens, bad
        words, a grammar) or its prompt's logits (prompt logprobs): such a step cannot be queued before the
        previous step's tokens are read back (asynchronous scheduling)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.min_tokens
            or self.bad_words
            or self.bad_words_token_ids
            or self.structured_outputs is not None
            or self.prompt_logprobs is not None
        )

    def validate(self) -> None:
        """Raise KeelError naming the first out-of-range field."""

        def fail(name: str, requirement: str, value: object) -> None:
            raise KeelError(f"{name} must be {requirement}, got {value!r}")

        if self.n < 1:
            fail("n", ">= 1", self.n)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind", self.output_kind)
        if self.max_tokens < 1:
            fail("max_tokens", ">= 1", self.max_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if not self.temperature >= 0:  # NaN too
            fail("temperature", ">= 0", self.temperature)
        if not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            fail("top_k", "-1, 0 (off) or >= 1", self.top_k)
        if not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1]", self.min_p)
        if not self.repetition_penalty > 0:  # NaN too
            fail("repetition_penalty", "> 0", self.repetition_penalty)
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                fail(name, f"in [0, {MAX_LOGPROBS}]", value)
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    fail("logit_bias", "keyed by token ids >= 0", token)
                if not -100 <= bias <= 100:
                    fail("logit_bias", "values in [-100, 100]", bias)
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "a non-empty list of token ids >= 0", self.allowed_token_ids)
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            fail("bad_words", "a list of non-empty strings", self.bad_words)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise KeelError naming a field whose token id is outside the model's vocabulary."""
        named = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        for name, ids in named.items():
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise KeelError(f"{name}: token id {bad} is out of range [0, {vocab_size})")


def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator of a seeded request (None when unseeded).

    It must live on the device of the logits: `Tensor.exponential_` takes only a generator of
    its own device.
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


@dataclass
class RowState:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    generator: torch.Generator | None = None  # owned by the caller; the same object every step
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    token_bitmask: Tensor | None = None  # [ceil(V / 32)] int32: the tokens the request's grammar allows


@dataclass
class TokenLogprobs:
    """The logprob of one token, its rank (1 = most likely), and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class LogprobsTensors:
    """Logprobs for a batch, still on the device; `to_lists` reads them back in one go."""

    num_logprobs: list[int | None]  # per row: the n asked for (None: the row asked for none)
    sampled_logprobs: Tensor  # [N]
    ranks: Tensor  # [N], 1-based
    top_ids: Tensor  # [N, K], K = the largest n in the batch; row i uses the first n_i columns
    top_logprobs: Tensor  # [N, K]

    def tensors(self) -> list[Tensor]:
        """The tensors `to_lists` reads, in the order it takes host copies of them."""
        return [self.sampled_logprobs, self.ranks, self.top_ids, self.top_logprobs]

    def to_lists(self, token_ids: Tensor, *host: Tensor) -> list[TokenLogprobs | None]:
        """Per row, from these tensors or from `host`: copies of `tensors()` already read back."""
        lps, ranks, top_ids, top_lps = (t.tolist() for t in (host or self.tensors()))
        ids = token_ids.tolist()
        rows: list[TokenLogprobs | None] = []
        for i, n in enumerate(self.num_logprobs):
            if n is None:
                rows.append(None)
                continue
            rows.append(TokenLogprobs(ids[i], lps[i], ranks[i], list(zip(top_ids[i][:n], top_lps[i][:n], strict=True))))
        return rows


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] int64, on the device of the logits
    logprobs: LogprobsTensors | None = None  # only when some row asked for logprobs


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] float32 count of each token id in each row's list."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab_size]
    # Pad with id V (an extra column, dropped below) so ragged lists scatter in one op.
    padded = to_device([r + [vocab_size] * (width - len(r)) for r in rows], torch.int64, device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _column(states: list[RowState], name: str, device: torch.device) -> Tensor:
    return to_device([float(getattr(s.params, name)) for s in states], torch.float32, device)


def apply_penalties(logits: Tensor, states: list[RowState]) -> Tensor:
    """Token constraints (logit_bias, allowed tokens, bad words, the grammar's bitmask: keel.serve.constraints),
    then repetition, frequency and presence penalties and the min_tokens mask, as float32.

    - repetition (HF/vLLM): on tokens seen in the prompt or the output, positive logits are
      divided by the penalty and negative ones multiplied (both make the token less likely);
    - frequency / presence (OpenAI): on output tokens only, logit -= freq * count + presence * (count > 0);
    - min_tokens: while fewer than min_tokens tokens were generated, EOS (unless ignore_eos) and
      stop_token_ids get -inf, so the request cannot end early.
    `logits` is left as it is (its raw values feed the logprobs): where no row has a penalty or a
    min_tokens still to reach, the result is `logits` itself as float32 (no copy of the vocabulary;
    callers do not write into it), else a new tensor.
    """
    use_rep = any(s.params.repetition_penalty != 1.0 for s in states)
    use_freq = any(s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0 for s in states)
    constrained = has_constraints(states)
    if not (use_rep or use_freq or constrained or any(len(s.output_ids) < s.params.min_tokens for s in states)):
        return logits.float()
    x = logits.to(torch.float32, copy=True)
    if constrained:
        x = apply_constraints(x, states)
    vocab = x.shape[-1]
    device = x.device
    if use_rep or use_freq:
        out_counts = _token_counts([s.output_ids for s in states], vocab, device)
        if use_rep:
            seen = (_token_counts([s.prompt_ids for s in states], vocab, device) > 0) | (out_counts > 0)
            rep = _column(states, "repetition_penalty", device)[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if use_freq:
            freq = _column(states, "frequency_penalty", device)[:, None]
            presence = _column(states, "presence_penalty", device)[:, None]
            x = x - freq * out_counts - presence * (out_counts > 0).float()
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_ids) < s.params.min_tokens:
            banned = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(s.eos_token_ids))
            ids = [t for t in banned if 0 <= t < vocab]
            rows += [i] * len(ids)
            cols += ids
    if rows:
        x[to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)] = float("-inf")
    return x


def apply_filters(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
) -> Tensor:
    """Temperature, then top-k, top-p and min-p (the order of HF's warpers), on float32 logits [N, V].

    Per-row parameters are [N] tensors; top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 switch a
    filter off for that row. Filtered tokens get -inf; every filter keeps the most likely token.
    The `use_*` flags, known on the host, skip a filter no row uses without reading the tensors back.
    """
    vocab = logits.shape[-1]
    x = logits / temperature[:, None]
    if use_top_k or use_top_p:
        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k).long()
        # One stable sort serves both filters; the result is scattered back to vocabulary order.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        # top-k by threshold (the k-th largest value), so ties with the k-th token all stay, as in vLLM.
        kth = sorted_x.gather(1, (k - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        # top-p (nucleus) on the top-k renormalised distribution: drop a token once the mass of the
        # tokens before it reaches top_p, i.e. keep the smallest prefix whose mass reaches top_p.
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]  # top_p = 1: float error must drop nothing
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if use_min_p:
        probs = x.softmax(dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x


class Sampler:
    """logits [N, V] + one RowState per row -> one token per row (and logprobs when asked)."""

    def process_logits(self, logits: Tensor, states: list[RowState]) -> tuple[Tensor, Tensor]:
        """(the float32 logits the draw uses, greedy mask [N]).

        Greedy rows (temperature 0) keep their penalised logits, unscaled and unfiltered: argmax
        of those is the answer. Other rows are temperature-scaled and filtered.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} row states")
        device = logits.device
        x = apply_penalties(logits, states)
        greedy_list = [s.params.greedy for s in states]
        if all(greedy_list):
            return x, torch.ones(len(states), dtype=torch.bool, device=device)
        # All per-row parameters in one host->device copy.
        table = to_device(
            [
                [
                    1.0 if s.params.greedy else s.params.temperature,
                    float(s.params.top_k),
                    s.params.top_p,
                    s.params.min_p,
                    float(s.params.greedy),
                ]
                for s in states
            ],
            torch.float32,
            device,
        )
        temperature, top_k, top_p, min_p, greedy = table.unbind(dim=1)
        greedy = greedy.bool()
        sampled = [s.params for s in states if not s.params.greedy]
        vocab = x.shape[-1]
        # Greedy rows: switch the filters off (argmax is invariant to them anyway).
        filtered = apply_filters(
            x,
            temperature,
            torch.where(greedy, torch.zeros_like(top_k), top_k),
            torch.where(greedy, torch.ones_like(top_p), top_p),
            torch.where(greedy, torch.zeros_like(min_p), min_p),
            use_top_k=any(0 < p.top_k < vocab for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
        )
        return torch.where(greedy[:, None], x, filtered), greedy

    def __call__(self, logits: Tensor, states: list[RowState]) -> SamplerOutput:
        if logits.device.type == "cpu" and logits.dim() == 2 and kernels.active():
            token_ids = _sample_on_kernels(apply_penalties(logits, states), states)
        else:
            token_ids = self._sample_on_torch(logits, states)
        output = SamplerOutput(token_ids=token_ids)
        num_logprobs = [s.params.logprobs for s in states]
        if any(n is not None for n in num_logprobs):
            output.logprobs = _logprobs(logits, token_ids, num_logprobs)
        return output

    def _sample_on_torch(self, logits: Tensor, states: list[RowState]) -> Tensor:
        x, greedy = self.process_logits(logits, states)
        token_ids = x.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            probs = x.softmax(dim=-1)
            # Exponential race: argmax(p / q), q ~ Exp(1), samples from p without a cumsum/search.
            q = torch.empty_like(probs)
            seeded = [i for i in random_rows if states[i].generator is not None]
            if len(seeded) < len(states):
                q.exponential_()  # unseeded rows share the global generator
            for i in seeded:
                # Each seeded row draws V values from its own generator at every step, whatever the batch.
                q[i].exponential_(generator=states[i].generator)
            # q can be 0 in float32 (then p / q would be inf or nan); a tiny floor keeps p = 0 at 0.
            sampled = (probs / q.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
            token_ids = torch.where(greedy, token_ids, sampled)
        return token_ids


def _sample_on_kernels(x: Tensor, states: list[RowState]) -> Tensor:
    """One token per row of (penalised) logits through keel::sample_rows: greedy rows as temperature 0,
    one uniform number per sampled row (a seeded row's from its own generator)."""
    if x.shape[0] != len(states):
        raise ValueError(f"logits {tuple(x.shape)} do not match {len(states)} row states")
    params = [s.params for s in states]
    if all(p.greedy for p in params):
        return torch.ops.keel.sample_rows(x.float(), *_greedy_arguments(len(params)))
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    uniform = torch.zeros(len(states), dtype=torch.float64)
    unseeded = [i for i, s in enumerate(states) if not s.params.greedy and s.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, s in enumerate(states):
        if not s.params.greedy and s.generator is not None:
            uniform[i] = torch.rand((), dtype=torch.float64, generator=s.generator)
    return torch.ops.keel.sample_rows(x.float(), temperature, top_k, top_p, min_p, uniform)


@functools.lru_cache(maxsize=64)
def _greedy_arguments(rows: int) -> tuple[Tensor, ...]:
    """keel::sample_rows' parameters for `rows` greedy rows (read, never written: kept per batch size,
    as building five small tensors a step costs more than the draw)."""
    return (
        torch.zeros(rows),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows),
        torch.zeros(rows),
        torch.zeros(rows, dtype=torch.float64),
    )


def _logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: list[int | None]) -> LogprobsTensors:
    """Raw logprobs (log_softmax of the model's logits) of `token_ids`, with ranks and the top-K."""
    logprobs = logits.float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    # Rank as vLLM counts it: 1 + the number of tokens strictly more likely.
    ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
    k = min(max((n or 0) for n in num_logprobs), logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1, sorted=True)
    return LogprobsTensors(num_logprobs, sampled, ranks, top_ids, top_logprobs)


def prompt_logprobs(logits: Tensor, prompt_ids: list[int], n: int) -> list[TokenLogprobs | None]:
    """Logprob of each prompt token given its prefix, with its rank and the top-n (raw logprobs).

    `logits[t]` are the model's logits at position t (they predict token t + 1), so at least
    len(prompt_ids) - 1 rows are needed; a last row predicting the first generated token is ignored.
    The first token has no prefix: its entry is None (as in vLLM).
    """
    if not prompt_ids:
        return []
    if logits.dim() != 2 or logits.shape[0] < len(prompt_ids) - 1:
        raise ValueError(f"logits {tuple(logits.shape)} do not cover a prompt of {len(prompt_ids)} tokens")
    result: list[TokenLogprobs | None] = [None]
    if len(prompt_ids) == 1:
        return result
    targets = torch.tensor(prompt_ids[1:], dtype=torch.int64, device=logits.device)
    out = _logprobs(logits[: len(prompt_ids) - 1], targets, [n] * (len(prompt_ids) - 1))
    return result + out.to_lists(targets)


def sample_dummy_rows(logits: Tensor) -> None:
    """Sample every row of `logits` as a step's widest sampling does (top-k and top-p: the sort): the sampler's
    share of the dummy step that measures a step's activation peak (keel.serve.kv_budget)."""
    Sampler()(logits, [RowState(SamplingParams(temperature=1.0, top_k=50, top_p=0.9))] * logits.shape[0])
