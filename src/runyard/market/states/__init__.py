"""State machines. Each entity's states and allowed transitions are a table in one module of this
package (identity, demand, lease, record, dispute); `transition` is the only code that changes a
`state` column, and it records every change with its actor, time and reason.

A transition table maps (from_state, to_state) to the sides allowed to make it: 'tenant',
'provider', 'operator' or 'system' (the market itself: matching, timeouts, settlement). Ownership
(is this *your* lease?) is checked by the caller before it asks for a transition.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Table, select, update

from runyard.market.errors import InvalidTransition, NotFound
from runyard.market.schema import transitions

SIDES = ("tenant", "provider", "operator", "system")


@dataclass(frozen=True)
class Actor:
    """Who does something: a side and, for people, their account id."""

    side: str
    account_id: int | None = None

    def __str__(self) -> str:
        return self.side if self.account_id is None else f"{self.side}:{self.account_id}"


SYSTEM = Actor("system")


@dataclass(frozen=True)
class Machine:
    """A named set of states and the transitions between them, stored in `table.state`."""

    entity: str
    table: Table
    initial: str
    table_of_transitions: dict[tuple[str, str], frozenset[str]]

    @property
    def states(self) -> set[str]:
        return {self.initial} | {s for pair in self.table_of_transitions for s in pair}

    @property
    def terminal(self) -> set[str]:
        sources = {a for a, _ in self.table_of_transitions}
        return self.states - sources

    def allowed(self, from_state: str, to_state: str, side: str) -> bool:
        return side in self.table_of_transitions.get((from_state, to_state), frozenset())


def sides(*names: str) -> frozenset[str]:
    assert all(n in SIDES for n in names), names
    return frozenset(names)


def record_initial(
    conn: Connection, machine: Machine, entity_id: int, actor: Actor, reason: str, now: int
) -> None:
    """Record the creation of an entity in its initial state."""
    conn.execute(
        transitions.insert().values(
            entity=machine.entity,
            entity_id=entity_id,
            from_state=None,
            to_state=machine.initial,
            actor=str(actor),
            reason=reason,
            at=now,
        )
    )


def transition(
    conn: Connection,
    machine: Machine,
    entity_id: int,
    to_state: str,
    actor: Actor,
    reason: str,
    now: int,
    expect: str | tuple[str, ...] | None = None,
    **columns: object,
) -> str:
    """Move one entity to `to_state`, setting any extra `columns` in the same UPDATE.

    Refused (InvalidTransition, nothing changed) unless the table allows (current, to_state) for the
    actor's side and, when `expect` is given, the current state is one of those. The UPDATE is
    conditional on the state read, so a concurrent change is refused, never overwritten. Returns the
    state the entity left.
    """
    table = machine.table
    current = conn.execute(select(table.c.state).where(table.c.id == entity_id)).scalar_one_or_none()
    if current is None:
        raise NotFound(f"{machine.entity} {entity_id} does not exist")
    expected = (expect,) if isinstance(expect, str) else expect
    if (expected is not None and current not in expected) or not machine.allowed(
        current, to_state, actor.side
    ):
        raise InvalidTransition(
            f"{machine.entity} {entity_id} is {current!r}; {actor.side} cannot move it to {to_state!r}",
            entity=machine.entity,
            id=entity_id,
            state=current,
            requested=to_state,
        )
    result = conn.execute(
        update(table)
        .where(table.c.id == entity_id, table.c.state == current)
        .values(state=to_state, **columns)
    )
    if result.rowcount != 1:
        raise InvalidTransition(f"{machine.entity} {entity_id} changed state concurrently; retry")
    conn.execute(
        transitions.insert().values(
            entity=machine.entity,
            entity_id=entity_id,
            from_state=current,
            to_state=to_state,
            actor=str(actor),
            reason=reason or to_state,
            at=now,
        )
    )
    return current
