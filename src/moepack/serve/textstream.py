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

from .budget import TokenBudget, current_budget


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


class _Generation:
    """One completion's generation as the wrappers see it: the most tokens it may give
    (``max_tokens``; None: up to the context) and the request's budget, what it gave, and
    whether the wrapper ended it (the budget spent, or the server stopping)."""

    def __init__(self, limit: int | None, budget: TokenBudget | None) -> None:
        self.limit = limit
        self.budget = budget
        self.prompt: list[int] = []
        self.tokens: list[int] = []
        self.ended = False

    def spent(self, n_ctx: int) -> bool:
        """Whether no more tokens may be given (before the next is sampled)."""
        given = len(self.tokens)
        if self.limit is not None and given >= self.limit:
            return True
        if given >= n_ctx - len(self.prompt):
            return True
        return self.budget is not None and self.budget.left <= 0


class Completions:
    """``create_completion`` and ``generate`` of one ``Llama`` instance, wrapped.

    ``admit`` runs before every completion (a refusal is raised from it: the server is
    stopping, the prompt is over the cap); ``cut``: whether a running generation should end
    at its next token (the server is stopping); ``failed``: what a completion's exception is
    raised as. Every completion, plain or streamed, runs one at a time (``_busy``): a stream
    its client left runs on in its thread until its generator is closed, and the next
    request waits for that.

    A generation gives no more tokens than its ``max_tokens``, the context, and the request's
    token budget (``budget``) allow: llama-cpp-python 0.3.36 skips its own check while the
    text ends in what may be the first bytes of a character (``multibyte_fix``), so a token
    that begins one after another ran past ``max_tokens`` to the end of the context. The
    next token is not sampled once they are spent, nor once the server stops (after the
    first). A plain completion ended so is answered with its text (llama-cpp-python's loop
    then ends without it): the tokens given, cut at the first stop sequence found as it cuts,
    ``finish_reason`` "length" (or "stop")."""

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
        limit = _limit(kwargs.get("max_tokens"))
        if limit is not None and isinstance(prompt, str) and not prompt:
            limit -= 1  # llama-cpp-python counts the BOS token it starts such a completion with
        generation = _Generation(limit, current_budget())
        if args or not kwargs.get("stream") or kwargs.get("logprobs") is not None:
            with self._busy:
                self._local.generation = generation
                try:
                    result = self._create(*args, **kwargs)
                except Exception as e:
                    raised = self.failed(e)
                    if raised is e:
                        raise
                    raise raised from None
                finally:
                    self._local.generation = None
            if isinstance(result, dict):
                return self._mended(result, generation, kwargs)
            return self._bound(result, generation)  # llama-cpp-python's own stream
        return self._streamed(kwargs, generation)

    def generate(
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate``: each token handed to a streamed request's listener, and the
        generation ended before the next token once its tokens are spent or ``cut`` says so."""
        listener: _Listener | None = getattr(self._local, "listener", None)
        generation: _Generation | None = getattr(self._local, "generation", None)
        if generation is None:  # a generation of no completion of ours: bounded by nothing
            generation = _Generation(None, None)
        generation.prompt = list(tokens)
        n_ctx = int(self.llm.n_ctx())
        if listener is not None:
            listener.events.put(("prompt", list(tokens)))
        inner = self._generate(tokens, *args, **kwargs)
        try:
            sent: Sequence[int] | None = None
            while True:
                if generation.tokens and self.cut():
                    generation.ended = True
                    if self.on_cut is not None:
                        self.on_cut()
                    return
                if generation.spent(n_ctx):
                    generation.ended = True
                    return
                try:
                    token = inner.send(sent) if sent is not None else next(inner)
                except StopIteration:
                    return
                if listener is not None and listener.stop.is_set():
                    return
                generation.tokens.append(int(token))
                if generation.budget is not None:
                    generation.budget.left -= 1
                if listener is not None:
                    listener.events.put(("token", int(token)))
                sent = yield token
        finally:
            inner.close()

    def _mended(
        self, result: dict[str, Any], generation: _Generation, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """A plain result whose generation the wrapper ended, with the text it gave (see the
        class docstring); any other as it is."""
        if not generation.ended:
            return result
        text = bytes(self.llm.detokenize(generation.tokens, prev_tokens=generation.prompt))
        finish = "length"
        stop = kwargs.get("stop") or []
        for s in [stop] if isinstance(stop, str) else stop:
            at = text.find(s.encode("utf-8")) if s else -1
            if at >= 0:  # llama-cpp-python's rule: the first of the list found
                text, finish = text[:at], "stop"
                break
        prompt = kwargs.get("prompt")
        echoed = prompt if kwargs.get("echo") and isinstance(prompt, str) else ""
        choice = result["choices"][0]
        choice["text"] = echoed + text.decode("utf-8", errors="ignore")
        choice["finish_reason"] = finish
        return result

    def _bound(self, chunks: Iterator[Any], generation: _Generation) -> Iterator[Any]:
        """llama-cpp-python's own stream, its generation's bounds made current in whichever
        thread asks for the next chunk (its generator starts generating there)."""
        try:
            while True:
                self._local.generation = generation
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                finally:
                    self._local.generation = None
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _streamed(
        self, kwargs: dict[str, Any], generation: _Generation
    ) -> Iterator[dict[str, Any]]:
        """Chunks of text-completion stream responses, in the shape llama-cpp-python's are."""
        listener = _Listener()
        plain = {**kwargs, "stream": False}

        def run() -> None:
            self._local.listener = listener
            self._local.generation = generation
            try:
                with self._busy:
                    result = self._create(**plain)
                listener.events.put(("done", self._mended(result, generation, plain)))
            except BaseException as e:  # raised to the client's side
                listener.events.put(("error", self.failed(e)))
            finally:
                self._local.listener = None
                self._local.generation = None

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


def _limit(max_tokens: Any) -> int | None:
    """A completion's ``max_tokens`` as llama-cpp-python reads it (None or 0 or less: up to
    the end of the context)."""
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    return None
