"""A small OpenAI-compatible HTTP client on the standard library (http.client), including streamed responses.

Standard library only, so smoke tests need nothing the engine's own environment might pin differently. Server
answers that are not 2xx become :class:`BackendError` with the server's own message.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from quantkit.errors import BackendError


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout), u.path or "/"


def status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET, or None when nothing answers (not listening yet, reset, timeout)."""
    try:
        conn, path = _conn(url, timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return None


def _raise_for(resp: http.client.HTTPResponse, body: bytes, method: str, url: str) -> None:
    if 200 <= resp.status < 300:
        return
    text = body.decode(errors="replace").strip()
    try:
        err = json.loads(text)
        text = json.dumps(err.get("error", err.get("detail", err)))
    except (json.JSONDecodeError, AttributeError):
        pass
    raise BackendError(f"{method} {url} answered HTTP {resp.status}: {text[:2000]}")


def _request(method: str, url: str, payload: dict[str, Any] | None, timeout: float) -> Any:
    """One JSON request; transport failures and HTTP errors become a BackendError naming the request."""
    conn, path = _conn(url, timeout)
    body_out = None if payload is None else json.dumps(payload)
    headers = {"Accept": "application/json"} if payload is None else {"Content-Type": "application/json"}
    try:
        conn.request(method, path, body=body_out, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise BackendError(f"{method} {url} failed: {e}") from None
    finally:
        conn.close()
    _raise_for(resp, body, method, url)
    return _loads(body, url)


def get_json(url: str, timeout: float = 60.0) -> Any:
    return _request("GET", url, None, timeout)


def post_json(url: str, payload: dict[str, Any], timeout: float = 300.0) -> Any:
    return _request("POST", url, payload, timeout)


def stream(url: str, payload: dict[str, Any], timeout: float = 300.0) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST with ``stream: true`` and yield (arrival time, event) for each server-sent ``data:`` event."""
    conn, path = _conn(url, timeout)
    try:
        conn.request("POST", path, body=json.dumps({**payload, "stream": True}),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if not 200 <= resp.status < 300:
            _raise_for(resp, resp.read(), "POST", url)
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield time.perf_counter(), _loads(data, url)
    except (OSError, http.client.HTTPException) as e:
        raise BackendError(f"POST {url} (streamed) failed: {e}") from None
    finally:
        conn.close()


def _loads(body: bytes, url: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise BackendError(f"{url} answered something that is not JSON: {body[:300]!r}") from None
