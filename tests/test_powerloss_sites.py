"""Every durability site of the library, disabled alone, makes the power-loss explorer fail.

The sites are found by reading ``ckptdb/``'s syntax tree
(``tests/powerloss/sites.py``): each call of ``os.fsync``, ``os.fdatasync``,
``os.replace``, ``os.rename``, ``os.unlink``, ``os.remove`` and
``shutil.rmtree``, so one added later is tested without anyone listing it;
a spelling the scan could not see (``from os import fsync``,
``Path.unlink()``) fails the first test instead.

For each site, the scenarios of ``tests/test_powerloss.py`` are recorded in
turn with that one call doing nothing (as if a refactor had deleted the line
and kept the rest), until one reaches it; that recording is then explored
(the end state first, then the cuts from the last), with the real library
reopening each crash state. The site must be caught: by a crash state the
explorer finds wrong, or by the scenario failing outright while it is
recorded (with an error of the library or the scenario's own check, never
of the recorder). The crash state that exposed it is printed (``-s``).
``CKPTDB_POWERLOSS=deep`` explores every state of the default budget and
counts those that expose the site.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from powerloss.catalog import SCENARIOS
from powerloss.explorer import Explorer
from powerloss.persistence import PosixMinimal
from powerloss.recording import TraceError
from powerloss.settings import DEEP, budget_for
from powerloss.sites import (
    EXEMPT,
    Site,
    counting,
    disabled,
    enabled_again,
    find_sites,
    hidden_calls,
    reached,
)
from powerloss.syscalls import SyscallTraceError

from ckptdb.errors import CkptDBError

REPO = Path(__file__).resolve().parents[1]
SITES = find_sites(REPO)
#: The scenarios tried, cheapest and most common first.
ORDER = (
    "new_run",
    "history",
    "sharded",
    "external",
    "reconcile",
    "aliases",
    "adopt",
    "made_root",
    "resave",
    "async",
    "export",
)

# the slowest site took 133 s beside a second copy of the suite (2026-12-07)
pytestmark = pytest.mark.timeout(3600 if DEEP else 420)


@dataclass(frozen=True)
class Caught:
    scenario: str
    how: str  # the crash state that exposed it, or the error of the recording
    figures: str = ""


def test_the_scan_finds_every_site_and_nothing_hides_from_it() -> None:
    assert hidden_calls(REPO) == []
    names = {site.name for site in SITES}
    assert {
        "storage.files.sync_data: os.fsync",
        "storage.files.fsync_dir: os.fsync",
        "storage.files.place: os.replace",
        "storage.files.remove: os.unlink",
        "storage.alias.write_pointer: os.fsync",
        "ledger.lock.FileWriterLock.acquire: os.replace",
    } <= names
    assert len(names) == len(SITES), "two sites share a name"
    for (path, function, call), reason in EXEMPT.items():
        assert (REPO / path).is_file() and function and call and reason


_REACHED: dict[str, list[str]] = {}


def reaching(site: Site, factory: pytest.TempPathFactory) -> list[str]:
    """The scenarios that reach ``site``, in :data:`ORDER`: each scenario recorded once,
    every site counted (so a site's test records only the scenarios that reach it)."""
    if not _REACHED:
        for name in ORDER:
            with counting(SITES) as seen:
                SCENARIOS[name].record(factory.mktemp(f"reach-{name}"), False)
            for hit in seen:
                _REACHED.setdefault(hit, []).append(name)
    return _REACHED.get(site.name, [])


def catch(site: Site, tmp_path: Path, order: list[str]) -> tuple[Caught | None, list[str]]:
    """Record the scenarios with ``site`` disabled until one reaches it and is caught."""
    tried = []
    for name in order:
        with disabled(site):
            try:
                recorded = SCENARIOS[name].record(tmp_path / name, False)
            except (TraceError, SyscallTraceError):
                raise  # the recorder failed, not the library: nothing was caught
            except (CkptDBError, OSError, AssertionError) as exc:
                if not reached():
                    raise
                return Caught(name, f"the recording failed: {type(exc).__name__}: {exc}"), tried
            if not reached():
                continue
            tried.append(name)
            with enabled_again(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                budget = budget_for(False)
                explorer = Explorer(
                    name,
                    recorded.trace,
                    recorded.check,
                    PosixMinimal(),
                    budget,
                    stop_at_first=not DEEP,
                    backward=True,
                )
                result = explorer.run()
        if result.violations:
            first = result.violations[0]
            return Caught(name, str(first), result.summary()), tried
    return None, tried


@pytest.mark.parametrize("site", SITES, ids=[site.name for site in SITES])
def test_each_durability_site_disabled_alone_is_caught(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, site: Site
) -> None:
    order = reaching(site, tmp_path_factory)
    assert order, f"{site.name}: no scenario reaches it"
    caught, tried = catch(site, tmp_path, order)
    assert tried or caught is not None, f"{site.name}: no scenario reaches it"
    assert caught is not None, f"{site.name} disabled went unnoticed in {tried}"
    print(f"\n{site.name} ({site.path}:{site.line}) caught by {caught.scenario}:")
    print(f"  {caught.how}\n  {caught.figures}")
