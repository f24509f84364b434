"""Prompt files as every command reads them, and chat turns checked before a chat template sees them.

A prompt file is JSONL (gzipped when its name ends in .gz): one JSON object a line, UTF-8 (a byte-order mark on
the first line is allowed). A row is {"prompt": str} or {"messages": [{"role": str, "content": ...}, ...]}, the
content a string or OpenAI text parts. `draftsmith bench`, `report --prompts`, `verify-export --prompts` and
distill's own data (pipeline/data.py) all read through here, so a file is refused the same way everywhere: one
line naming `path:line` and the fix.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path


class PromptFileError(ValueError):
    """A prompt file or one of its rows is unusable; the message names where and the fix."""


def jsonl_objects(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for each non-blank line of `path`; PromptFileError at the first line that is
    not UTF-8 or not JSON, or a gzip file that is cut short."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise PromptFileError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                          f"{e.start + 1}); re-save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptFileError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one JSON "
                                          f"object") from None
                yield n, obj
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise PromptFileError(f"{path}: not a complete gzip file ({e}); compress it again, or give the .jsonl "
                              f"itself") from None


def text_of(content, what: str) -> str:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text"}] joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise PromptFileError(f"{what} has no text content (a string or [{{'type': 'text', 'text'}}] parts)")


def chat_turns(messages) -> list[dict]:
    """Chat turns as {"role", "content": str} (keys a Parquet struct column fills with None dropped);
    PromptFileError naming the first turn a chat template could not render."""
    if not isinstance(messages, list) or not messages:
        raise PromptFileError("'messages' must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise PromptFileError(f"messages[{i}] must be a {{'role', 'content'}} object")
        turn = {k: v for k, v in m.items() if v is not None}
        turn["content"] = text_of(m["content"], f"messages[{i}] ({m['role']})")
        out.append(turn)
    return out


def read_prompt_rows(path: str | Path) -> list[dict]:
    """The rows of a prompts file, each with a "prompt" string or checked "messages" (their content made text);
    other keys (an id, a category) are kept."""
    rows = []
    for n, obj in jsonl_objects(path):
        if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)):
            raise PromptFileError(f"{path}:{n}: each line needs a 'prompt' string or a 'messages' list")
        if not isinstance(obj.get("prompt"), str):
            try:
                obj = obj | {"messages": chat_turns(obj["messages"])}
            except PromptFileError as e:
                raise PromptFileError(f"{path}:{n}: {e}") from None
        rows.append(obj)
    return rows


def render_chat(tokenizer, messages: list[dict], **kw):
    """tokenizer.apply_chat_template(messages, **kw); a template that refuses them (it raised, e.g. roles that do
    not alternate) is a PromptFileError naming its reason."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except TemplateError as e:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise PromptFileError(f"the target's chat template refuses messages with roles [{roles}] ({e}); give "
                              f"turns it accepts, e.g. one user turn") from None
