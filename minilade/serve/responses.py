"""The bodies the server answers with, in the OpenAI shapes: a whole completion or chat completion, or the chunks of
its stream (Server-Sent Events: `data: {json}` lines, then `data: [DONE]`).

A stream's first chat chunk carries the role; the last content chunk carries finish_reason (and minilade's step
statistics); a final chunk with no choices carries usage when the request asked for it
(stream_options.include_usage). Every whole answer carries usage and the step statistics under "minilade".
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..text_stream import Generation

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def usage(generation: Generation) -> dict:
    """Tokens in and out; cached: the prompt's tokens read from rows kept from an earlier request."""
    prompt, new = len(generation.prompt_ids), len(generation.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new,
            "prompt_tokens_details": {"cached_tokens": generation.stats.kept_tokens}}


def step_statistics(generation: Generation) -> dict:
    """minilade's account of the generation: forward passes it took part in, tokens per pass, rows it fed."""
    s = generation.stats
    return {"strategy": s.strategy, "forward_passes": s.forward_passes, "tokens_per_pass": round(s.compression, 4),
            "rows_fed": s.tokens_fed + s.prompt_tokens, "steps": s.steps,
            "step_kinds": {str(k): v for k, v in s.step_kinds.most_common()},
            "prefill_s": round(s.prefill_s, 6), "decode_s": round(s.decode_s, 6)}


def sse(payload: dict | str) -> bytes:
    """One Server-Sent Event: a JSON object, or the literal [DONE]."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


@dataclass
class Answer:
    """The answer to one request: its id, creation time and model, whole or as chunks."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, generation: Generation) -> dict:
        finish = FINISH_REASONS[generation.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": generation.text},
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": generation.text, "finish_reason": finish, "logprobs": None}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(generation), "minilade": step_statistics(generation)}

    def chunk(self, text: str | None, generation: Generation | None = None, first: bool = False) -> dict:
        """A content chunk (text None: none); the last one passes the finished generation, which gives its
        finish_reason and step statistics. A chat stream's first chunk carries the role."""
        finish = FINISH_REASONS[generation.finish_reason] if generation is not None else None
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | \
                ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if generation is not None:
            body["minilade"] = step_statistics(generation)
        return body

    def usage_chunk(self, generation: Generation) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(generation)}
