"""Identities: registration, API tokens (stored only as SHA-256 hashes), and verification.

Verification goes through the market's `Verifier` (`runyard.market.verifiers`): with
`OperatorVerifier` a request waits in `pending` until an operator approves or rejects it with a
reason; a verifier that decides by itself has its decision applied as the system actor.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import Connection, select

from runyard.market import ledger
from runyard.market.errors import BadRequest, Conflict, Forbidden, NotFound, NotVerified, Unauthenticated
from runyard.market.matcher import match_open_demands
from runyard.market.revocation import end_trading
from runyard.market.schema import accounts
from runyard.market.service import Market, Principal, audit
from runyard.market.signing import check_public_key, generate_keypair
from runyard.market.states import SYSTEM, Actor, record_initial, transition
from runyard.market.states.identity import IDENTITY, PENDING, REJECTED, UNVERIFIED, VERIFIED
from runyard.market.verifiers import AutoApproveVerifier, OperatorVerifier, Verifier

__all__ = ["AutoApproveVerifier", "OperatorVerifier", "Verifier"]  # re-exported for older imports

ROLES = ("tenant", "provider")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    return "ryk_" + secrets.token_urlsafe(32)


def _principal(row) -> Principal:  # type: ignore[no-untyped-def]
    return Principal(id=row.id, name=row.name, role=row.role, state=row.state, public_key=row.public_key)


def _create(
    conn: Connection, name: str, role: str, public_key: str, now: int, actor: Actor | None
) -> tuple[int, str]:
    if not NAME_RE.match(name or ""):
        raise BadRequest(
            f"name {name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if conn.execute(select(accounts.c.id).where(accounts.c.name == name)).scalar() is not None:
        raise Conflict(f"the name {name!r} is taken")
    if conn.execute(select(accounts.c.id).where(accounts.c.public_key == public_key)).scalar() is not None:
        raise Conflict(
            "this public key is already registered to another account; make a key pair of your own"
        )
    token = new_token()
    account_id = conn.execute(
        accounts.insert().values(
            name=name,
            role=role,
            public_key=public_key,
            token_hash=hash_token(token),
            state=UNVERIFIED,
            evidence="",
            created_at=now,
        )
    ).inserted_primary_key[0]
    record_initial(conn, IDENTITY, account_id, actor or Actor(role, account_id), "registered", now)
    if role == "tenant":
        ledger.open_account(conn, f"tenant:{account_id}:available", "tenant_available", account_id)
        ledger.open_account(conn, ledger.external_code(account_id, "deposits"), "external_deposits", account_id)
    elif role == "provider":
        ledger.open_account(conn, f"provider:{account_id}:earnings", "provider_earnings", account_id)
    if role in ROLES:
        # Opened now, not on first use, so that two first deposits at once never race to make it.
        ledger.open_account(conn, ledger.external_code(account_id, "withdrawals"), "external_withdrawals", account_id)
    audit(
        conn,
        actor or Actor(role, account_id),
        "account.register",
        f"account:{account_id}",
        now,
        name=name,
        role=role,
    )
    return account_id, token


def register(market: Market, name: str, role: str, public_key: str) -> dict:
    """Register a tenant or provider. The token in the answer is shown once and stored only hashed."""
    if role not in ROLES:
        raise BadRequest(f"role must be one of {list(ROLES)}, got {role!r}")
    check_public_key(public_key)

    def tx(conn: Connection, now: int) -> dict:
        account_id, token = _create(conn, name, role, public_key, now, None)
        return {"id": account_id, "name": name, "role": role, "state": UNVERIFIED, "token": token}

    return market.write(tx)


def create_operator(market: Market, name: str) -> dict:
    """Create an operator account (from the command line, with direct access to the store)."""

    def tx(conn: Connection, now: int) -> dict:
        _, public_key = generate_keypair()  # operators sign nothing; the key only fills the column
        account_id, token = _create(conn, name, "operator", public_key, now, Actor("operator"))
        # Operators are verified by construction: they run the market.
        transition(conn, IDENTITY, account_id, PENDING, Actor("operator"), "operator account", now)
        transition(conn, IDENTITY, account_id, VERIFIED, Actor("operator"), "operator account", now)
        return {"id": account_id, "name": name, "role": "operator", "token": token}

    return market.write(tx)


def authenticate(market: Market, token: str | None) -> Principal:
    """The account a bearer token belongs to, or Unauthenticated."""
    if not token:
        raise Unauthenticated("send 'Authorization: Bearer <token>' (the token `register` returned)")
    digest = hash_token(token)
    row = market.store.read(
        lambda c: c.execute(select(accounts).where(accounts.c.token_hash == digest)).one_or_none()
    )
    if row is None:
        raise Unauthenticated("unknown API token")
    return _principal(row)


def status(market: Market, principal: Principal) -> dict:
    def tx(conn: Connection, now: int) -> dict:
        row = conn.execute(select(accounts).where(accounts.c.id == principal.id)).one()
        return {
            "id": row.id,
            "name": row.name,
            "role": row.role,
            "state": row.state,
            "public_key": row.public_key,
        }

    return market.read(tx)


def request_verification(market: Market, principal: Principal, evidence: str) -> dict:
    """Ask to be verified. The verifier may decide at once; the default waits for an operator."""
    principal.require_role(*ROLES)
    if len(evidence) > 10_000:
        raise BadRequest("evidence must be at most 10000 characters")

    def tx(conn: Connection, now: int) -> dict:
        conn.execute(accounts.update().where(accounts.c.id == principal.id).values(evidence=evidence))
        transition(
            conn,
            IDENTITY,
            principal.id,
            PENDING,
            principal.actor,
            "verification requested",
            now,
            expect=(UNVERIFIED, REJECTED),
        )
        audit(conn, principal.actor, "identity.request", f"account:{principal.id}", now)
        row = conn.execute(select(accounts).where(accounts.c.id == principal.id)).mappings().one()
        decision = market.verifier.review(dict(row), evidence)
        if decision is not None:
            _decide(conn, principal.id, decision[0], decision[1], SYSTEM, now)
        return {
            "id": principal.id,
            "state": conn.execute(select(accounts.c.state).where(accounts.c.id == principal.id)).scalar_one(),
        }

    return market.write(tx)


def _decide(conn: Connection, account_id: int, approve: bool, reason: str, actor: Actor, now: int) -> None:
    target = VERIFIED if approve else REJECTED
    before = transition(conn, IDENTITY, account_id, target, actor, reason, now)
    audit(conn, actor, "identity.decide", f"account:{account_id}", now, state=target, reason=reason)
    if before == VERIFIED:
        # A revocation: the account's business ends in this same transaction (revocation.py).
        role = conn.execute(select(accounts.c.role).where(accounts.c.id == account_id)).scalar_one()
        end_trading(conn, account_id, role, actor, reason, now)
    if approve:
        # Orders waiting on this account may now match.
        match_open_demands(conn, now)


def decide(market: Market, actor: Actor, account: str | int, approve: bool, reason: str) -> dict:
    """An operator approves or rejects a pending account (or revokes a verified one)."""
    if not reason or not reason.strip():
        raise BadRequest("a verification decision needs a reason")

    def tx(conn: Connection, now: int) -> dict:
        if actor.side == "operator" and actor.account_id:  # 0 or None: the console, with the store itself
            # The deciding operator must still be verified now, not when it authenticated.
            state = conn.execute(select(accounts.c.state).where(accounts.c.id == actor.account_id)
                                 .with_for_update(read=True)).scalar_one()
            if state != VERIFIED:
                raise NotVerified(f"operator {actor.account_id} is {state}; only verified operators may decide")
        column = accounts.c.id if isinstance(account, int) or str(account).isdigit() else accounts.c.name
        key = int(account) if column is accounts.c.id else account
        if column is accounts.c.id and not 0 < int(key) < 2**63:
            raise NotFound(f"no account {account!r}")
        account_id = conn.execute(select(accounts.c.id).where(column == key)).scalar()
        if account_id is None:
            raise NotFound(f"no account {account!r}")
        if account_id == actor.account_id:
            raise Forbidden("an operator cannot decide on its own account; another operator must")
        _decide(conn, account_id, approve, reason, actor, now)
        row = conn.execute(select(accounts).where(accounts.c.id == account_id)).one()
        return {"id": row.id, "name": row.name, "role": row.role, "state": row.state}

    return market.write(tx)


def pending_accounts(market: Market) -> list[dict]:
    def tx(conn: Connection, now: int) -> list[dict]:
        rows = conn.execute(select(accounts).where(accounts.c.state == PENDING).order_by(accounts.c.id))
        return [{"id": r.id, "name": r.name, "role": r.role, "evidence": r.evidence} for r in rows]

    return market.read(tx)
