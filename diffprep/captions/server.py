"""Captions from an OpenAI-compatible server (vLLM, SGLang, a hosted API) by URL: the chat completions endpoint.

The LTX trainer's ``caption_videos.py`` captions through a local vLLM server;
this is that way, for those who serve a model bigger than a worker can hold.
One request per sample, ``batch_size`` of them in flight at once (the server
batches them):

    POST {server_url}/chat/completions
    {"model": settings.model, "temperature": 0, "max_tokens": settings.max_new_tokens, "seed": settings.seed,
     "messages": [{"role": "user", "content": [<one image_url part per frame>, {"type": "text", "text": ...}]}]}

Each frame travels as a ``data:image/jpeg;base64,...`` URL (JPEG at quality
:data:`JPEG_QUALITY`: the same bytes for the same frame with the same Pillow);
a clip's text says how many frames and at what rate before the instruction.
A server must accept that many images in one prompt: vLLM takes one unless
started with ``--limit-mm-per-prompt '{"image": 256}'`` (the captions' ``max_frames``),
and answers 400 otherwise (its message is passed on).

The API key comes from the ``OPENAI_API_KEY`` environment variable (vLLM's
``--api-key``), sent as a bearer token and never written to a message or log.
Connection errors, timeouts, 429 and 5xx answers are retried with exponential
backoff as the project's other downloads are (``sources/mlperf.py``); what is
still failing after that, and every other answer that is not 200, is a
:class:`~diffprep.errors.DiffprepError` naming the URL and what to check.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from diffprep.errors import DiffprepError

# The settings and inputs are models.py's CaptionSettings and CaptionInput, taken as they are: models.py imports this
# module (load_captioner), so this one does not import it back.
CaptionSettings = Any
CaptionInput = Any

__all__ = ["API_KEY_ENV", "JPEG_QUALITY", "ServerCaptioner", "ServerError", "frame_data_url"]

log = logging.getLogger(__name__)

API_KEY_ENV = "OPENAI_API_KEY"
JPEG_QUALITY = 90
T = TypeVar("T")


class ServerError(DiffprepError):
    """The captioning server could not be reached, or did not answer as an OpenAI-compatible server does."""


class _Transient(Exception):
    """An answer worth asking again (429, 5xx)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def frame_data_url(frame: Any) -> str:
    """A PIL image as the ``data:`` URL of its JPEG bytes."""
    buffer = io.BytesIO()
    frame.convert("RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class ServerCaptioner:
    """Captions through an OpenAI-compatible ``/v1`` endpoint (``settings.server_url``)."""

    def __init__(self, settings: CaptionSettings, *, retries: int = 5, backoff_s: float = 1.0,
                 timeout_s: float = 600.0) -> None:
        if settings.server_url is None:
            raise ValueError("ServerCaptioner needs settings.server_url")
        self.settings = settings
        self.base = settings.server_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s

    def describe(self) -> dict[str, Any]:
        """The server, the model it serves under ``settings.model`` (``/v1/models``) and the settings.

        A server that does not serve that model is refused here, before any sample is sent.
        """
        listing = self._request("GET", "/models", None)
        served = [entry.get("id") for entry in listing.get("data", []) if isinstance(entry, dict)]
        if self.settings.model not in served:
            raise ServerError(f"the captioning server {self.base} does not serve a model named "
                              f"{self.settings.model!r}; it serves: {', '.join(map(str, served)) or 'nothing'}. "
                              "Pass one of those as the captions model (--caption-model).")
        return {"backend": "openai-server", "server_url": self.base, "model": self.settings.model,
                "served_models": served, "settings": self.settings.to_json()}

    def caption(self, batch: list[CaptionInput]) -> list[str]:
        if len(batch) <= 1:
            return [self._caption_one(item) for item in batch]
        with ThreadPoolExecutor(max_workers=min(len(batch), self.settings.batch_size)) as pool:
            return list(pool.map(self._caption_one, batch))

    def count_tokens(self, text: str) -> int:
        raise NotImplementedError("an OpenAI-compatible server has no tokenizer endpoint; count with the "
                                  "text encoder's tokenizer")

    def request_body(self, item: CaptionInput) -> dict[str, Any]:
        """The chat completions request for one sample (what is sent, byte for byte once serialized)."""
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": frame_data_url(frame)}}
                                       for frame in item.frames]
        text = self.settings.instruction
        if item.fps is not None:
            text = (f"These are {len(item.frames)} frames of a video, sampled at {item.fps:g} frames per "
                    f"second.\n{text}")
        parts.append({"type": "text", "text": text})
        return {"model": self.settings.model, "messages": [{"role": "user", "content": parts}],
                "temperature": 0, "max_tokens": self.settings.max_new_tokens, "seed": self.settings.seed}

    def _caption_one(self, item: CaptionInput) -> str:
        answer = self._request("POST", "/chat/completions", self.request_body(item))
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"the captioning server {self.base} answered {item.key!r} without "
                              f"choices[0].message.content (is it OpenAI-compatible?): {json.dumps(answer)[:300]}"
                              ) from None
        if not isinstance(content, str):
            raise ServerError(f"the captioning server {self.base} answered {item.key!r} with a content that is "
                              f"not text: {content!r:.300}")
        return content.strip()

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        url = self.base + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(API_KEY_ENV, "").strip()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode("utf-8")

        def attempt() -> dict[str, Any]:
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s)
                    raw = response.read()
            except urllib.error.HTTPError as error:
                text = error.read().decode("utf-8", "replace")
                if error.code == 429 or 500 <= error.code < 600:
                    raise _Transient(error.code, text) from None
                raise ServerError(self._refusal(method, url, error.code, text)) from None
            try:
                answer = json.loads(raw)
            except ValueError:
                raise ServerError(f"{method} {url} answered 200 with a body that is not JSON: {raw[:200]!r}; "
                                  "check that the URL is the server's /v1 endpoint") from None
            if not isinstance(answer, dict):
                raise ServerError(f"{method} {url} answered 200 with JSON that is not an object: {raw[:200]!r}")
            return answer

        return _with_retries(f"{method} {url}", attempt, retries=self.retries, backoff_s=self.backoff_s)

    def _refusal(self, method: str, url: str, status: int, text: str) -> str:
        if status in (401, 403):
            sent = f"the key in {API_KEY_ENV} was sent" if os.environ.get(API_KEY_ENV, "").strip() \
                else f"no key was sent ({API_KEY_ENV} is not set)"
            return (f"the captioning server refused {method} {url} (HTTP {status}): {sent}. Set {API_KEY_ENV} to "
                    "the server's API key (vLLM: its --api-key).")
        if status == 404:
            return (f"{method} {url} answered HTTP 404: the server has no such endpoint. The server URL must be its "
                    f"OpenAI-compatible /v1 endpoint (e.g. http://127.0.0.1:8000/v1). It said: {text[:300]}")
        return f"the captioning server answered {method} {url} with HTTP {status}: {text[:500]}"


def _with_retries(what: str, attempt: Callable[[], T], *, retries: int, backoff_s: float) -> T:
    """``attempt()``, retried ``retries`` times with exponential backoff (and jitter) on transient errors:
    no connection, a timeout, 429 and 5xx. The last failure becomes a :class:`ServerError`."""
    for n in range(retries + 1):
        try:
            return attempt()
        except (_Transient, urllib.error.URLError, TimeoutError, ConnectionError) as error:
            if n == retries:
                tries = f"{n + 1} attempt{'s' if n else ''}"
                if isinstance(error, _Transient):
                    raise ServerError(f"{what}: the captioning server still answered {error} after {tries}; check "
                                      "its log (overloaded, out of memory?) and run again") from None
                reason = getattr(error, "reason", error)
                raise ServerError(f"{what}: the captioning server cannot be reached after {tries} ({reason}). "
                                  "Check that it is running (vllm serve MODEL --port PORT) and that the URL, with "
                                  "its /v1, is right.") from None
            delay = min(backoff_s * 2**n, 60.0) * (1 + random.random() / 4)
            log.warning("%s: %s; retry %d of %d in %.1f s", what, error, n + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
