"""`runyard control ui`: the control plane's web console, on loopback only.

Read-only pages of the queue, jobs with their attempts and logs, devices, and recent failures by class.
Every page reads the daemon's own HTTP API through `ControlClient` (the functions `runyard queue` and
`runyard job` use), so it shows exactly what the API answers and nothing the API would refuse.

Signing in posts the daemon's API token (`<state dir>/api-token`) once; the browser then holds a random
session id in an HttpOnly, SameSite=Strict cookie (`system.web_sessions`) and every form carries the
session's CSRF token. As the API, the console answers only requests addressed to a loopback host (no
DNS rebinding) and binds only a loopback address.
"""

from __future__ import annotations

import hmac
from collections import Counter
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from runyard.control import auth
from runyard.control.client import ControlClient
from runyard.control.info import ControlError
from runyard.control.states import JobState
from runyard.system.web_pages import SECURITY_HEADERS, environment, parse_form
from runyard.system.web_sessions import COOKIE_NAME, Session, SessionStore, cookie_options, csrf_ok

LOG_TAIL_BYTES = 64 * 1024  # the end of a job's log shown on its page
RECENT_FAILURES = 200  # failed attempts counted by class (the newest)


def _queue(jobs: list[dict]) -> list[dict]:
    """Pending jobs in the scheduler's order: priority first, then submission."""
    return sorted((j for j in jobs if j["state"] == "pending"), key=lambda j: (-j["priority"], j["id"]))


def failures_by_class(jobs: list[dict]) -> list[tuple[str, int, list[int]]]:
    """(class, failed attempts, job ids) for the newest failed attempts, most frequent class first. An
    attempt's class is in the job's `failures` ([[time, class], ...]); a job that failed for good adds
    its final `failure` once more when that attempt is not in the list."""
    attempts: list[tuple[float, str, int]] = []
    for job in jobs:
        seen = [(float(f[0]), str(f[1]), job["id"]) for f in job.get("failures") or [] if len(f) >= 2]
        if job["state"] == "failed" and job.get("failure") and not seen:
            seen.append((float(job.get("ended_at") or 0), job["failure"], job["id"]))
        attempts += seen
    attempts = sorted(attempts, reverse=True)[:RECENT_FAILURES]
    counts = Counter(kind for _, kind, _ in attempts)
    return [(kind, n, sorted({j for _, k, j in attempts if k == kind})) for kind, n in counts.most_common()]


def overview(client: ControlClient) -> dict[str, Any]:
    jobs = client.jobs()
    return {"health": client.health(), "capacity": client.capacity(), "queue": _queue(jobs),
            "active": [j for j in jobs if j["state"] != "pending" and not JobState(j["state"]).terminal],
            "failures": failures_by_class(jobs), "recent": jobs[-20:][::-1]}  # fmt: skip


def job_page(client: ControlClient, job_id: int) -> dict[str, Any]:
    shown = client.job(job_id)
    first = client.logs(job_id, 0)
    size = first["offset"]
    if size > LOG_TAIL_BYTES:  # a long log: read again from near its end
        first = client.logs(job_id, size - LOG_TAIL_BYTES)
    return {"job": shown["job"], "history": shown["history"], "log": first["text"], "log_cut": size > LOG_TAIL_BYTES}


def create_ui(client: ControlClient, token: str) -> Starlette:
    """The console over the daemon `client` talks to; `token` is the daemon's (what signing in must post)."""
    sessions = SessionStore()
    templates = environment("runyard.control")

    def html(request: Request, template: str, values: dict, session: Session, status: int = 200) -> Response:
        body = templates.get_template(template).render(csrf=session.csrf, signed_in=session.signed_in, **values)
        response = HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)
        response.set_cookie(value=session.id, **cookie_options("/", request.url.scheme == "https"))
        return response

    def refuse(request: Request, status: int, message: str, session: Session | None) -> Response:
        return html(request, "error.html", {"status": status, "message": message}, session or sessions.anonymous(None),
                    status)  # fmt: skip

    def checked(fn):  # type: ignore[no-untyped-def]
        """Host first (a rebinding page is refused outright), then the session."""

        async def endpoint(request: Request) -> Response:
            if not auth.host_ok(request.headers.get("host")):
                return HTMLResponse("the control console answers only requests addressed to a loopback host", 403)
            session = sessions.get(request.cookies.get(COOKIE_NAME))
            return await fn(request, session)

        return endpoint

    def page(fn, template: str):  # type: ignore[no-untyped-def]
        async def endpoint(request: Request, session: Session | None) -> Response:
            if session is None or not session.signed_in:
                return RedirectResponse("/sign-in", 303, headers=SECURITY_HEADERS)
            try:
                values = await run_in_threadpool(fn, client, **request.path_params)
            except ControlError as exc:
                status = 404 if "no job" in str(exc) else 502
                return refuse(request, status, str(exc), session)
            return html(request, template, values, session)

        return checked(endpoint)

    async def sign_in_form(request: Request, session: Session | None) -> Response:
        return html(request, "sign_in.html", {}, session or sessions.anonymous(None))

    async def sign_in(request: Request, session: Session | None) -> Response:
        try:
            form = parse_form(await request.body())
        except ValueError:
            form = {}
        if not csrf_ok(session, (form.get("csrf") or [""])[0]):
            return refuse(request, 403, "the form's CSRF token is missing or stale; reload the page", session)
        given = (form.get("token") or [""])[0].strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return refuse(request, 401, "that is not this control plane's API token (its state directory's "
                          "api-token file)", session)  # fmt: skip
        fresh = sessions.sign_in(session.id if session else None, given)
        response = RedirectResponse("/", 303, headers=SECURITY_HEADERS)
        response.set_cookie(value=fresh.id, **cookie_options("/", request.url.scheme == "https"))
        return response

    async def sign_out(request: Request, session: Session | None) -> Response:
        form = parse_form(await request.body())
        if not csrf_ok(session, (form.get("csrf") or [""])[0]):
            return refuse(request, 403, "the form's CSRF token is missing or stale; reload the page", session)
        sessions.end(session.id if session else None)
        response = RedirectResponse("/sign-in", 303, headers=SECURITY_HEADERS)
        response.delete_cookie(COOKIE_NAME, path="/")
        return response

    routes = [
        Route("/", page(overview, "overview.html"), methods=["GET"]),
        Route("/jobs", page(lambda c: {"jobs": c.jobs()[::-1]}, "jobs.html"), methods=["GET"]),
        Route("/jobs/{job_id:int}", page(job_page, "job.html"), methods=["GET"]),
        Route("/sign-in", checked(sign_in_form), methods=["GET"]),
        Route("/sign-in", checked(sign_in), methods=["POST"]),
        Route("/sign-out", checked(sign_out), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def serve_ui(state_dir: str, host: str = "127.0.0.1", port: int = 8471) -> None:
    """Serve the console for the daemon on `state_dir` until interrupted (loopback addresses only)."""
    if host not in auth.LOOPBACK_HOSTS:
        raise ControlError(f"the control console binds only a loopback address, not {host!r}")
    client = ControlClient.for_state_dir(state_dir)
    client.health()  # a daemon that is not running is said now, not on the first page
    print(f"control console on http://{'[' + host + ']' if ':' in host else host}:{port}/ "
          f"(sign in with {auth.token_path(state_dir)})", flush=True)  # fmt: skip
    uvicorn.run(create_ui(client, client.token), host=host, port=port, log_level="warning", access_log=False)
