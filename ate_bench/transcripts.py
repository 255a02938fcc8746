"""Transcript parsers: what an agent CLI printed -> turns, tokens, context per turn, final answer.

Formats (the `--format` flag):
  claude-stream-json  `claude -p --output-format stream-json --verbose`: one JSON event a line.
                      `assistant` events carry `message.id` and `message.usage` (input_tokens,
                      cache_creation_input_tokens, cache_read_input_tokens, output_tokens); one API
                      call may be split over several events with the same id, so a turn is a
                      distinct message id. The final `result` event has `result` (the answer),
                      `usage`, `num_turns`, `duration_ms`, `is_error`.
  claude-json         `claude -p --output-format json`: the `result` object alone (or, with
                      --verbose, a JSON array of the stream events above).
  codex-json          `codex exec --json`: JSONL events `thread.started`, `turn.started`,
                      `item.started|updated|completed` (item.type agent_message with `text`,
                      reasoning, command_execution, file_change, mcp_tool_call, ...),
                      `turn.completed` with usage {input_tokens, cached_input_tokens,
                      output_tokens}, `turn.failed`, `error`. Codex reports usage per turn only
                      (one turn per `exec`), so a turn here is one completed non-reasoning item
                      (a tool call or a message) and the context per turn is the usage's input
                      tokens of each codex turn.
  generic-jsonl       for any other agent (or a wrapper): lines {"type": "turn", "context_tokens":
                      N, "output_tokens": M} and one {"type": "answer", "text": "..."}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

FORMATS = ("claude-stream-json", "claude-json", "codex-json", "generic-jsonl")


@dataclass
class Transcript:
    turns: int = 0
    output_tokens: int = 0
    context_tokens: list[int] = field(default_factory=list)  # the prompt size of each model call
    answer: str = ""
    is_error: bool = False
    reported_seconds: float | None = None  # the agent's own session time, where it reports one


def _events(text: str) -> list[dict]:
    """JSON objects of a JSONL stream (a whole-array document too); non-JSON lines (progress
    output some CLIs mix in) are skipped."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            return [e for e in json.loads(stripped) if isinstance(e, dict)]
        except json.JSONDecodeError:
            pass
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _claude(events: list[dict]) -> Transcript:
    t = Transcript()
    usage_by_id: dict[str, dict] = {}
    last_text = ""
    for e in events:
        if e.get("type") == "assistant":
            msg = e.get("message") or {}
            key = msg.get("id") or f"anon{len(usage_by_id)}"
            usage = msg.get("usage") or {}
            seen = usage_by_id.setdefault(key, {})
            for k, v in usage.items():  # split events of one call repeat the usage: keep the largest
                if isinstance(v, (int, float)):
                    seen[k] = max(seen.get(k, 0), v)
            text = "".join(b.get("text", "") for b in msg.get("content") or [] if isinstance(b, dict) and b.get("type") == "text")
            last_text = text or last_text
        elif e.get("type") == "result":
            t.answer = e.get("result") or ""
            t.is_error = bool(e.get("is_error")) or e.get("subtype", "success") != "success"
            if e.get("duration_ms") is not None:
                t.reported_seconds = e["duration_ms"] / 1000
            if isinstance((e.get("usage") or {}).get("output_tokens"), int):
                t.output_tokens = e["usage"]["output_tokens"]
            if not usage_by_id and e.get("num_turns"):  # json format: no per-call events
                t.turns = int(e["num_turns"])
    if usage_by_id:
        t.turns = len(usage_by_id)
        t.context_tokens = [u.get("input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
                            + u.get("cache_read_input_tokens", 0) for u in usage_by_id.values()]
        t.output_tokens = t.output_tokens or sum(u.get("output_tokens", 0) for u in usage_by_id.values())
    t.answer = t.answer or last_text
    return t


def _codex(events: list[dict]) -> Transcript:
    t = Transcript()
    for e in events:
        kind = e.get("type")
        if kind == "item.completed":
            item = e.get("item") or {}
            if item.get("type") != "reasoning":
                t.turns += 1
            if item.get("type") == "agent_message":
                t.answer = item.get("text") or t.answer
        elif kind == "turn.completed":
            usage = e.get("usage") or {}
            t.context_tokens.append(int(usage.get("input_tokens", 0)))  # cached_input_tokens is part of it
            t.output_tokens += int(usage.get("output_tokens", 0))
        elif kind in ("turn.failed", "error"):
            t.is_error = True
    return t


def _generic(events: list[dict]) -> Transcript:
    t = Transcript()
    for e in events:
        if e.get("type") == "turn":
            t.turns += 1
            t.context_tokens.append(int(e.get("context_tokens", 0)))
            t.output_tokens += int(e.get("output_tokens", 0))
        elif e.get("type") == "answer":
            t.answer = e.get("text", "")
        elif e.get("type") == "error":
            t.is_error = True
    return t


def parse(fmt: str, text: str) -> Transcript:
    events = _events(text)
    if fmt in ("claude-stream-json", "claude-json"):
        t = _claude(events)
    elif fmt == "codex-json":
        t = _codex(events)
    elif fmt == "generic-jsonl":
        t = _generic(events)
    else:
        raise ValueError(f"unknown transcript format {fmt!r}; use one of {', '.join(FORMATS)}")
    # a lone surrogate ("\ud83d", half an emoji cut off) could not be written to answer.txt: the run ended there
    t.answer = t.answer.encode("utf-8", "replace").decode()
    return t
