"""Browser sessions for runyard's web consoles (the market's /console and `runyard control ui`).

A session is a random id (the cookie's value) naming a record kept in this process: the secret the
caller signed in with, and the session's CSRF token. The cookie carries nothing else, is HttpOnly
(scripts cannot read it) and SameSite=Strict (a cross-site page cannot make the browser send it), and
the secret never appears in a URL. Every form carries the CSRF token in a hidden field, and a POST
whose token does not match its session's is refused, so a form on another site cannot act for the
signed-in user even where a browser ignores SameSite.

A visitor who has not signed in gets an anonymous session too (no secret, its own CSRF token), so the
sign-in form is protected the same way; signing in replaces it with a fresh id (no session fixation).
Sessions live in memory: a restart signs everyone out, which is the safe failure.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

COOKIE_NAME = "runyard_session"
IDLE_S = 8 * 3600  # signed out after this long without a request
MAX_SESSIONS = 10_000  # the oldest are dropped beyond this (anonymous visits cannot grow memory without bound)


@dataclass
class Session:
    id: str
    csrf: str
    secret: str | None = None  # what the caller signed in with (an API token); None until signed in
    notice: str | None = None  # what the last action did, shown once on the next page
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def signed_in(self) -> bool:
        return self.secret is not None


class SessionStore:
    """Sessions by id, in memory, thread-safe; idle ones expire."""

    def __init__(self, idle_s: float = IDLE_S, max_sessions: int = MAX_SESSIONS):
        self.idle_s, self.max_sessions = idle_s, max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def _new(self, secret: str | None) -> Session:
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), secret)
        with self._lock:
            self._sessions[session.id] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session with this id (its idle clock restarted), or None."""
        if not session_id:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if now - session.last_seen > self.idle_s:
                del self._sessions[session_id]
                return None
            session.last_seen = now
            self._sessions.move_to_end(session_id)
            return session

    def anonymous(self, session_id: str | None) -> Session:
        """The caller's session, or a new anonymous one (for the sign-in form's CSRF token)."""
        return self.get(session_id) or self._new(None)

    def sign_in(self, old_id: str | None, secret: str) -> Session:
        """A new signed-in session replacing `old_id` (a fresh id: an id seen before signing in is dead)."""
        self.end(old_id)
        return self._new(secret)

    def end(self, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._sessions.pop(session_id, None)


def csrf_ok(session: Session | None, submitted: str | None) -> bool:
    """True if a form's CSRF field matches its session's token (compared in constant time)."""
    if session is None or not submitted:
        return False
    return hmac.compare_digest(session.csrf.encode(), submitted.encode())


def cookie_options(path: str, secure: bool) -> dict:
    """Starlette `set_cookie` options for the session cookie."""
    return {"key": COOKIE_NAME, "path": path, "httponly": True, "samesite": "strict", "secure": secure}
