"""API keys, tenants and their limits.

Each API key (a Bearer token) maps to a tenant; a tenant has optional limits:
- `max_concurrent`: requests of the tenant in the engine at once;
- `max_queued`: requests of the tenant waiting for one of those slots (beyond it: 429);
- `tokens_per_minute`: a token bucket refilled continuously at tpm/60 per second. A request
  reserves prompt + max_tokens when admitted (so a burst cannot overshoot) and gets back what it
  did not generate when it ends.
Over a limit -> 429 with Retry-After (seconds until the limit would admit it).

Keys come from `--api-key KEY` (tenant "default", no limits) and `--api-keys-file F`, a TOML or
JSON file:

    [[keys]]
    key = "sk-team-a"
    tenant = "team-a"
    max_concurrent = 8
    max_queued = 16
    tokens_per_minute = 200000

Without any key the server is open and every request belongs to tenant "anonymous".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keel.errors import ConfigError
from keel.serve.openai.errors import APIError

ANONYMOUS = "anonymous"


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_concurrent: int | None = Field(default=None, ge=1)
    max_queued: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=1)


class KeyEntry(TenantLimits):
    key: str = Field(min_length=1)
    tenant: str = Field(min_length=1)


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[KeyEntry]


def load_keys_file(path: str | Path) -> list[KeyEntry]:
    """Parse and validate an API-keys file; ConfigError naming the file and field otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read API keys file ({e.strerror})") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    try:
        entries = KeysFile.model_validate(raw).keys
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise ConfigError(f"{path}: {where}: {err['msg']}") from None
    tenants: dict[str, TenantLimits] = {}
    for entry in entries:
        limits = TenantLimits(**entry.model_dump(exclude={"key", "tenant"}))
        if tenants.setdefault(entry.tenant, limits) != limits:
            raise ConfigError(f"{path}: tenant {entry.tenant!r} has keys with different limits")
    return entries


@dataclass
class TenantState:
    """One tenant's limits and live usage (touched only on the event loop)."""

    name: str
    limits: TenantLimits
    active: int = 0
    queued: int = 0
    tokens: float = 0.0  # the token bucket's level
    refilled_at: float = field(default_factory=time.monotonic)
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.tokens = float(self.limits.tokens_per_minute or 0)

    def _refill(self) -> None:
        tpm = self.limits.tokens_per_minute
        now = time.monotonic()
        if tpm:
            self.tokens = min(float(tpm), self.tokens + (now - self.refilled_at) * tpm / 60.0)
        self.refilled_at = now


class Admission:
    """A request's hold on its tenant's limits; `release()` once when it ends."""

    def __init__(self, tenant: TenantState, reserved: int) -> None:
        self.tenant = tenant
        self.reserved = reserved
        self._released = False

    def release(self, unused_tokens: int = 0) -> None:
        if self._released:
            return
        self._released = True
        tenant = self.tenant
        tenant.active -= 1
        if tenant.limits.tokens_per_minute:
            tenant._refill()
            refund = min(max(unused_tokens, 0), self.reserved)
            tenant.tokens = min(float(tenant.limits.tokens_per_minute), tenant.tokens + refund)
        tenant.slot_freed.set()

    def __del__(self) -> None:
        # Safety net: a streaming response whose body never started (the client left at once)
        # never runs its generator's `finally`; the slot must still come back.
        if not self._released:
            self.release()


class Tenants:
    """Authentication (key -> tenant) and admission against the tenant's limits."""

    def __init__(self, entries: list[KeyEntry]) -> None:
        self.auth_required = bool(entries)
        self._by_key: dict[str, str] = {}
        self.states: dict[str, TenantState] = {}
        for entry in entries:
            self._by_key[entry.key] = entry.tenant
            if entry.tenant not in self.states:
                limits = TenantLimits(**entry.model_dump(exclude={"key", "tenant"}))
                self.states[entry.tenant] = TenantState(entry.tenant, limits)
        if not entries:
            self.states[ANONYMOUS] = TenantState(ANONYMOUS, TenantLimits())

    @classmethod
    def from_options(cls, api_keys: list[str], keys_file: str | None) -> Tenants:
        entries = [KeyEntry(key=key, tenant="default") for key in api_keys]
        if keys_file:
            entries += load_keys_file(keys_file)
        return cls(entries)

    def authenticate(self, authorization: str | None) -> TenantState:
        if not self.auth_required:
            return self.states[ANONYMOUS]
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and token:
            token = token.strip()
            # Compare against every key in constant time: no timing oracle on the key's prefix.
            match = None
            for key, tenant in self._by_key.items():
                if hmac.compare_digest(key.encode(), token.encode()):
                    match = tenant
            if match is not None:
                return self.states[match]
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    @property
    def num_queued(self) -> int:
        return sum(state.queued for state in self.states.values())

    async def admit(self, tenant: TenantState, cost_tokens: int, deadline: float | None) -> Admission:
        """Reserve a slot and tokens for a request, waiting in the tenant's queue if allowed.

        Raises APIError 429 (with retry_after) over a limit, 504 when the deadline passes in the queue.
        """
        limits = tenant.limits
        if limits.tokens_per_minute:
            if cost_tokens > limits.tokens_per_minute:
                raise APIError(
                    429,
                    f"request needs {cost_tokens} tokens (prompt + max_tokens), over tenant {tenant.name!r}'s "
                    f"limit of {limits.tokens_per_minute} tokens per minute",
                    code="tokens_per_minute",
                    retry_after=60,
                )
            tenant._refill()
            if tenant.tokens < cost_tokens:
                wait = (cost_tokens - tenant.tokens) * 60.0 / limits.tokens_per_minute
                raise APIError(
                    429,
                    f"tenant {tenant.name!r} is over its limit of {limits.tokens_per_minute} tokens per minute",
                    code="tokens_per_minute",
                    retry_after=wait,
                )
        cap = limits.max_concurrent
        if cap is not None and tenant.active >= cap:
            if tenant.queued >= (limits.max_queued or 0):
                raise APIError(
                    429,
                    f"tenant {tenant.name!r} has {tenant.active} requests running (limit {cap}) and "
                    f"{tenant.queued} queued (limit {limits.max_queued or 0})",
                    code="concurrency",
                    retry_after=1,
                )
            tenant.queued += 1
            try:
                while tenant.active >= cap:
                    tenant.slot_freed.clear()
                    timeout = None if deadline is None else deadline - time.monotonic()
                    if timeout is not None and timeout <= 0:
                        raise APIError(504, "request deadline passed while queued for the tenant's slot")
                    try:
                        await asyncio.wait_for(tenant.slot_freed.wait(), timeout)
                    except TimeoutError:
                        raise APIError(504, "request deadline passed while queued for the tenant's slot") from None
            finally:
                tenant.queued -= 1
        tenant.active += 1
        if limits.tokens_per_minute:
            tenant._refill()
            tenant.tokens -= cost_tokens  # may dip below 0 after a queue wait; later requests then wait longer
        return Admission(tenant, cost_tokens)
