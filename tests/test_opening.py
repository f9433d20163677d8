"""``ckptdb.storage.open_store``: the one place that decides which store a location gets.

A local path gets a ``LocalStore``; an object URL the store of its scheme, one
entry per scheme of ``ckptdb.location.OBJECT_SCHEMES``; options meant for an
object store are refused on a local path, as the manager refuses them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptdb.errors import InvalidArgumentError
from ckptdb.location import OBJECT_SCHEMES, ObjectPath, object_path
from ckptdb.storage import LocalStore, open_store
from ckptdb.storage.opening import OBJECT_STORES

#: Options that reach no store: nothing is contacted with ``probe=False``.
OFFLINE = {"endpoint_url": "http://127.0.0.1:9", "region_name": "x"}


def test_every_object_scheme_has_a_store() -> None:
    assert set(OBJECT_STORES) == set(OBJECT_SCHEMES)


def test_a_local_path_gets_a_local_store(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert isinstance(store, LocalStore) and store.location == tmp_path
    assert open_store(str(tmp_path)).location == tmp_path


def test_options_on_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        open_store(tmp_path, {"region_name": "x"})
    assert str(info.value) == (
        f"storage_options are for an object-store save_dir (s3://...), not {tmp_path}"
    )


@pytest.mark.parametrize("location", ["s3://ckptdb-test/run", object_path("s3://ckptdb-test/run")])
def test_an_object_url_gets_its_scheme_store(location: str | ObjectPath) -> None:
    pytest.importorskip("boto3")
    store = open_store(location, OFFLINE, probe=False)
    assert type(store).__name__ == "S3Store" and not store.renames
    assert store.location == object_path("s3://ckptdb-test/run")


def test_bad_object_store_options_are_refused_before_anything_is_contacted() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown storage_options"):
        open_store("s3://ckptdb-test/run", {"no_such_option": 1})


def test_a_malformed_object_url_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="is not a valid bucket name"):
        open_store("s3://B/run")
