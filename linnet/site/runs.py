"""Which run a page shows: every results file is a run of one machine kind under one protocol.

Per kind, the page leads with the latest complete run among the current ones; a kind with no complete
run yet shows the run that covers the most groups of the bench (the latest among equals), marked partial:
a serving load measured last does not hide a run of rows beside the reference. A run is *superseded*
once later runs of the same model, kind and protocol have measured every subject it measured; superseded
files belong in an ``archive/`` folder beside the current ones, which only the history page reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from linnet.registry.schema import Protocol
from linnet.results import GROUPS, Results
from linnet.site import machines, subjects
from linnet.site.machines import Kind

ARCHIVE = "archive"  # the folder, beside the current results files, that holds the superseded ones


@dataclass(frozen=True)
class Run:
    """One results file, its rows under their canonical ids (``linnet.site.subjects``)."""

    path: Path
    results: Results
    kind: Kind
    kind_note: str | None  # where the vector units came from, if the run did not record them
    archived: bool

    @property
    def protocol(self) -> Protocol:
        return self.results.protocol

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.results.timestamp)

    @property
    def complete(self) -> bool:
        """It covers every part of the bench: a row, measured or saying why not, in every group."""
        return {r.group for r in self.results.rows} >= set(GROUPS)

    @property
    def groups(self) -> int:
        """How many of the bench's groups it has rows in."""
        return len({r.group for r in self.results.rows} & set(GROUPS))

    @property
    def measured(self) -> set[str]:
        return {r.id for r in self.results.rows if r.metrics}

    @property
    def link(self) -> str:
        """Where the site keeps a copy of its file."""
        return f"results/{ARCHIVE}/{self.path.name}" if self.archived else f"results/{self.path.name}"


def run(path: Path, results: Results, published: bool = False) -> Run:
    kind, note = machines.kind(results.machine, path.name, published)
    return Run(path, subjects.canonical(results, str(path)), kind, note, path.parent.name == ARCHIVE)


def superseded(runs: Sequence[Run]) -> set[Path]:
    """The runs whose every measured subject later runs of the same model, kind and protocol measured again."""
    def group(run: Run) -> tuple[str, Kind, Protocol]:
        return run.results.model, run.kind, run.protocol

    found = set()
    for r in runs:
        later = [o.measured for o in runs if group(o) == group(r) and o.when > r.when]
        if later and r.measured <= set().union(*later):
            found.add(r.path)
    return found


@dataclass(frozen=True)
class KindRuns:
    """A machine kind's runs (oldest first) and the one its page leads with."""

    kind: Kind
    runs: list[Run]
    current: list[Run]  # neither archived nor superseded
    lead: Run | None  # None when every run of the kind is archived or superseded

    @property
    def by_protocol(self) -> list[tuple[Protocol, list[Run]]]:
        """The runs grouped by protocol, oldest first within a group, the group with the newest run first."""
        groups: dict[Protocol, list[Run]] = {}
        for r in self.runs:
            groups.setdefault(r.protocol, []).append(r)
        return sorted(groups.items(), key=lambda g: g[1][-1].when, reverse=True)


def by_kind(runs: Sequence[Run]) -> list[KindRuns]:
    """Every kind among ``runs``: Linnet's own measurements before published ones, kinds with a complete
    run first, then the newest lead first."""
    old = superseded(runs)
    found = []
    for kind in dict.fromkeys(r.kind for r in runs):
        mine = sorted((r for r in runs if r.kind == kind), key=lambda r: r.when)
        current = [r for r in mine if not r.archived and r.path not in old]
        lead = max(current, key=lambda r: (r.complete, r.groups, r.when)) if current else None
        found.append(KindRuns(kind, mine, current, lead))
    return sorted(found, key=lambda k: (k.kind.published, k.lead is None,
                                        not (k.lead and k.lead.complete), -(k.lead or k.runs[-1]).when.timestamp()))
