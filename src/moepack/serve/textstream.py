"""Streamed text equal to the text of the same request not streamed, on every vocabulary.

llama-cpp-python 0.3.36 streams a completion by decoding each token's bytes as it comes, in
``Llama._create_completion`` (``llama_cpp/llama.py``; docs/serve.md names the lines): a run
of tokens that does not decode strictly as UTF-8 on its own is held back and re-decoded at
every later token, and once the generation ends what is left is decoded one token at a time
with ``errors="ignore"``, so a character whose bytes lie in two tokens of that tail is
dropped — where the plain request decodes the joined bytes and keeps it. (Held runs are also
re-decoded from their start at every token, which slows a long one to a crawl.)

moepack streams differently: the request runs as a plain one (its text is exactly the plain
text, by construction) in a thread of its own, and the tokens it generates are handed over
as they come (``Completions.generate`` on the ``Llama`` instance). ``StreamText`` turns them
into chunks with an incremental UTF-8 decoder over the tokens' bytes (``errors="ignore"``, as
the plain text is decoded), holding back only what could still become a stop sequence; the
last chunk is what the plain text has beyond what was streamed. A client's chunks therefore
join to the plain text, byte for byte; a chunk only ever holds whole characters.

A streamed request asking for ``logprobs`` is left to llama-cpp-python's own streaming (its
chunks carry per-token logprobs that this does not make).
"""

from __future__ import annotations

import codecs
import contextvars
import queue
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any


class StreamText:
    """Released text of a generation's bytes, a token's piece at a time (see the module
    docstring). ``stops``: the request's stop sequences (bytes); ``strip_space``: the
    completion starts with the BOS token, whose following space llama-cpp-python drops."""

    def __init__(self, stops: Sequence[bytes], strip_space: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.strip_space = strip_space
        self.raw = bytearray()
        self.released = 0  # bytes of ``text`` handed to the decoder
        self.emitted = ""  # the text streamed so far
        self.stopped = False  # a stop sequence is in the text: nothing more until the end
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    @property
    def text(self) -> bytes:
        """The generation's bytes as llama-cpp-python detokenises them."""
        if self.strip_space and self.raw[:1] == b" ":
            return bytes(self.raw[1:])
        return bytes(self.raw)

    def feed(self, piece: bytes) -> str:
        """The text that can be streamed once ``piece`` (one token's bytes) is generated."""
        self.raw += piece
        if self.stopped:
            return ""
        text = self.text
        if any(s in text for s in self.stops):
            # the generation ends at this token (or a few later): where, the plain text says
            self.stopped = True
            return ""
        end = len(text) - self._held(text)
        return self._release(text, end)

    def finish(self, final: str) -> str:
        """The rest of the plain request's text ``final`` beyond what was streamed."""
        if final.startswith(self.emitted):
            rest = final[len(self.emitted) :]
        else:  # not reached while the stop rule holds: say what the decoder has left
            rest = self._decoder.decode(b"", final=True)
        self.emitted += rest
        return rest

    def _held(self, text: bytes) -> int:
        """Bytes at the end of ``text`` that begin a stop sequence (they may be cut off)."""
        held = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _release(self, text: bytes, end: int) -> str:
        if end <= self.released:
            return ""
        out = self._decoder.decode(text[self.released : end])
        self.released = end
        self.emitted += out
        return out


class _Listener:
    """A streamed request's side of its generation: tokens as they come, and a stop."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()


class Completions:
    """``create_completion`` and ``generate`` of one ``Llama`` instance, wrapped.

    ``admit`` runs before every completion (a refusal is raised from it: the server is
    stopping, the prompt is over the cap); ``cut``: whether a running generation should end
    at its next token (the server is stopping); ``failed``: what a completion's exception is
    raised as. Every completion, plain or streamed, runs
    one at a time (``_busy``): a stream its client left runs on in its thread until its
    generator is closed, and the next request waits for that."""

    def __init__(
        self,
        llm: Any,
        *,
        admit: Callable[[Any], None],
        cut: Callable[[], bool],
        on_cut: Callable[[], None] | None = None,
        failed: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self.llm = llm
        self.admit = admit
        self.cut = cut
        self.on_cut = on_cut
        self.failed = failed or (lambda e: e)
        self._create = llm.create_completion
        self._generate = llm.generate
        self._local = threading.local()
        self._busy = threading.Lock()
        self._eog = _eog_check(llm)
        self._piece = _piece_of(llm)

    def install(self) -> None:
        self.llm.create_completion = self.create_completion
        self.llm.generate = self.generate

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        prompt = kwargs.get("prompt", args[0] if args else "")
        self.admit(prompt)
        if args or not kwargs.get("stream") or kwargs.get("logprobs") is not None:
            with self._busy:
                try:
                    return self._create(*args, **kwargs)
                except Exception as e:
                    raised = self.failed(e)
                    if raised is e:
                        raise
                    raise raised from None
        return self._streamed(kwargs)

    def generate(
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate``: each token handed to a streamed request's listener, and the
        generation ended at the next token when ``cut`` says so."""
        listener: _Listener | None = getattr(self._local, "listener", None)
        if listener is not None:
            listener.events.put(("prompt", list(tokens)))
        inner = self._generate(tokens, *args, **kwargs)
        try:
            sent: Sequence[int] | None = None
            while True:
                try:
                    token = inner.send(sent) if sent is not None else next(inner)
                except StopIteration:
                    return
                if listener is not None and listener.stop.is_set():
                    return
                if self.cut():
                    if self.on_cut is not None:
                        self.on_cut()
                    return
                if listener is not None:
                    listener.events.put(("token", int(token)))
                sent = yield token
        finally:
            inner.close()

    def _streamed(self, kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Chunks of text-completion stream responses, in the shape llama-cpp-python's are."""
        listener = _Listener()
        plain = {**kwargs, "stream": False}

        def run() -> None:
            self._local.listener = listener
            try:
                with self._busy:
                    listener.events.put(("done", self._create(**plain)))
            except BaseException as e:  # raised to the client's side
                listener.events.put(("error", self.failed(e)))
            finally:
                self._local.listener = None

        ident = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        model = kwargs.get("model") or self.llm.model_path

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        stop = kwargs.get("stop") or []
        stops = [s.encode("utf-8") for s in ([stop] if isinstance(stop, str) else stop)]
        prompt = kwargs.get("prompt", "")
        echoed = prompt if kwargs.get("echo") and isinstance(prompt, str) else ""
        pending = echoed  # the plain text starts with the prompt: streamed with the first text
        text = StreamText(stops, strip_space=len(prompt) == 0)
        if len(prompt) == 0:  # llama-cpp-python's completion then starts with the BOS token
            text.raw += self._piece(int(self.llm.token_bos())) or b""
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(run,), name="moepack-stream", daemon=True
        )
        worker.start()
        try:
            while True:
                kind, value = listener.events.get()
                if kind == "token":
                    if self._eog(value):
                        continue
                    piece = self._piece(value)
                    if piece is None:  # past here only the plain text knows the bytes
                        text.stopped = True
                        continue
                    out = text.feed(piece)
                    if out:
                        out, pending = pending + out, ""
                        yield chunk(out)
                elif kind == "done":
                    choice = value["choices"][0]
                    rest = text.finish(str(choice["text"])[len(echoed) :])
                    if pending + rest:
                        yield chunk(pending + rest)
                    yield chunk("", choice["finish_reason"])
                    return
                elif kind == "error":
                    raise value
        finally:
            listener.stop.set()
            worker.join()


def _eog_check(llm: Any) -> Callable[[int], bool]:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token))


def _piece_of(llm: Any) -> Callable[[int], bytes | None]:
    """A token's bytes exactly as llama-cpp-python's detokenising joins them (its 32-byte
    buffer, no specials); None for a piece longer than that buffer, which llama-cpp-python
    joins as whatever the buffer held."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def piece(token: int) -> bytes | None:
        buf = (ctypes.c_char * 32)()
        n = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(token), buf, 32, 0, False)
        if n < 0:
            return None
        return ctypes.string_at(buf, n)

    return piece
