"""Workloads for llama.cpp runs: prompts from the command line or a file.

A prompt file is either plain text, one prompt per line (blank lines are skipped), or JSONL,
recognised by its first non-blank line starting with ``{``: every non-blank line is then a JSON
object with a ``prompt`` string or a chat ``messages`` list of ``{"role", "content"}``
objects. A line that breaks these rules is an error naming the file and the line, never
skipped. Files are read like every other input (``moepack.inputs``): regular files only, at
most ``MAX_PROMPT_FILE`` bytes, each JSON line bounded in depth and in its integers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import BadInput
from ...inputs import load_json, read_capped

# A prompt file is text a person wrote or a script exported: 64 MiB is thousands of long
# prompts, and the cap keeps /dev/zero (or a wrong file) from filling memory.
MAX_PROMPT_FILE = 64 << 20


@dataclass(frozen=True)
class Prompt:
    """Plain text, or chat messages to render with the model's template."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    def to_job(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages]}
        return {"prompt": self.text}


def text_prompt(text: str, where: str = "`prompt`") -> Prompt:
    if not text.strip():
        raise BadInput(f"{where}: the prompt is empty")
    return Prompt(text=text)


def _messages(value: Any, path: Path, line: int) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise BadInput(f"line {line}: 'messages' must be a non-empty list", path)
    out = []
    for m in value:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise BadInput(
                f"line {line}: every message needs a 'role' and a 'content' string", path
            )
        out.append((m["role"], m["content"]))
    if not any(c.strip() for _, c in out):
        raise BadInput(f"line {line}: every message is empty", path)
    return tuple(out)


def read_prompt_file(path: str | os.PathLike[str]) -> list[Prompt]:
    """The prompts of ``path`` (see the module docstring for the two forms)."""
    p = Path(path)
    raw = read_capped(p, "prompt file", MAX_PROMPT_FILE)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 text (byte {e.start:,})", p) from None
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if not lines:
        raise BadInput("the prompt file holds no prompts", p)
    if not lines[0][1].lstrip().startswith("{"):
        return [Prompt(text=ln) for _, ln in lines]
    out: list[Prompt] = []
    for number, ln in lines:
        obj = load_json(ln, p, f"line {number}")
        if not isinstance(obj, dict):
            raise BadInput(f"line {number}: not a JSON object", p)
        if "messages" in obj:
            out.append(Prompt(messages=_messages(obj["messages"], p, number)))
        elif isinstance(obj.get("prompt"), str):
            if not obj["prompt"].strip():
                raise BadInput(f"line {number}: the prompt is empty", p)
            out.append(Prompt(text=obj["prompt"]))
        else:
            raise BadInput(f"line {number}: needs a 'prompt' string or a 'messages' list", p)
    return out


def workload(
    prompts: Sequence[str], prompt_file: str | os.PathLike[str] | None = None
) -> list[Prompt]:
    """The prompts of a command line, in order: each ``prompt``, then the file's."""
    out = [text_prompt(p) for p in prompts]
    if prompt_file is not None:
        out += read_prompt_file(prompt_file)
    if not out:
        raise BadInput("give a workload: `prompt` TEXT or `prompt_file` FILE")
    return out


def read_text_file(path: str | os.PathLike[str]) -> str:
    """The whole of a UTF-8 text file (the text ``check-dropin`` runs)."""
    p = Path(path)
    try:
        return read_capped(p, "text file", MAX_PROMPT_FILE).decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 text (byte {e.start:,})", p) from None
