"""The ledger: accounting properties (hypothesis), budget enforcement, windows, threads, the OOM message."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory_model import CATEGORIES, DeviceOutOfMemory, Ledger, parse_size

LAYERS = ("embed", "block.0", "block.1", "head")


class LedgerMachine(RuleBasedStateMachine):
    """Random allocate / free / reset / window sequences against a plain model of what must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 10_000
        self.ledger = Ledger(self.capacity)
        self.live: dict[int, tuple[str, str, int]] = {}
        self.peak = 0
        self.windows: dict[int, tuple[int, int]] = {}  # ledger window -> (model peak, start in_use)

    def in_use(self) -> int:
        return sum(n for _, _, n in self.live.values())

    @rule(category=st.sampled_from(CATEGORIES), layer=st.sampled_from(LAYERS), nbytes=st.integers(0, 4_000))
    def allocate(self, category: str, layer: str, nbytes: int) -> None:
        before = self.ledger.breakdown()
        if self.in_use() + nbytes > self.capacity:
            with pytest.raises(DeviceOutOfMemory):
                self.ledger.allocate(category, layer, nbytes)
            assert self.ledger.breakdown() == before  # nothing charged for a refused allocation
            return
        handle = self.ledger.allocate(category, layer, nbytes, what="test")
        assert handle not in self.live
        self.live[handle] = (category, layer, nbytes)
        self.peak = max(self.peak, self.in_use())
        self.windows = {w: (max(p, self.in_use()), s) for w, (p, s) in self.windows.items()}

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live)))
        self.ledger.free(handle)
        del self.live[handle]

    @rule()
    def reset_peak(self) -> None:
        self.ledger.reset_peak()
        self.peak = self.in_use()

    @rule()
    def open_window(self) -> None:
        self.windows[self.ledger.open_window()] = (self.in_use(), self.in_use())

    @precondition(lambda self: self.windows)
    @rule(data=st.data())
    def close_window(self, data: st.DataObject) -> None:
        window = data.draw(st.sampled_from(sorted(self.windows)))
        stats = self.ledger.close_window(window)
        peak, start = self.windows.pop(window)
        assert (stats.peak, stats.start_in_use, stats.end_in_use) == (peak, start, self.in_use())
        assert sum(stats.peak_breakdown.values()) == stats.peak

    @invariant()
    def accounting_holds(self) -> None:
        ledger = self.ledger
        assert ledger.in_use == self.in_use() >= 0
        breakdown = ledger.breakdown()
        assert set(breakdown) == set(CATEGORIES)
        assert all(v >= 0 for v in breakdown.values()) and sum(breakdown.values()) == ledger.in_use
        for category in CATEGORIES:
            assert breakdown[category] == sum(n for c, _, n in self.live.values() if c == category)
        layers = ledger.by_layer()
        assert all(v > 0 for v in layers.values()) and sum(layers.values()) == ledger.in_use
        assert ledger.peak == self.peak >= ledger.in_use
        assert sum(ledger.peak_breakdown.values()) == ledger.peak
        assert sum(ledger.peak_layer_breakdown.values()) == ledger.peak
        assert ledger.live() == len(self.live)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(st.lists(st.one_of(st.tuples(st.sampled_from(CATEGORIES), st.integers(0, 10**12)), st.integers(0, 50)),
                max_size=60))
def test_peak_is_the_max_of_running_totals(ops: list) -> None:
    """Allocate (category, n) or free the k-th live allocation; the peak is the highest running total."""
    ledger = Ledger(None)
    live: list[tuple[int, int]] = []
    running = best = 0
    for op in ops:
        if isinstance(op, tuple):
            live.append((ledger.allocate(op[0], "block.0", op[1]), op[1]))
            running += op[1]
        elif live:
            handle, nbytes = live.pop(op % len(live))
            ledger.free(handle)
            running -= nbytes
        best = max(best, running)
        assert ledger.in_use == running >= 0
    assert ledger.peak == best
    for handle, _ in live:
        ledger.free(handle)
    assert ledger.in_use == 0 and ledger.breakdown() == dict.fromkeys(CATEGORIES, 0) and ledger.by_layer() == {}


def test_peak_breakdown_is_the_makeup_at_the_peak() -> None:
    ledger = Ledger(None)
    w = ledger.allocate("weights", "block.0", 100)
    a = ledger.allocate("activations", "block.0", 50)
    ledger.free(w)
    ledger.allocate("gradients", "block.1", 120)  # 170 total, a new peak
    assert ledger.peak == 170
    assert ledger.peak_breakdown == {**dict.fromkeys(CATEGORIES, 0), "activations": 50, "gradients": 120}
    assert ledger.peak_layer_breakdown == {"block.0": 50, "block.1": 120}
    ledger.free(a)
    ledger.reset_peak()
    assert ledger.peak == 120 and ledger.peak_breakdown["activations"] == 0


def test_a_window_for_a_layer_keeps_the_most_that_layer_held_of_each_category() -> None:
    ledger = Ledger(None)
    weights = ledger.allocate("weights", "block.0", 400)  # held before the window opens: counted
    window = ledger.open_window("block.0")
    ledger.free(ledger.allocate("optimizer", "block.1", 9000))  # another layer's: the device peak, not block.0's
    first = ledger.allocate("activations", "block.0", 300)
    ledger.free(first)
    ledger.free(ledger.allocate("activations", "block.0", 200))  # less than before: the most stays 300
    ledger.free(weights)
    stats = ledger.close_window(window)
    assert stats.layer_peaks == {"weights": 400, "gradients": 0, "optimizer": 0, "activations": 300, "workspace": 0}
    assert stats.peak == 9400 and stats.peak_breakdown["weights"] == 400
    assert ledger.close_window(ledger.open_window()).layer_peaks == {}  # a window for no layer keeps none


def test_rejects_bad_requests() -> None:
    ledger = Ledger(100)
    with pytest.raises(ValueError, match="category"):
        ledger.allocate("kv-cache", "block.0", 1)
    with pytest.raises(ValueError, match="nbytes"):
        ledger.allocate("weights", "block.0", -1)
    with pytest.raises(ValueError, match="nbytes"):
        ledger.allocate("weights", "block.0", 1.5)  # type: ignore[arg-type]
    h = ledger.allocate("weights", "block.0", 1)
    ledger.free(h)
    with pytest.raises(KeyError, match="freed twice"):
        ledger.free(h)
    with pytest.raises(KeyError):
        ledger.close_window(12345)
    with pytest.raises(ValueError):
        Ledger(0)


def test_exactly_full_is_allowed() -> None:
    ledger = Ledger(100)
    ledger.allocate("weights", "embed", 100)
    with pytest.raises(DeviceOutOfMemory):
        ledger.allocate("weights", "embed", 1)


def test_threads_keep_the_books_straight() -> None:
    ledger = Ledger(None)
    seen = []
    ledger.add_listener(lambda b: seen.append(sum(b.values())))

    def work(category: str) -> None:
        for i in range(2000):
            h = ledger.allocate(category, f"block.{i % 4}", 8)
            ledger.free(h)

    threads = [threading.Thread(target=work, args=(c,)) for c in ("weights", "gradients", "activations")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.in_use == 0 and ledger.live() == 0
    assert 8 <= ledger.peak <= 24
    assert len(seen) == 2 * 3 * 2000 and max(seen) == ledger.peak and seen[-1] == 0


# --- the out-of-memory message --------------------------------------------------------------------------------------
def _fill(ledger: Ledger) -> None:
    ledger.allocate("weights", "block.3", 2 * 2**30, "block.3 compute weights")
    ledger.allocate("activations", "block.2", 5 * 2**30, "saved (4, 2048, 4096) bfloat16")


def test_oom_message_names_request_breakdown_and_fixes() -> None:
    ledger = Ledger(8 * 2**30, device_name="budget 8GiB",
                    hint_context={"activations": "resident", "batch": 4, "seq": 2048})
    _fill(ledger)
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("activations", "block.3", 2 * 2**30, "saved (4, 2048, 16384) bfloat16")
    err = info.value
    msg = str(err)
    assert msg.startswith("device out of memory: allocating 2.00 GiB for activations of block.3 "
                          "(saved (4, 2048, 16384) bfloat16) with 7.00 GiB of 8.00 GiB in use")
    for part in ("weights 2.00 GiB", "gradients 0 B", "optimizer 0 B", "activations 5.00 GiB", "workspace 0 B"):
        assert part in msg
    assert "To fit:" in msg
    assert "--activations checkpoint" in msg
    assert "a smaller batch: at most about 3 x 2048 per micro-batch (--batch 3, or --grad-accum 2" in msg
    assert "--budget 9GiB" in msg
    assert "a100-40g" in msg and "cs2" in msg
    assert isinstance(err, RuntimeError)
    assert (err.category, err.layer, err.nbytes, err.capacity) == ("activations", "block.3", 2 * 2**30, 8 * 2**30)
    assert err.breakdown["activations"] == 5 * 2**30 and ledger.in_use == 7 * 2**30


def test_oom_without_hints_still_suggests_budget_and_devices() -> None:
    ledger = Ledger(2**30)
    ledger.allocate("weights", "embed", 2**29)
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("weights", "block.0", 2**30)
    msg = str(info.value)
    assert "--activations" not in msg and "smaller batch" not in msg
    assert "--budget 1.5GiB" in msg and "rtx4090" in msg


def test_oom_when_checkpointing_or_batch_one_does_not_suggest_them() -> None:
    ledger = Ledger(8 * 2**30, hint_context={"activations": "checkpoint", "batch": 1, "seq": 2048})
    _fill(ledger)
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("workspace", "head", 2 * 2**30)
    msg = str(info.value)
    assert "--activations checkpoint" not in msg and "smaller batch" not in msg


def test_oom_when_checkpointed_activations_dominate_suggests_offloading_them() -> None:
    ledger = Ledger(8 * 2**30, hint_context={"activations": "checkpoint", "batch": 1, "seq": 2048})
    _fill(ledger)  # 5 GiB of activations, the largest category
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("activations", "block.3", 4 * 2**30)
    assert "`--activations offload` (activations dominate; keep the block inputs in host memory)" in str(info.value)


def test_smaller_batch_advice_is_per_micro_batch() -> None:
    ledger = Ledger(8 * 2**30, hint_context={"batch": 16, "grad_accum": 4, "seq": 1024})
    _fill(ledger)  # 5 GiB of activations for a micro-batch of 4
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("activations", "block.3", 2 * 2**30)
    assert "at most about 3 x 1024 per micro-batch (--batch 12, or --grad-accum 6 to keep the batch of 16)" \
        in str(info.value)


def test_budget_advice_in_a_unit_that_fits_the_size() -> None:
    ledger = Ledger(2**20)
    ledger.allocate("weights", "embed", 2**20 - 10)
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("activations", "embed", 20_000)
    assert "--budget 2MiB or more" in str(info.value)
    assert parse_size("2MiB") >= 2**20 + 19_990


def test_planned_peak_hint_sizes_the_advice() -> None:
    ledger = Ledger(2**30, hint_context={"planned_peak_bytes": 50 * 2**30})
    with pytest.raises(DeviceOutOfMemory) as info:
        ledger.allocate("weights", "embed", 2 * 2**30)
    msg = str(info.value)
    assert "--budget 50GiB" in msg
    assert "rtx4090" not in msg and "a100-40g" not in msg and "a100-80g" in msg
