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
import math
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
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            pass
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                continue
    return events


# The transcript is the agent's stdout: a field of another type (null, a string, a list, NaN) is taken as absent,
# where it used to end the whole run with a TypeError/ValueError.
def _num(v) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0


def _text(v) -> str:
    return v if isinstance(v, str) else ""


def _obj(v) -> dict:
    return v if isinstance(v, dict) else {}


def _claude(events: list[dict]) -> Transcript:
    t = Transcript()
    usage_by_id: dict[str, dict] = {}
    last_text = ""
    for e in events:
        if e.get("type") == "assistant":
            msg = _obj(e.get("message"))
            key = msg.get("id") if isinstance(msg.get("id"), str) and msg.get("id") else f"anon{len(usage_by_id)}"
            seen = usage_by_id.setdefault(key, {})
            for k, v in _obj(msg.get("usage")).items():  # split events of one call repeat the usage: keep the largest
                seen[k] = max(seen.get(k, 0), _num(v))
            content = msg.get("content") if isinstance(msg.get("content"), list) else []
            text = "".join(_text(b.get("text")) for b in content if isinstance(b, dict) and b.get("type") == "text")
            last_text = text or last_text
        elif e.get("type") == "result":
            t.answer = _text(e.get("result"))
            t.is_error = bool(e.get("is_error")) or e.get("subtype", "success") != "success"
            if _num(e.get("duration_ms")) or e.get("duration_ms") == 0:
                t.reported_seconds = _num(e["duration_ms"]) / 1000
            if _num(_obj(e.get("usage")).get("output_tokens")):
                t.output_tokens = _num(e["usage"]["output_tokens"])
            if not usage_by_id and _num(e.get("num_turns")):  # json format: no per-call events
                t.turns = _num(e["num_turns"])
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
            item = _obj(e.get("item"))
            if item.get("type") != "reasoning":
                t.turns += 1
            if item.get("type") == "agent_message":
                t.answer = _text(item.get("text")) or t.answer
        elif kind == "turn.completed":
            usage = _obj(e.get("usage"))
            t.context_tokens.append(_num(usage.get("input_tokens")))  # cached_input_tokens is part of it
            t.output_tokens += _num(usage.get("output_tokens"))
        elif kind in ("turn.failed", "error"):
            t.is_error = True
    return t


def _generic(events: list[dict]) -> Transcript:
    t = Transcript()
    for e in events:
        if e.get("type") == "turn":
            t.turns += 1
            t.context_tokens.append(_num(e.get("context_tokens")))
            t.output_tokens += _num(e.get("output_tokens"))
        elif e.get("type") == "answer":
            t.answer = _text(e.get("text"))
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
