"""A standing demand's deployment: a run's export and how to serve it, instead of a job.

The market carries the deployment; it does not interpret the export (the provider's agent serves it
with `runyard serve` in the lease's sandbox and ends the lease, with the escrow returned, when it does
not load). What the market checks is what it can promise:

- the export's files, each under a relative path of plain names: `export_files` uploaded with the
  demand (base64, bounded like a job's files) and `export_urls`, http(s) URLs the provider fetches
  into the export before serving it (a large model goes this way). A path is given once.
- `serve`: the few `runyard serve` options a tenant chooses (`ServeSettingsIn`); the provider
  chooses the address, the port and the device.
- `token_sha256`: "sha256:" + hex SHA-256 of the bearer token the tenant will call its endpoint
  with. The token itself never travels: the provider's endpoint admits a request whose token hashes
  to this, so only the tenant can use it.

Only the lease's two parties see the deployment; the provider's signature on the standing lease's
terms covers `deployment_sha256`, the digest of exactly this deployment.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.market.jobs import MAX_EXPORT_URLS, check_export_files


class ServeSettingsIn(BaseModel):
    """The `runyard serve` options a tenant sets for its deployment."""

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        description="the name clients use for the model (default: the run's name)",
    )  # fmt: skip
    max_batch: int | None = Field(default=None, ge=1, le=1024, description="most sequences decoded together")
    max_queue: int | None = Field(default=None, ge=1, le=100_000, description="waiting sequences before 429")
    kv_cache_mb: int | None = Field(default=None, ge=1, le=1 << 20, description="KV cache budget, MiB")
    max_prefill_tokens: int | None = Field(default=None, ge=1, le=1 << 20, description="prompt tokens per step")
    log_requests: bool | None = Field(
        default=None, description="keep every prompt, PII-scrubbed, in the lease's work folder, and let the tenant "
        "fetch the sealed log through its endpoint (GET /v1/traffic): what a retraining on drift learns from",
    )  # fmt: skip


class ExportIn(BaseModel):
    """A run's export as a demand or a roll-out carries it: files uploaded with it, and files the provider
    fetches by URL before using it (a large model goes this way). A path is given once."""

    model_config = ConfigDict(extra="forbid")

    export_files: dict[str, str] = Field(
        default_factory=dict, description="relative path -> base64 content: export files uploaded with the request"
    )
    export_urls: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_EXPORT_URLS,
        description="relative path -> http(s) URL: export files the provider fetches before using them",
    )  # fmt: skip


class DeploymentIn(ExportIn):
    """A model to serve on a standing lease (see runyard.market.serving)."""

    serve: ServeSettingsIn = Field(default_factory=ServeSettingsIn, description="runyard serve options")
    token_sha256: str = Field(
        pattern=r"^sha256:[0-9a-f]{64}$", description="sha256 of the bearer token the tenant calls with"
    )

    @model_validator(mode="after")
    def _checked(self) -> DeploymentIn:
        check_deployment_files(self.export_files, self.export_urls)
        return self


class RolloutIn(ExportIn):
    """What a tenant asks its standing lease's provider to serve instead: another export (its files
    and URLs, as a deployment carries them), or, with `rollback`, the export served before the one
    serving now. The lease's serve options and endpoint token stay as they are."""

    rollback: bool = Field(default=False, description="return to the export served before (no files then)")

    @model_validator(mode="after")
    def _checked(self) -> RolloutIn:
        if self.rollback:
            if self.export_files or self.export_urls:
                raise ValueError("a roll-back carries no export: it returns to the one served before")
        else:
            check_deployment_files(self.export_files, self.export_urls)
        return self


class RolloutOutcomeIn(BaseModel):
    """The provider says how a roll-out ended on its machine."""

    model_config = ConfigDict(extra="forbid")

    switched: bool = Field(description="true: the endpoint now serves the new export; false: the old one serves")
    export_digest: str | None = Field(
        default=None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="the digest of the runyard export now serving (its runyard.json's sha256)",
    )  # fmt: skip
    detail: str = Field(default="", max_length=2000, description="what happened, in the provider's words")

    @model_validator(mode="after")
    def _checked(self) -> RolloutOutcomeIn:
        if self.switched and self.export_digest is None:
            raise ValueError("a switched roll-out names the export_digest now serving")
        return self


def check_deployment_files(files: dict[str, str], urls: dict[str, str]) -> None:
    """ValueError unless the export's files and URLs are well formed, bounded, and name each path once."""
    check_export_files(files, urls, "deployment")


def deployment_json(body: DeploymentIn | dict | None) -> str | None:
    """The stored form of a deployment (canonical JSON), or None."""
    if body is None:
        return None
    data = body.model_dump(mode="json", exclude_none=True) if isinstance(body, DeploymentIn) else body
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def deployment_of(text: str | None) -> dict | None:
    return None if text is None else json.loads(text)


def deployment_sha256(deployment: dict | None) -> str | None:
    """Digest of a deployment, signed with a standing lease's terms; None without one."""
    if deployment is None:
        return None
    canonical = json.dumps(deployment, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def token_digest(token: str) -> str:
    """What a deployment carries for the tenant's bearer `token`."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_endpoint_token() -> str:
    """A fresh bearer token for one deployment (the tenant keeps it; the market sees its digest)."""
    return "rye_" + secrets.token_urlsafe(32)


def deployment_body(files: dict[str, str] | None = None, urls: dict[str, str] | None = None,
                    serve: dict[str, Any] | None = None, token: str | None = None) -> tuple[dict, str]:
    """A deployment body and the token it admits (a fresh one unless given), checked as the market will."""
    token = token or new_endpoint_token()
    body = {"export_files": files or {}, "export_urls": urls or {}, "serve": serve or {},
            "token_sha256": token_digest(token)}
    DeploymentIn.model_validate(body)
    return body, token
