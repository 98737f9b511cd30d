"""The slow-link detector's window (rankscope/collector/diagnosis/transfer_window.py) against a store that
answers the two queries by hand: a step is read once, again only when the store holds more of it,
and the per-pair medians are exact over the window."""

from __future__ import annotations

import pyarrow as pa

from rankscope.collector.diagnosis.context import RunContext

from rankscope.common.settings import Settings
from rankscope.collector.diagnosis.transfer_window import COUNTS_SQL, TRANSFERS_SQL, TransferWindow


class Store:
    """Transfers per step (src, dst, nbytes, t, end_ns), and the steps each transfers query asked for."""

    def __init__(self) -> None:
        self.steps: dict[int, list[tuple[int, int, int, int, int]]] = {}
        self.read: list[list[int]] = []

    def query(self, sql: str, params: dict) -> pa.Table:
        if sql == COUNTS_SQL:
            steps = [s for s in sorted(self.steps) if params["first_step"] <= s <= params["last_step"]]
            return pa.table({"step": steps, "n": [len(self.steps[s]) for s in steps]})
        assert sql == TRANSFERS_SQL
        self.read.append(list(params["steps"]))
        rows = [(s, *t) for s in params["steps"] for t in self.steps.get(s, [])]
        names = ("step", "src", "dst", "nbytes", "t", "end_ns")
        return pa.table({name: [r[i] for r in rows] for i, name in enumerate(names)})


def by_pair(pairs) -> dict[tuple[int, int, int], dict]:
    return {(r["src"], r["dst"], r["nbytes"]): r for r in pairs.to_dict("records")}


def test_a_step_is_read_once_and_again_only_when_the_store_holds_more_of_it() -> None:
    store = Store()
    for step in (2, 3, 4):
        store.steps[step] = [(0, 1, 64, 10 * step, step * 100), (1, 2, 64, 5, step * 100), (2, 3, 64, 7, step * 100)]
    ctx = RunContext("r", store.query, Settings(), 0)
    window = TransferWindow.of(ctx)
    assert TransferWindow.of(ctx) is window  # kept for the next pass
    pairs, steps = window.pairs_of(ctx, 2, 4)
    assert store.read == [[2, 3, 4]] and steps == 3
    assert by_pair(pairs)[(0, 1, 64)] == {"src": 0, "dst": 1, "nbytes": 64, "transfers": 3, "median_ns": 30.0, "first_ns": 200,
                                          "last_ns": 400}  # fmt: skip
    assert window.pairs_of(ctx, 2, 4)[0] is pairs and store.read == [[2, 3, 4]]  # nothing new: nothing read or computed
    store.steps[3].append((0, 1, 64, 80, 350))  # a late rank's row of step 3
    store.steps[5] = [(0, 1, 64, 1, 500)]
    pairs, steps = window.pairs_of(ctx, 3, 5)
    assert store.read == [[2, 3, 4], [3, 5]]  # step 3 again, step 5 first; step 2 left the window
    assert sorted(window.transfers) == [3, 4, 5] and steps == 3
    assert by_pair(pairs)[(0, 1, 64)]["median_ns"] == (30 + 40) / 2  # 1, 30, 40, 80: the mean of the two middle values
    assert set(by_pair(pairs)) == {(0, 1, 64), (1, 2, 64), (2, 3, 64)}


def test_a_pair_with_one_transfer_in_the_window_is_not_judged() -> None:
    store = Store()
    store.steps[2] = [(0, 1, 64, 10, 100), (4, 5, 64, 10, 100), (4, 5, 64, 12, 110)]
    ctx = RunContext("r", store.query, Settings(), 0)
    assert list(by_pair(TransferWindow.of(ctx).pairs_of(ctx, 2, 2)[0])) == [(4, 5, 64)]


def test_the_typical_pair_is_the_exact_median_of_the_others_moving_the_same_bytes() -> None:
    import numpy as np

    from rankscope.collector.diagnosis.slow_link import _typical

    sizes = np.array([64, 64, 64, 64, 128, 128])
    medians = np.array([1.0, 2.0, 3.0, 100.0, 5.0, 6.0])
    typical, compared = _typical(sizes, medians)
    expected = [np.median(np.delete(medians[:4], i)) for i in range(4)]
    assert typical[:4].tolist() == expected and compared.tolist() == [3, 3, 3, 3, 0, 0]
    assert np.isnan(typical[4:]).all()  # one other pair: nothing to compare with
