"""The autopilot's policy table keeps its per-device index in step with its rows
(sidecar/_policy_table.py): a pass over one device visits exactly that device's rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar._autopilot_store import PolicyRow
from sidecar._policy_table import PolicyTable

_IDS = st.sampled_from([f"i{k}" for k in range(8)])
_DEVICES = st.none() | st.sampled_from(["gpu0", "gpu1", "gpu2"])
_OPS = st.lists(
    st.tuples(st.sampled_from(["set", "update", "pop"]), _IDS, _DEVICES, st.integers(0, 9)),
    max_size=60,
)


@given(_OPS)
def test_the_device_index_matches_a_scan_of_the_rows(
    ops: list[tuple[str, str, str | None, int]],
) -> None:
    table = PolicyTable()
    rows: dict[str, PolicyRow] = {}  # the same writes on a plain dict: what a scan finds
    for op, iid, device, weight in ops:
        row = PolicyRow(iid, device_id=device, weight=1.0 + weight)
        if op == "set":
            table[iid], rows[iid] = row, row
        elif op == "update":
            other = replace(row, id=f"{iid}x")
            table.update([row, other])
            rows.update({iid: row, other.id: other})
        else:
            assert table.pop(iid) == rows.pop(iid, None)
    assert {iid: table.get(iid) for iid in table} == rows
    devices = {p.device_id for p in rows.values() if p.device_id is not None}
    assert table.device_ids() == devices
    for device in devices | {"gpu9"}:
        want = [rows[i] for i in sorted(rows) if rows[i].device_id == device]
        assert table.on_device(device) == want


def test_a_row_is_stored_under_its_own_id_only() -> None:
    with pytest.raises(ValueError, match="stored under"):
        PolicyTable()["a"] = PolicyRow("b")
