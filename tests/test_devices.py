"""Device specs: size parsing, presets, links, the calibrated `local` device and its cache."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import streamer.calibration.calibrate as calibrate
from layers import PRESETS
from memory_model import DEVICE_PRESETS, DeviceSpec, Link, SizeError, device_spec, format_size, parse_size
from memory_model.catalogue import BASES, Figure
from memory_model.devices import FIGURES, figure_values, with_figures
from streamer.calibration.calibrate import CalibrationSizes
from memory_model.kernels import KernelCosts

TINY = CalibrationSizes(matmul_n=32, probe_tokens=16, compute_seconds=0.5, copy_bytes=2**16, disk_bytes=2**16,
                        update_params=2**12, repeats=1)
DEBUG = PRESETS["gptj-debug"]


# --- parse_size ------------------------------------------------------------------------------------------------
def test_parse_size_units() -> None:
    assert parse_size("3GiB") == 3 * 2**30
    assert parse_size("3GB") == 3_000_000_000
    assert parse_size("512") == 512
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("40gb") == 40 * 10**9
    assert parse_size(123) == 123


@pytest.mark.parametrize("bad", ["3XB", "", "GiB", "-1GiB", "1e9", "3 G iB", "1..5GB"])
def test_parse_size_rejects_garbage_and_names_units(bad: str) -> None:
    with pytest.raises(SizeError) as err:
        parse_size(bad)
    assert "GiB" in str(err.value) and "GB" in str(err.value)


@pytest.mark.parametrize("bad", [-1, True, 1.5, None, [3]])
def test_parse_size_rejects_non_sizes(bad: object) -> None:
    with pytest.raises(SizeError):
        parse_size(bad)  # type: ignore[arg-type]


def test_size_error_is_a_value_error() -> None:
    assert issubclass(SizeError, ValueError)


@given(st.integers(min_value=0, max_value=2**50),
       st.sampled_from([("B", 1), ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("KiB", 2**10),
                        ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)]),
       st.sampled_from(["", " "]))
def test_parse_size_roundtrips_integers(n: int, unit: tuple[str, int], space: str) -> None:
    assert parse_size(f"{n}{space}{unit[0]}") == n * unit[1]


@given(st.text(max_size=12))
def test_parse_size_never_crashes_otherwise(text: str) -> None:
    try:
        assert parse_size(text) >= 0
    except SizeError:
        pass


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(1000 * 2**20) == "1000 MiB"
    assert format_size(3 * 2**30) == "3.00 GiB"


# --- presets and links ---------------------------------------------------------------------------------------------
def test_presets_exist_with_sources() -> None:
    assert set(DEVICE_PRESETS) == {"cs2", "cs3", "a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "gh200",
                                   "rtx4090", "v100"}
    for name, spec in DEVICE_PRESETS.items():
        assert spec.name == name and spec.source
        assert spec.flops["bf16"] > spec.flops["fp32"] > 0
        assert not spec.same_memory
        assert spec.matmul_efficiency < 1 and spec.bandwidth_efficiency < 1  # achievable, below the peaks
    assert DEVICE_PRESETS["cs2"].memory_bytes == 40 * 10**9
    assert DEVICE_PRESETS["cs2"].h2d.bandwidth_bytes_per_s == 150e9
    assert DEVICE_PRESETS["h100-sxm"].flops["bf16"] == 989e12
    assert device_spec("cs2") is DEVICE_PRESETS["cs2"]


def test_every_number_of_every_device_has_a_basis_and_sourced_ones_a_source(tmp_path) -> None:
    local = calibrate.calibrate(tmp_path, DEBUG, "fp32", TINY)
    for spec in [*DEVICE_PRESETS.values(), local]:
        values = figure_values(spec)
        assert set(values) <= set(FIGURES) and set(spec.figures) == set(values), spec.name
        for name, value in values.items():
            figure = spec.figures[name]
            assert figure.value == value and figure.basis in BASES, (spec.name, name)
            assert figure.source, (spec.name, name)  # sourced and derived name it; assumed and measured say how
    assert {f.basis for f in local.figures.values()} == {"measured"}
    with pytest.raises(ValueError, match="basis is one of"):
        Figure(1.0, "guessed", "x")
    with pytest.raises(ValueError, match="needs its source"):
        Figure(1.0, "sourced")


def test_published_figures_the_simulator_must_use() -> None:
    cs2, cs3, h100 = DEVICE_PRESETS["cs2"], DEVICE_PRESETS["cs3"], DEVICE_PRESETS["h100-sxm"]
    assert cs2.flops["bf16"] == 7.5e15 and cs2.figures["bf16_flops"].basis == "derived"  # Andromeda 120 PF / 16
    assert cs3.flops["bf16"] == 15e15  # dense, not the 125 PF sparsity-weighted "AI compute"
    assert cs2.update_on == cs3.update_on == "host" and cs2.reduce == "in-network"  # MemoryX updates, SwarmX sums
    assert h100.matmul_efficiency == 0.801 and h100.memory_bytes == 81559 * 2**20
    assert h100.h2d.bandwidth_bytes_per_s == h100.d2h.bandwidth_bytes_per_s == 63e9  # per direction, not the total
    assert DEVICE_PRESETS["gh200"].h2d.bandwidth_bytes_per_s == 450e9


def test_set_overrides_a_figure_and_marks_it() -> None:
    spec = with_figures(DEVICE_PRESETS["h100-sxm"], {"h2d_bytes_per_s": Figure(1e9, "assumed", "--set")})
    assert spec.h2d.bandwidth_bytes_per_s == 1e9 and spec.d2h.bandwidth_bytes_per_s == 63e9
    assert spec.figures["h2d_bytes_per_s"].source == "--set"
    with pytest.raises(ValueError, match="unknown device field"):
        with_figures(spec, {"warp_speed": Figure(1.0, "assumed", "x")})


def test_in_network_reduce_costs_hops_not_bytes() -> None:
    cs2, h100 = DEVICE_PRESETS["cs2"], DEVICE_PRESETS["h100-sxm"]
    assert cs2.allreduce_time(10**9, 16) == 3 * cs2.interconnect.latency_s  # ceil(log4 16) + 1 levels
    assert cs2.allreduce_time(10**12, 16) == cs2.allreduce_time(10**9, 16)
    assert h100.allreduce_time(10**12, 16) > 10 * h100.allreduce_time(10**9, 16)  # a ring moves bytes


def test_unknown_device_lists_choices() -> None:
    with pytest.raises(ValueError, match="cs2.*local"):
        device_spec("tpu-v9")


def test_link_time() -> None:
    link = Link(100e9, 1e-5)
    assert link.time(0) == 0.0
    assert link.time(10**9) == 1e-5 + 0.01  # measured equal: latency plus bytes / bandwidth
    with pytest.raises(ValueError):
        Link(0)
    with pytest.raises(ValueError):
        Link(1e9, -1.0)


def test_device_spec_is_frozen_validated_and_roundtrips() -> None:
    spec = DEVICE_PRESETS["h100-sxm"]
    with pytest.raises(AttributeError):
        spec.memory_bytes = 1  # type: ignore[misc]
    again = DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    raw = spec.to_dict()
    assert DeviceSpec.from_dict({**raw, "flops": {"bf16": 1e12}}).flops == {"bf16": 1e12}  # local rates one dtype
    with pytest.raises(ValueError, match="one or more of the compute dtypes"):
        DeviceSpec.from_dict({**raw, "flops": {}})
    with pytest.raises(ValueError, match="one or more of the compute dtypes"):
        DeviceSpec.from_dict({**raw, "flops": {"fp8": 1e12}})
    with pytest.raises(ValueError, match="memory_bytes"):
        DeviceSpec.from_dict({**raw, "memory_bytes": 0})
    with pytest.raises(ValueError, match="unknown"):
        DeviceSpec.from_dict({**raw, "colour": "green"})
    flops = {"bf16": 1e12, "fp32": 1e11}
    made = DeviceSpec.from_dict({**raw, "flops": flops})
    flops["bf16"] = 0  # the spec keeps its own copy
    assert made.flops["bf16"] == 1e12


# --- local calibration -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_store", [True, False])
def test_the_disk_is_read_as_the_store_reads_it(tmp_path, monkeypatch, as_store) -> None:
    """`local`'s disk figures (`as_store`) read the file as the store reads a state file: its whole blocks past the
    page cache where the filesystem allows (streamer.store.direct), the rest through it. The raw figures read it
    through the page cache."""
    import fcntl

    from streamer.store.direct import open_for_direct_reads
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(4096))
    fd = open_for_direct_reads(probe)
    if fd is None:
        pytest.skip(f"{tmp_path}'s filesystem has no O_DIRECT")
    os.close(fd)
    reads: list[tuple[bool, int, int]] = []  # (direct, offset, bytes)
    original = os.preadv

    def recording(fd: int, buffers, offset: int) -> int:
        n = original(fd, buffers, offset)
        reads.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, n))
        return n

    monkeypatch.setattr(os, "preadv", recording)
    nbytes = 2 * 8 * 2**20 + 5000  # two whole pieces, and one of a block and a rest
    read_bw, write_bw = calibrate.measure_disk(tmp_path / "disk", nbytes, as_store=as_store)
    assert read_bw > 0 and write_bw > 0
    piece = 8 * 2**20
    if as_store:
        assert reads == [(True, 0, piece), (True, piece, piece), (True, 2 * piece, 4096),
                         (False, 2 * piece + 4096, 904)]
    else:
        assert reads == [(False, 0, piece), (False, piece, piece), (False, 2 * piece, 5000)]


def test_attention_is_fitted_as_a_flop_rate_plus_a_cost_per_token_and_head(monkeypatch) -> None:
    """`local` times attention as one sequence and as short ones; the two times fit a FLOP rate and a cost per
    token and query head, so that a short sequence (a CPU's flash attention pays for whole blocks) is priced
    from the same fields as a long one. Timings made from known figures give those figures back; a long
    sequence no slower than the short ones leaves its FLOPs at the matmul rate and the rest per token."""
    from memory_model.kernels import attention_flops

    shape = PRESETS["gptj-debug"]
    truth = {"attention_forward_flops": 5e10, "attention_backward_flops": 8e10,
             "attention_forward_token_s": 2e-8, "attention_backward_token_s": 3e-7}

    def timed(run, params, repeats, deadline):
        batch, heads, seq, _ = params[0].shape
        flops, token_heads = attention_flops(shape, batch, seq), batch * seq * heads
        return (flops / truth["attention_forward_flops"] + token_heads * truth["attention_forward_token_s"],
                2 * flops / truth["attention_backward_flops"] + token_heads * truth["attention_backward_token_s"])

    monkeypatch.setattr(calibrate, "_forward_backward", timed)
    fields, forward_s, backward_s = calibrate._attention_costs(shape, torch.float32, 512, 1e12, 1, 0.0)
    assert fields == pytest.approx(truth, rel=1e-9)
    assert (forward_s, backward_s) == pytest.approx(timed(None, [torch.empty(1, 4, 512, 16)], 1, 0.0), rel=1e-9)

    monkeypatch.setattr(calibrate, "_forward_backward", lambda run, params, repeats, deadline: (1e-3, 2e-3))
    fields, forward_s, backward_s = calibrate._attention_costs(shape, torch.float32, 512, 1e12, 1, 0.0)
    assert fields["attention_forward_flops"] == fields["attention_backward_flops"] == 1e12
    assert (forward_s, backward_s) == pytest.approx((1e-3, 2e-3), rel=1e-9)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_calibrate_measures_this_machine_in_one_dtype(tmp_path, dtype) -> None:
    spec = calibrate.calibrate(tmp_path, DEBUG, dtype, TINY)
    assert spec.name == "local" and spec.same_memory
    assert set(spec.flops) == set(spec.kernels) == {dtype} and spec.flops[dtype] > 0
    assert spec.disk_read_bw > 0 and spec.disk_write_bw > 0 and spec.host_update_bw > 0
    assert spec.h2d == spec.d2h and spec.memory_bytes == spec.host_ram_bytes
    assert list(tmp_path.iterdir()) == []  # the disk test cleans up after itself
    costs = spec.kernels[dtype]  # the costs besides the matmuls, measured on the model's own units
    assert costs.attention_forward_flops > 0 and costs.attention_backward_flops > 0
    assert costs.logits_forward_s >= 0 and costs.embedding_backward_s > 0  # residuals: >= 0 by design
    assert costs.gradient_fold_bytes_per_s > 0 and costs.flush_s > 0  # a commit waits for the disk
    assert "vocab 256" in spec.notes[0]  # gptj-debug's head, not a fixed GPT-J-6B one
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="no compute rate for dtype 'fp8'"):
        spec.flops_for("fp8")


def test_calibration_probes_are_sized_from_the_model() -> None:
    sizes = CalibrationSizes()
    six = calibrate.probe_shape(PRESETS["gptj-6b"], sizes)
    # GPT-J-6B narrowed to 1024 wide in whole 256-wide heads, its MLP ratio, rotary and vocabulary kept.
    assert (six.n_embd, six.n_head, six.intermediate_size, six.rotary_dim, six.vocab_size, six.n_layer) == \
        (1024, 4, 4096, 64, 50400, 1)
    assert calibrate.probe_shape(DEBUG, sizes).n_embd == DEBUG.n_embd  # narrow models stay as they are
    # The probe's length follows the matmul rate: a CPU 100x slower gets 8 tokens, not minutes of probing.
    assert calibrate.probe_tokens(six, 1e15, 3, 3.0) == six.n_positions
    assert calibrate.probe_tokens(six, 1e9, 3, 3.0) == 8
    assert calibrate.probe_tokens(six, 1e11, 3, 3.0) in (16, 32, 64)


def test_kernel_costs_are_validated_and_roundtrip() -> None:
    good = KernelCosts(1e11, 1e11, 1e-9, 2e-9, 1e-9, 2e-9, 1e-10, 1e10, 1e10, 5e-4, 1e-3, 2e-3, 4e-3, 4e9, 5e-3)
    assert KernelCosts.from_dict(good.to_dict()) == good
    with pytest.raises(ValueError, match="attention_forward_flops must be a finite number > 0"):
        KernelCosts.from_dict({**good.to_dict(), "attention_forward_flops": 0.0})
    with pytest.raises(ValueError, match="elementwise_forward_s must be a finite number >= 0"):
        KernelCosts.from_dict({**good.to_dict(), "elementwise_forward_s": float("nan")})
    with pytest.raises(ValueError, match="needs exactly the fields"):
        KernelCosts.from_dict({"attention_forward_flops": 1.0})
    raw = DEVICE_PRESETS["h100-sxm"].to_dict()
    with pytest.raises(ValueError, match="kernels maps a compute dtype"):
        DeviceSpec.from_dict({**raw, "kernels": {"fp8": good.to_dict()}})


def test_local_spec_is_cached_per_dtype_and_model_and_refreshable(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)
    # A quiet machine throughout: a calibration taken while the suite's other worker kept the cores busy is
    # measured again once they are quiet (tested below, with the load set), which would change the cached one.
    monkeypatch.setattr(calibrate, "others_cores", lambda begin, end: 0.0)
    monkeypatch.setattr(calibrate, "load_now", lambda: 0.0)
    calls = []
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda d, shape, dtype, s=None: calls.append(dtype) or
                        real(d, shape, dtype, s))
    first = calibrate.local_spec(tmp_path, DEBUG, "fp32")
    assert (tmp_path / calibrate.CACHE_NAME).is_file() and calls == ["fp32"]
    assert calibrate.local_spec(tmp_path, DEBUG, "fp32") == first and calls == ["fp32"]
    calibrate.local_spec(tmp_path, DEBUG, "bf16")  # another dtype: measured, kept beside
    wider = replace(DEBUG, n_embd=128, n_inner=512)
    calibrate.local_spec(tmp_path, wider, "fp32")  # another probe shape: measured too
    assert calls == ["fp32", "bf16", "fp32"]
    assert calibrate.local_spec(tmp_path, DEBUG, "fp32") == first and len(calls) == 3
    calibrate.local_spec(tmp_path, DEBUG, "fp32", refresh=True)
    assert len(calls) == 4


def test_stale_or_damaged_cache_is_recalibrated(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)
    cache = tmp_path / calibrate.CACHE_NAME
    calibrate.local_spec(tmp_path, DEBUG, "fp32")
    payload = json.loads(cache.read_text())
    payload["fingerprint"]["cpus"] = -1  # as if copied from another machine
    (key,) = payload["entries"]
    payload["entries"][key]["spec"]["source"] = "stale"
    cache.write_text(json.dumps(payload))
    assert calibrate.local_spec(tmp_path, DEBUG, "fp32").source != "stale"
    cache.write_text("{not json")
    assert calibrate.local_spec(tmp_path, DEBUG, "fp32").name == "local"
    assert json.loads(cache.read_text())["version"] == calibrate.CACHE_VERSION


def test_a_calibration_taken_on_a_busy_machine_says_so_and_is_measured_again_when_quiet(tmp_path, monkeypatch,
                                                                                        capsys) -> None:
    """`streamer plan --target local` on a cached calibration: one taken while other processes kept the cores busy
    is said in one note line each time it is used, and measured again once the machine is quiet; a quiet one is
    reused whatever the load. The load readings are scripted: others keep `load["cores"]` busy."""
    from streamer.cli.main import main
    cores = os.cpu_count() or 1
    load, clock, made = {"cores": float(cores)}, [0.0, 0.0], []

    def cpu_clock() -> tuple[float, float, float]:  # a second passes between readings, others run load["cores"]
        clock[0] += 1.0
        clock[1] += load["cores"]
        return clock[0], clock[1], 0.0

    def measured(directory, shape, dtype, sizes=None):
        directory.mkdir(parents=True, exist_ok=True)
        made.append(load["cores"])
        return replace(DEVICE_PRESETS["a100-40g"], name="local", source=f"calibration {len(made)}")

    monkeypatch.setattr(calibrate, "cpu_clock", cpu_clock)
    monkeypatch.setattr(calibrate, "calibrate", measured)
    monkeypatch.setattr(calibrate, "QUIET_SAMPLE_S", 0.0)
    monkeypatch.chdir(tmp_path)

    def plan() -> list[str]:
        assert main(["plan", "--model", "gptj-debug", "--target", "local", "--batch", "2", "--seq", "32"]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if "other processes" in line]

    note = (f"note: calibrated while other processes kept {cores:.1f} of {cores} cores busy: its times may be slow; "
            "it is measured again when the machine is quiet (or now with `streamer calibrate`)")
    assert plan() == [note] and made == [cores]  # measured busy: said
    assert plan() == [note] and made == [cores]  # still busy: reused, said again
    entry = next(iter(json.loads((tmp_path / "runs" / calibrate.CACHE_NAME).read_text())["entries"].values()))
    assert entry["others_cores"] == cores and entry["spec"]["source"] == "calibration 1"
    load["cores"] = calibrate.BUSY_SHARE * cores  # at the threshold: quiet
    assert plan() == [] and made == [cores, load["cores"]]  # measured again, quietly
    load["cores"] = float(cores)
    assert plan() == [] and len(made) == 2  # a quiet calibration stays whatever the load now


def test_local_without_cache_dir(monkeypatch) -> None:
    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)
    assert calibrate.local_spec(None, DEBUG, "fp32").same_memory


def test_every_gpu_preset_names_its_host_and_its_host_update_follows_from_it() -> None:
    """GH200's host is a Grace CPU, not a dual-socket x86 server: its AdamW and gradient-fold rate come from its
    own memory bandwidth, with the same AdamW share of it as every other host."""
    from memory_model.catalogue import PRESET_HOSTS
    gpus = [name for name in DEVICE_PRESETS if not name.startswith("cs")]
    assert set(PRESET_HOSTS) == set(gpus)
    shares = set()
    for name in gpus:
        spec, host = DEVICE_PRESETS[name], PRESET_HOSTS[name]
        assert any(note.startswith(f"host: {host.cpu}, {host.cores.value:.0f} cores") for note in spec.notes)
        assert spec.figures["host_update_bw"].basis == "derived" and host.cpu in spec.figures["host_update_bw"].source
        shares.add(round(spec.host_update_bw / host.memory_bandwidth.value, 12))
    assert len(shares) == 1
    assert "Grace" in PRESET_HOSTS["gh200"].cpu and "x86" in PRESET_HOSTS["gh200"].cpu
    assert DEVICE_PRESETS["gh200"].host_update_bw != DEVICE_PRESETS["h100-sxm"].host_update_bw
