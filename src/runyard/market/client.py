"""`MarketClient`: the Python client of the market's HTTP API (used by `runyard market ...` and by
the control plane's market agent). It imports no torch.

    from runyard.market.client import MarketClient

    provider = MarketClient("http://127.0.0.1:8470")
    provider.register("gpu-farm", "provider")       # makes an Ed25519 key pair, keeps token and key
    provider.save_identity("provider.json")         # later: MarketClient.from_identity_file(path)
    provider.request_verification("company number 123")
    provider.verify_status()                        # {'state': 'pending' | 'verified' | ...}
    provider.create_listing(accelerator_kind="h100-80gb", devices_per_node=8, node_count=2,
                            region="eu-west", jurisdiction="eu", price_per_device_hour=250,
                            available_until=now + 30 * 86400, start_class="immediate")

    tenant = MarketClient(url); tenant.register("lab", "tenant"); ...
    # money arrives through a payment rail (rails.TestRail in tests) or an operator's credit:
    operator.credit(account="lab", amount=100_000, reason="wire 2026-11-30")
    demand = tenant.place_demand({"accelerator_kinds": ["h100-80gb"], "device_count": 4,
                                  "duration_s": 7200}, max_price_per_device_hour=300,
                                 job={"spec": Path("job.yaml").read_text(), "results_to": "/srv/results/x"})

    lease = provider.leases(state="offered")[0]
    provider.accept_lease(lease["id"])               # signs the lease terms with the provider's key
    provider.start_lease(lease["id"])
    provider.report_usage(lease["id"], seq=1, interval_start=t0, interval_end=t0 + 600,
                          device_seconds=4 * 600, evidence="sha256:...")   # signed record
    tenant.acknowledge(record_id) / tenant.dispute(record_id, "reason", claimed_device_seconds=...)
    tenant.submit_measurement(lease_id, t0, t0 + 600, device_seconds)      # tenant's signed view
    provider.close_lease(lease["id"]); tenant.settle(lease["id"]); tenant.statement()

Money-moving calls take an optional `idempotency_key`; without one the client makes a fresh key per
call and reuses it for its own retries (connection errors and 503), so a retried call is applied
once. Every method returns the server's JSON (dicts and lists); an error answer raises
`MarketClientError` with `status`, `code` and the server's message. Lease-state names are in
`runyard.market.states.lease`; signed payloads are built by `runyard.market.payloads`.
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from runyard.errors import RunyardError
from runyard.market import payloads
from runyard.market.operations import BY_NAME, OPERATIONS, Operation
from runyard.market.rails import TestRail
from runyard.market.requirement import Requirement
from runyard.market.signing import generate_keypair, public_key_of, sign
from runyard.system.files import atomic_write_text

RETRY_STATUSES = {502, 503, 504}


class MarketClientError(RunyardError):
    """The market refused a request (or could not be reached)."""

    def __init__(self, status: int, code: str, message: str, detail: dict | None = None):
        super().__init__(f"market said {status} {code}: {message}")
        self.status, self.code, self.message, self.detail = status, code, message, detail or {}


class MarketClient:
    """A client for one market, acting as one account (token + Ed25519 private key)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        private_key: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.private_key = private_key
        self.retries = retries
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)
        self._currency: str | None = None

    # -- plumbing ----------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MarketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Any = None, key: str | None = None, **params: Any) -> Any:
        """Send one request (retrying transport failures with the same idempotency key)."""
        headers = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if key is not None:
            headers["Idempotency-Key"] = key
        query = {k: v for k, v in params.items() if v is not None}
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, json=body, headers=headers, params=query)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise MarketClientError(0, "unreachable", f"{self.base_url}: {exc}") from exc
                time.sleep(0.1 * 2**attempt)
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                time.sleep(0.1 * 2**attempt)
                continue
            if response.status_code >= 400:
                try:
                    data = response.json()
                except ValueError:
                    data = {"error": "http_error", "message": response.text[:500]}
                raise MarketClientError(
                    response.status_code,
                    data.get("error", "error"),
                    data.get("message", ""),
                    data.get("detail"),
                )
            return response.json()
        raise AssertionError("unreachable")

    def call(
        self, name: str, *path_args: Any, body: Any = None, idempotency_key: str | None = None, **query: Any
    ) -> Any:
        """Call operation `name` (see `runyard.market.operations`) with its path parameters in order."""
        op = BY_NAME[name]
        if len(path_args) != len(op.path_params):
            raise TypeError(f"{name} takes {op.path_params}, got {path_args!r}")
        path = op.path.format(**dict(zip(op.path_params, path_args, strict=True)))
        key = idempotency_key
        if op.key == "required" and key is None:
            key = uuid.uuid4().hex
        return self.request(op.method, path, body, key=key, **query)

    def _sign(self, payload: dict) -> str:
        if not self.private_key:
            raise MarketClientError(0, "no_key", "this client has no private key to sign with")
        return sign(self.private_key, payload)

    def _signed_body(self, payload: dict) -> dict:
        """The request body for a signed payload: its fields less those the URL already carries
        (`type`, `lease_id`; the server rebuilds the payload from both), plus the signature."""
        body = {k: v for k, v in payload.items() if k not in ("type", "lease_id")}
        body["signature"] = self._sign(payload)
        return body

    @property
    def currency(self) -> str:
        if self._currency is None:
            self._currency = self.market_info()["currency"]
        return self._currency

    # -- operations that do more than send their fields --------------------------------------------

    def register(self, name: str, role: str, public_key: str | None = None) -> dict:
        """Register as 'tenant' or 'provider'. Without `public_key` a key pair is made and kept here."""
        if public_key is None:
            if self.private_key is None:
                self.private_key, public_key = generate_keypair()
            else:
                public_key = public_key_of(self.private_key)
        result = self.call("register", body={"name": name, "role": role, "public_key": public_key})
        self.token = result["token"]
        return result

    def save_identity(self, path: str | Path) -> None:
        """Write token and private key to `path` (mode 0600, atomically)."""
        identity = {"url": self.base_url, "token": self.token, "private_key": self.private_key}
        atomic_write_text(path, json.dumps(identity), mode=0o600)

    @classmethod
    def from_identity_file(cls, path: str | Path, base_url: str | None = None, **kwargs: Any) -> MarketClient:
        """A client acting as the account saved in `path` (by `save_identity`); RunyardError if the
        file cannot be read or is not such an identity."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RunyardError(f"cannot read market identity {path}: {exc}") from exc
        if not isinstance(data, dict) or not all(
            isinstance(data.get(k), str | None) for k in ("url", "token", "private_key")
        ):
            raise RunyardError(
                f"market identity {path} is not an object of url, token and private_key strings"
            )
        url = base_url or data.get("url")
        if not url:
            raise RunyardError(f"market identity {path} names no market url; pass one (--url)")
        return cls(url, token=data.get("token"), private_key=data.get("private_key"), **kwargs)

    def verify_status(self) -> str:
        """unverified | pending | verified | rejected."""
        return self.me()["state"]

    def place_demand(
        self,
        requirement: Requirement | dict,
        max_price_per_device_hour: int,
        idempotency_key: str | None = None,
        job: dict | None = None,
        form: str = "block",
        standing: dict | None = None,
        deployment: dict | None = None,
    ) -> dict:
        """Place a demand; its escrow (max price x devices x duration) is reserved at once.

        `job` = {"spec": YAML text, "results_to": absolute path or URL}: the job to run on the
        lease, seen only by the lease's provider and this tenant (see `runyard.market.jobs`).
        A standing demand (`form="standing"`) states `standing` = {"period_s", "term_periods", ...}
        and may carry a `deployment` (`runyard.market.serving.deployment_body` makes one and the
        endpoint token it admits); its escrow is max price x devices x period x term_periods."""
        req = requirement.model_dump(mode="json", exclude_unset=True) if isinstance(requirement, Requirement) \
            else requirement
        body: dict[str, Any] = {"requirement": req, "max_price_per_device_hour": max_price_per_device_hour}
        if job is not None:
            body["job"] = job
        if form != "block":
            body["form"] = form
        if standing is not None:
            body["standing"] = standing
        if deployment is not None:
            body["deployment"] = deployment
        return self.call("place_demand", body=body, idempotency_key=idempotency_key)

    def accept_lease(self, lease_id: int, idempotency_key: str | None = None) -> dict:
        """Sign the lease's terms with this provider's key and accept it."""
        lease = self.lease(lease_id)
        signature = self._sign(payloads.lease_terms(lease, self.currency))
        return self.call(
            "accept_lease", lease_id, body={"signature": signature}, idempotency_key=idempotency_key
        )

    def report_usage(
        self,
        lease_id: int,
        seq: int,
        interval_start: int,
        interval_end: int,
        device_seconds: int,
        evidence: str | None = None,
        idempotency_key: str | None = None,
    ) -> dict:
        """Report one usage record, signed with this provider's key."""
        payload = payloads.usage_record(lease_id, seq, interval_start, interval_end, device_seconds, evidence)
        return self.call(
            "report_usage", lease_id, body=self._signed_body(payload), idempotency_key=idempotency_key
        )

    def submit_measurement(
        self,
        lease_id: int,
        interval_start: int,
        interval_end: int,
        device_seconds: int,
        idempotency_key: str | None = None,
    ) -> dict:
        """The tenant's own signed view of an interval; a mismatch beyond tolerance opens a dispute."""
        payload = payloads.measurement(lease_id, interval_start, interval_end, device_seconds)
        return self.call(
            "submit_measurement", lease_id, body=self._signed_body(payload), idempotency_key=idempotency_key
        )

    def report_availability(
        self,
        lease_id: int,
        seq: int,
        interval_start: int,
        interval_end: int,
        available_seconds: int,
        probes: int,
        probes_ok: int,
        requests: int = 0,
        latency_p50_ms: int | None = None,
        latency_p99_ms: int | None = None,
        idempotency_key: str | None = None,
    ) -> dict:
        """Report one availability record of a standing lease, signed with this provider's key."""
        payload = payloads.availability_record(lease_id, seq, interval_start, interval_end, available_seconds,
                                               probes, probes_ok, requests, latency_p50_ms, latency_p99_ms)
        return self.call(
            "report_availability", lease_id, body=self._signed_body(payload), idempotency_key=idempotency_key
        )

    def submit_probes(
        self,
        lease_id: int,
        interval_start: int,
        interval_end: int,
        available_seconds: int,
        probes: int,
        probes_ok: int,
        idempotency_key: str | None = None,
    ) -> dict:
        """The tenant's own signed probe results of a standing lease's endpoint over an interval."""
        payload = payloads.tenant_probes(lease_id, interval_start, interval_end, available_seconds, probes, probes_ok)
        return self.call(
            "submit_probes", lease_id, body=self._signed_body(payload), idempotency_key=idempotency_key
        )

    def advance_clock(self, seconds: int) -> int:
        """Move a test market's clock forward; returns the new market time."""
        return self.call("advance_clock", body={"seconds": seconds})["now"]

    def rail_deposit(self, rail: TestRail, account_id: int, amount: int, event_id: str | None = None) -> dict:
        """Post a deposit event signed by `rail` (a test rail: tests and demos) for `account_id`."""
        body, headers = rail.deposit_event(account_id, amount, self.currency, event_id)
        response = self._http.post(f"/v1/rails/{rail.name}/events", content=body, headers=headers)
        if response.status_code >= 400:
            data = response.json()
            raise MarketClientError(response.status_code, data.get("error", "error"), data.get("message", ""))
        return response.json()


def _generated(op: Operation) -> Any:
    """A client method for `op`: path parameters first, then the body's fields and the query
    parameters (by name or position), then `idempotency_key` when the operation takes one."""
    body_fields = dict(op.body.model_fields) if op.body is not None else {}
    kw = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kw)]
    params += [
        inspect.Parameter(name, kw, annotation=int if name.endswith("_id") else str)
        for name in op.path_params
    ]
    required, optional = [], []
    for name, info in body_fields.items():
        default = op.client_defaults.get(
            name, inspect.Parameter.empty if info.is_required() else info.get_default(call_default_factory=True)
        )
        target = required if default is inspect.Parameter.empty else optional
        target.append(inspect.Parameter(name, kw, annotation=info.annotation, default=default))
    for name, q in op.query.items():
        optional.append(inspect.Parameter(name, kw, annotation=q.annotation, default=q.default))
    params += required + optional
    if op.key is not None:
        params.append(inspect.Parameter("idempotency_key", kw, annotation=str | None, default=None))
    signature = inspect.Signature(params)

    def method(self: MarketClient, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        path_args = [values.pop(name) for name in op.path_params]
        key = values.pop("idempotency_key", None)
        query = {name: _query_value(values.pop(name)) for name in op.query}
        body = {name: values[name] for name in body_fields} if op.body is not None else None
        return self.call(op.name, *path_args, body=body, idempotency_key=key, **query)

    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = op.name
    method.__doc__ = f"{op.summary} ({op.method} {op.path})."
    return method


def _query_value(value: Any) -> Any:
    return str(value).lower() if isinstance(value, bool) else value


for _op in OPERATIONS:
    if not hasattr(MarketClient, _op.name):
        setattr(MarketClient, _op.name, _generated(_op))
