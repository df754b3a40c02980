"""The tables of ``docs/protocol.md`` that the code defines, generated from it: the
protocol versions, the rejection reason codes, the retry and back-off schedule and the
window's lifecycle (:mod:`.lifecycle`).

Each table sits in the document between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->``; :func:`update_doc` rewrites them, and a test fails when
the document and the code disagree. After changing one of these in the code:

    python -m p2ptrain.protocol.spec docs/protocol.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from p2ptrain.core.manifests import PROTOCOL_VERSION, VERSION_CHANGES
from p2ptrain.core.reasons import ARGS, TEXTS, Code
from p2ptrain.protocol.lifecycle import (
    EFFECTS,
    EVENTS,
    PHASES,
    TRANSITIONS,
    Event,
    Phase,
    Role,
    Transition,
)
from p2ptrain.protocol.policy import (
    AGGREGATE_ATTEMPTS,
    CATCH_UP_RETRY_S,
    FETCH_ATTEMPTS,
    NAMED_ATTEMPTS,
    STATE_ATTEMPTS,
    TRAIN_RETRY_MAX_S,
    backoff,
    train_backoff,
)

__all__ = ["tables", "update_doc"]

_PLACEHOLDER = re.compile(r"\{(\d+)(![rs])?(:[^}]*)?\}")


#: What the reasons table says of a code without arguments.
_NONE = "none"


def _said(code: Code) -> str:
    """The code's text with each argument named (``⟨ratio⟩``)."""
    names = ARGS[code]
    return _PLACEHOLDER.sub(lambda m: f"⟨{names[int(m.group(1))]}⟩", TEXTS[code])


def _reasons() -> str:
    rows = ["| code | name | arguments | says |", "|---|---|---|---|"]
    for code in Code:
        names = ", ".join(ARGS[code]) or _NONE
        rows.append(f"| {code.value} | `{code.name}` | {names} | {_said(code)} |")
    return "\n".join(rows)


def _versions() -> str:
    rows = ["| version | what changed |", "|---|---|", "| 1 | the first |"]
    rows += [f"| {v} | {what} |" for v, what in sorted(VERSION_CHANGES.items())]
    rows.append(f"\nThis release speaks protocol {PROTOCOL_VERSION} only.")
    return "\n".join(rows)


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values) + " s"


def _retries() -> str:
    waits = _seconds([backoff(a) for a in range(5)])
    train = _seconds([train_backoff(n) for n in range(1, 6)])
    rows = [
        "| what failed | tried again |",
        "|---|---|",
        f"| a fetch, in transit | after {waits} …; after {NAMED_ATTEMPTS} tries anyone is asked, "
        "not the peers named first |",
        f"| an update or a record | {FETCH_ATTEMPTS} tries while its window is open |",
        f"| a head's aggregate | {AGGREGATE_ATTEMPTS} tries, then its full state |",
        f"| a head's state (weights) | {STATE_ATTEMPTS} tries while it is the tip, then again "
        f"every {CATCH_UP_RETRY_S:g} s while the node is behind |",
        "| a fetch answered with bytes proven wrong | not again (the provider was blamed) |",
        f"| training (it raised) | after {train} (at most {TRAIN_RETRY_MAX_S:g} s), unless the "
        "head moved |",
    ]
    return "\n".join(rows)


def _step(phase: Phase, step: Transition | None) -> str:
    if step is None:
        return "—"
    to = "" if step.phase is phase else f"→ **{step.phase}**"
    effects = ", ".join(f"`{e}`" for e in step.effects)
    return " ".join(part for part in (to, effects) if part) or "(stays)"


def _lifecycle() -> str:
    roles = list(Role)
    rows = ["| phase | means |", "|---|---|"]
    rows += [f"| **{phase}** | {what} |" for phase, what in PHASES.items()]
    rows += ["", "| event | is |", "|---|---|"]
    rows += [f"| `{event}` | {what} |" for event, what in EVENTS.items()]
    rows += ["", "| effect | does |", "|---|---|"]
    rows += [f"| `{effect}` | {what} |" for effect, what in EFFECTS.items()]
    rows += [
        "",
        "| phase | event | " + " | ".join(str(r) for r in roles) + " |",
        "|---|---|" + "---|" * len(roles),
    ]
    count = 0
    for phase in Phase:
        for event in Event:
            steps = [TRANSITIONS[role].get((phase, event)) for role in roles]
            if all(step is None for step in steps):
                continue
            count += 1
            cells = " | ".join(_step(phase, step) for step in steps)
            rows.append(f"| **{phase}** | `{event}` | {cells} |")
    rows.append(
        f"\n{count} rows; a pair not listed (—) changes nothing. Source: "
        "`protocol/lifecycle.py` (`TRANSITIONS`)."
    )
    return "\n".join(rows)


def tables() -> dict[str, str]:
    """Each generated table of docs/protocol.md, by name."""
    return {
        "versions": _versions(),
        "reasons": _reasons(),
        "retries": _retries(),
        "lifecycle": _lifecycle(),
    }


def update_doc(text: str) -> str:
    """``text`` with every generated table rewritten from the code (a table whose markers
    are missing raises ValueError)."""
    for name, table in tables().items():
        start, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
        head, found, rest = text.partition(start)
        _, closed, tail = rest.partition(end)
        if not found or not closed:
            raise ValueError(f"docs/protocol.md has no {start} … {end} block")
        text = f"{head}{start}\n{table}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m p2ptrain.protocol.spec docs/protocol.md", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(update_doc(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"rewrote the generated tables of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
