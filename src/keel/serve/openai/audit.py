"""The audit log: one JSON line per generation request, on the `keel.audit` logger."""

from __future__ import annotations

import json
import logging
import time

from keel.serve.openai.call import Call

audit_log = logging.getLogger("keel.audit")


class AuditLog:
    def __init__(self, include_prompts: bool) -> None:
        self.include_prompts = include_prompts  # the prompt token ids too (--audit-prompts)

    def write(
        self,
        tenant: str,
        kind: str,
        status: int,
        started: float,
        *,
        call: Call | None = None,
        error: str | None = None,
        stream: bool = False,
    ) -> None:
        record: dict = {
            "tenant": tenant,
            "endpoint": kind,
            "status": status,
            "latency_s": round(time.monotonic() - started, 4),
        }
        if call is not None:
            record.update(self._call_record(call, stream))
        if error is not None:
            record["error"] = error
        audit_log.info(json.dumps(record))

    def _call_record(self, call: Call, stream: bool) -> dict:
        usage = call.usage()
        record: dict = dict(
            request_id=call.request_id,
            stream=stream,
            n=len(call.jobs),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            finish_reasons=call.finish_reasons(),
        )
        finals = [job.final.metrics for job in call.jobs if job.final is not None and job.final.metrics]
        drafted = sum(m.spec_draft_tokens for m in finals)
        if drafted:  # speculative decoding: this request's acceptance
            accepted = sum(m.spec_accepted_tokens for m in finals)
            record.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted)
        if self.include_prompts:
            record["prompt_token_ids"] = call.prompts
        return record
